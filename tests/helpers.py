"""Shared test utilities (no fixtures: plain functions)."""
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time

import torch

from coat_ds.integrations.deepspeed.engine import free_port as any_free_port


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    ref, approx = ref.double(), approx.double()
    noise = (ref - approx).pow(2).sum().item()
    return math.inf if noise == 0 else 10 * math.log10(ref.pow(2).sum().item() / noise)


def head_data(n: int, hidden: int, vocab: int, bias: bool, seed: int, w_scale: float, ignored: float):
    """Fresh random inputs of an LM head's loss: hidden states, weight and bias (leaves that
    need grad) and labels, a share `ignored` of them -100."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * w_scale).requires_grad_()
    b = (torch.randn(vocab, generator=g) * 0.1).requires_grad_() if bias else None
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[torch.rand(n, generator=g) < ignored] = -100
    return h, w, b, labels


def stored_as_is(t: torch.Tensor, out) -> bool:
    """A saved-tensor hook stored `t` itself, or `t` detached: the same memory, no copy."""
    out = getattr(out, "tensor", out)  # the hooks wrap it with the version it was saved at
    return (isinstance(out, torch.Tensor) and out.data_ptr() == t.data_ptr() and out.shape == t.shape
            and out.stride() == t.stride() and out.dtype == t.dtype)


def spy_packs(handle, keep_tensors=True) -> list:
    """Record (saved tensor, what the hook stored) for every pack call of `handle`'s hooks
    (compress_activations' handle); with keep_tensors=False only the tensor's address, so
    that the spy keeps nothing alive. `del handle.compressor.pack` stops it."""
    seen = []
    pack = handle.compressor.pack

    def spying_pack(t):
        out = pack(t)
        seen.append((t if keep_tensors else t.data_ptr(), out))
        return out

    handle.compressor.pack = spying_pack
    return seen


def bound(op: str):
    """The file of registry op `op` with its Triton kernels compiled (`TRITON`, its launchers,
    callable), whatever device the caller's tensors are on: the caller has checked that
    Triton runs there (TRITON_INTERPRET=1 on CPU)."""
    from coat_ds.kernels import jit, registry

    module = registry.OPS[op]
    jit.bind(module)
    return module


def moments_like(shape, seed: int, device="cpu"):
    """Non-zero first and second moments spanning the decades real AdamW moments span, with
    m**2 <= v as AdamW's own moments satisfy (so |m| / sqrt(v) <= 1)."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g) * 1.5) * 1e-3
    v = m**2 * torch.exp(torch.randn(shape, generator=g).abs() * 2) + 1e-30
    return m.to(device), v.to(device)


def _worker_ports() -> range | None:
    """Under pytest-xdist, this worker's share of the 12,000 ports just below the kernel's
    ephemeral ones: ports that no other worker's free_port and no connection's local port
    (the kernel takes those from the ephemeral range: gloo's, a launcher's) can take
    between free_port and the launcher binding it. None outside xdist or where that range
    is unusual."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral = int(f.read().split()[0])
        index, count = int(worker.removeprefix("gw")), int(count)
    except (OSError, ValueError, TypeError, IndexError):
        return None
    if ephemeral < 12_000 + 1024 or not 0 <= index < count:
        return None
    share = 12_000 // count
    start = ephemeral - 12_000 + index * share
    return range(start, start + share)


def free_port() -> int:
    """A free local TCP port: other suites may launch torchrun at the same time, and under
    pytest-xdist another worker may be launching one now (see _worker_ports). Free on every
    address, as the launchers' stores bind it: a port held on one other address (127.0.0.2, a
    NIC's) binds on 127.0.0.1 but not on theirs."""
    ports = _worker_ports()
    if ports is not None:
        pick = random.SystemRandom()
        for _ in range(200):
            port = pick.choice(ports)
            with socket.socket() as sock:
                try:
                    sock.bind(("", port))
                except OSError:
                    continue
                return port
    return any_free_port()


def end_worker() -> None:
    """End a multi-rank test worker: collect engine state and end the process group on every rank
    together (`shutdown_distributed`, as train.py ends), then exit without interpreter
    finalization. FSDP and DeepSpeed objects hold the gloo group past destroy_process_group, and
    its teardown while the interpreter finalizes intermittently aborts a worker that already
    passed ("terminate called without an active exception", SIGABRT)."""
    from coat_ds.integrations.process_group import shutdown_distributed

    shutdown_distributed()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _repo_env(env: dict) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
            **env}


def run_in_repo(cmd: list[str], timeout: int, **env) -> subprocess.CompletedProcess:
    """Run `cmd` (a launcher and train.py, say) from the repository root with the repo on
    PYTHONPATH, one OpenMP thread and `env` added; fail with its output unless it exits 0.
    A non-zero status includes a SIGABRT of a gloo group at interpreter exit."""
    proc = subprocess.run(cmd, cwd=ROOT, env=_repo_env(env), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return proc


def run_ranks(script: str, *args: str, timeout: int, nproc: int = 2, **env) -> subprocess.CompletedProcess:
    """`script args` on `nproc` local ranks under torchrun (a free port), as `run_in_repo` runs it."""
    return run_in_repo([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
                        str(free_port()), script, *args], timeout, **env)


def run_failing_in_repo(cmd: list[str], timeout: int, **env) -> subprocess.CompletedProcess:
    """As `run_in_repo`, for a command that must exit non-zero."""
    proc = subprocess.run(cmd, cwd=ROOT, env=_repo_env(env), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode != 0, f"{' '.join(cmd)} succeeded\n{proc.stdout[-4000:]}"
    return proc


def read_metrics(path) -> dict[int, dict]:
    """train.py's --metrics-file (JSON lines) merged per step."""
    out: dict[int, dict] = {}
    for line in open(path):
        m = json.loads(line)
        out.setdefault(m["step"], {}).update(m)
    return out


def run_killed_in_save(cmd: list[str], timeout: int, pidfile=None, **env) -> str:
    """Run `cmd` (a 2-rank train.py) that must die inside a checkpoint save, as set by
    `COAT_DS_CKPT_FAULT` in `env`; with `pidfile` (action=pause), SIGKILL the rank whose
    process id appears there. Returns stdout + stderr; fails if the run exits 0."""
    env = _repo_env(env)
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            while pidfile is not None and not os.path.exists(pidfile):
                assert proc.poll() is None, "the run ended before reaching the save to kill"
                assert time.monotonic() < deadline, f"no {pidfile} after {timeout} s"
                time.sleep(0.2)
            if pidfile is not None:
                with open(pidfile) as f:
                    os.kill(int(f.read()), signal.SIGKILL)
            proc.wait(max(1.0, deadline - time.monotonic()))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        log.seek(0)
        out = log.read()
    assert proc.returncode != 0, f"{' '.join(cmd)} was not killed inside its save\n{out[-4000:]}"
    return out


def census():
    """bench/_census.py: counters of the ops dispatched and Triton kernels launched (the
    interpreter's) in a block of code."""
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    import _census

    return _census
