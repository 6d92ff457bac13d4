import multiprocessing.process
import os
import subprocess
import sys

import torch

# Triton reads this when a kernel is defined, so it must be set before coat_ds.kernels'
# Triton modules are imported: on a CPU-only machine every Triton kernel runs interpreted.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _starts_python(args) -> bool:
    """A command that runs Python (ours, a launcher, a rank), not a compiler or Inductor's
    compile workers, which single-process tests start too."""
    argv = [args] if isinstance(args, (str, bytes)) else list(args)
    text = " ".join(map(str, argv))
    if "compile_worker" in text:
        return False
    exe = os.path.basename(str(argv[0]).split()[0]) if argv else ""
    return exe.startswith("python") or exe in ("torchrun", "deepspeed") or str(argv[0]) == sys.executable


@pytest.fixture(autouse=True)
def _multi_process_tests_are_slow(request, monkeypatch):
    """`-m "not slow"` promises no multi-process runs: a test that starts another Python
    process (a launcher, ranks, a script) without the `slow` mark fails here."""
    if "slow" in request.node.keywords:
        yield
        return
    started = []
    popen_init = subprocess.Popen.__init__
    process_start = multiprocessing.process.BaseProcess.start

    def init(self, args, *a, **kw):
        if _starts_python(args):
            started.append(" ".join(map(str, [args] if isinstance(args, (str, bytes)) else args))[:120])
        popen_init(self, args, *a, **kw)

    def start(self):
        started.append(f"multiprocessing {self.name}")
        process_start(self)

    monkeypatch.setattr(subprocess.Popen, "__init__", init)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", start)
    yield
    if started:
        pytest.fail(f"{request.node.nodeid} starts other processes (`{started[0]}`): mark it @pytest.mark.slow",
                    pytrace=False)
