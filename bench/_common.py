"""What every bench script shares: model builders, timing, sides in subprocesses, same-call A/B
against another checkout (`--tree DIR`), results as JSON, a short table printed last; and what
those that train a model share: byte-pair tokens for a realistic LM head, the LR schedule and
--act-config's ActivationConfig fields.

A script's side runs in a process of its own (honest peaks) through `run_child`: the child is
the same script with `--child SPEC`, and prints one `RESULT {json}` line. With `--tree DIR`
the child runs with DIR's coat_ds first on the path (this tree's harness, the other tree's
library), alternating with this tree for `--rounds` rounds, so that drift shows as spread.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The tree whose coat_ds this process measures: another checkout's under --tree, else this one.
TREE = Path(os.environ.get("COAT_BENCH_TREE", ROOT)).resolve()
sys.path.insert(1, str(TREE))

import torch  # noqa: E402

# Llama shapes of the end-to-end benches (HF LlamaForCausalLM from a config, nothing downloaded).
SHAPES = {
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32,
               num_hidden_layers=6, vocab_size=32000),
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=16, num_key_value_heads=16,
               num_hidden_layers=16, vocab_size=32000),
    # TinyLlama-1.1B's shape (GQA 32/4), the activation bench's model.
    "1.1b": dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=4,
                 num_hidden_layers=22, vocab_size=32000),
    # A small model a user fine-tunes first (~134M with the 32000 vocabulary; timed
    # eagerly at bs 16 x 512).
    "110m": dict(hidden_size=768, intermediate_size=2048, num_attention_heads=12, num_key_value_heads=12,
                 num_hidden_layers=12, vocab_size=32000),
    # Between them (train.py's 350m preset's width and depth, HF's 2.75x MLP).
    "350m": dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=16,
                 num_hidden_layers=24, vocab_size=32000),
    # CPU runs: a small vocabulary, so that the layers, not the logits, make the peak.
    "tiny": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
                 num_hidden_layers=3, vocab_size=512),
}


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def llama_config(shape: str, seq: int = 2048, **overrides):
    from transformers import LlamaConfig

    return LlamaConfig(**{**SHAPES[shape], **overrides}, max_position_embeddings=max(seq, 64),
                       attn_implementation="sdpa", use_cache=False)


def hf_llama(shape: str, seq: int = 2048, dev=None, dtype=None, **overrides):
    """HF LlamaForCausalLM of `shape`, seed 0, built on `dev` (default: the GPU if any)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(dev or device()):
        model = LlamaForCausalLM(llama_config(shape, seq, **overrides))
    return model.to(dtype) if dtype else model


class DecoderLayer(torch.nn.Module):
    """One HF Llama decoder layer that takes hidden states only (rotary tables made inside)."""

    def __init__(self, shape: str, **overrides):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        cfg = llama_config(shape, **overrides)
        self.layer, self.rotary = LlamaDecoderLayer(cfg, 0), LlamaRotaryEmbedding(cfg)

    def forward(self, x):
        pos = torch.arange(x.shape[1], device=x.device)[None]
        return self.layer(x, position_embeddings=self.rotary(x, pos))


def decoder_layers(model) -> list:
    return list(model.model.layers) if hasattr(model, "model") else [model.layer]


def compile_layers(model) -> None:
    """Every decoder layer compiled in place, one graph per shape (no symbolic sizes)."""
    torch._dynamo.config.automatic_dynamic_shapes = False
    torch._dynamo.config.recompile_limit = 64
    for layer in decoder_layers(model):
        layer.compile()


def lm_loss(logits, ids):
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                             ids[:, 1:].reshape(-1))


# -- timing ------------------------------------------------------------------------------------

def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def step_ms(fn, iters: int, warmup: int = 3) -> list[float]:
    """Per-call times of `fn` after `warmup` calls: CUDA events on a GPU, the wall clock on CPU."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        if torch.cuda.is_available():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def median_ms(fn, iters: int, warmup: int = 3) -> float:
    return statistics.median(step_ms(fn, iters, warmup))


def wall_ms(fn, reps: int = 30, warmup: int = 5) -> float:
    """Wall time per call of `reps` calls back to back, then one sync: the host's time where
    it cannot keep the GPU busy, the GPU's where it can."""
    for _ in range(warmup):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t0) * 1e3 / reps


def device_ms(fn, reps: int = 20) -> float:
    """Device time per call with the GPU queue kept full: a sleep kernel holds the GPU while the
    host enqueues every call, so the events bracket GPU work, not launch latency."""
    fn()
    sync()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(200_000_000)  # GPU cycles: longer than enqueueing `reps` calls
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_bytes() -> int:
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0


def peak_gb() -> float:
    return peak_bytes() / 1e9 if torch.cuda.is_available() else float("nan")


def allocated() -> int:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


def copy_tbs(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy bandwidth, TB/s counting read and write."""
    src = torch.empty(nbytes // 4, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), 10)
    return 2 * nbytes / ms / 1e9


def kernel_table(step, top: int = 30) -> list[str]:
    """torch.profiler table of one call of `step`: device kernels by total time."""
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        sync()
    key = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    return [prof.key_averages().table(sort_by=key, row_limit=top, max_name_column_width=120)]


# -- command line, children, A/B ----------------------------------------------------------------

def add_common(ap: argparse.ArgumentParser, ab: bool = True) -> None:
    ap.add_argument("--out", default=None, help="folder for the results JSON (and logs)")
    if ab:
        ap.add_argument("--tree", default=None, help="another checkout: its coat_ds runs the same sides in the "
                        "same call, alternating with this tree's (same-call A/B)")
        ap.add_argument("--rounds", type=int, default=2, help="with --tree: rounds of both trees")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)


def ngpu() -> int:
    """Ranks a multi-GPU script starts: NGPU, else every GPU, else one (a CPU run)."""
    return int(os.environ.get("NGPU") or 0) or torch.cuda.device_count() or 1


def launch(cmd: list[str], log: str, limit: float, env: dict | None = None, append: bool = False) -> int:
    """Run `cmd` from the repository root with its output in `log` (after what it holds, with
    `append`); its exit code, 124 past `limit` s. It runs in a process group of its own: past
    the limit the whole group gets SIGTERM (a launcher then ends its ranks; killing the
    launcher alone would leave them holding the GPUs), and SIGKILL 30 s later; on an
    interrupt, SIGTERM."""
    with open(log, "a" if append else "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
        try:
            return proc.wait(limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            return 124
        except BaseException:  # Ctrl-C: the group is not the terminal's any more, so end it here
            os.killpg(proc.pid, signal.SIGTERM)
            raise


def header() -> str:
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    return f"# {dev}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, coat_ds from {TREE}"


def emit(result) -> None:
    """A child's result, the one line its parent reads."""
    print("RESULT " + json.dumps(result), flush=True)


def run_child(argv: list[str], spec: str, tree: str | None = None, log: str | None = None,
              timeout: float | None = None, echo: bool = False) -> dict:
    """This script again in a process of its own with `--child spec` (and `tree`'s coat_ds):
    its RESULT, or a row holding the error. `echo` prints the rest of its output."""
    env = dict(os.environ, COAT_BENCH_TREE=str(Path(tree or ROOT).resolve()))
    env["PYTHONPATH"] = os.pathsep.join([env["COAT_BENCH_TREE"], env.get("PYTHONPATH", "")])
    cmd = [sys.executable, os.path.abspath(sys.argv[0]), *argv, "--child", spec]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        out, err = proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        out, err = e.stdout or "", (e.stderr or "") + f"\ntimed out after {timeout} s"
        out, err = (out.decode() if isinstance(out, bytes) else out), (err.decode() if isinstance(err, bytes) else err)
    if log:
        os.makedirs(os.path.dirname(log) or ".", exist_ok=True)
        Path(log).write_text(out + err)
    found = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    if echo:
        print("\n".join(ln for ln in out.splitlines() if not ln.startswith("RESULT ")), flush=True)
    if found:
        return json.loads(found[-1][len("RESULT "):])
    return {"error": (err.strip().splitlines() or ["no output"])[-1]}


def trees(args) -> list[tuple[str, str | None]]:
    """(label, tree) per side to run: this tree, then --tree's, for each of --rounds rounds."""
    if not getattr(args, "tree", None):
        return [("this", None)]
    return [(label, tree) for _ in range(args.rounds) for label, tree in (("other", args.tree), ("this", None))]


def ab_table(rows: list[dict], key, value: str, unit: str = "ms", delta: bool = False) -> list[str]:
    """Rows tagged `tree` ('this'/'other') with the same key: per-round values, then this / other
    of the medians (or this - other, for a value that is itself a relative figure)."""
    by: dict = {}
    for r in rows:
        if value in r:
            by.setdefault(key(r), {}).setdefault(r["tree"], []).append(r[value])
    compare = "this - other" if delta else "this / other"
    lines = [f"| case | other tree, {unit} per round | this tree | {compare} (medians) |", "|---|---|---|---|"]
    for k, sides in by.items():
        other, this = sides.get("other", []), sides.get("this", [])
        mo, mt = (statistics.median(other), statistics.median(this)) if other and this else (None, None)
        ratio = "" if mo is None else f"{mt - mo:+.2f}" if delta else f"{mt / mo:.3f}"
        fmt = lambda xs: " / ".join(f"{x:.2f}" for x in xs)  # noqa: E731
        lines.append(f"| {k} | {fmt(other)} | {fmt(this)} | {ratio} |")
    return lines


def finish(args, name: str, result, table: list[str]) -> None:
    """Write `result` to --out/name.json, then print the table (the last lines printed)."""
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        Path(args.out, name + ".json").write_text(json.dumps(result, indent=1) + "\n")
    print("\n".join(table))


def child_argv(argv: list[str], drop=("--tree", "--rounds", "--out")) -> list[str]:
    """`argv` without the parent's own options and their values, for a child."""
    out, skip = [], False
    for a in argv:
        if a.startswith("--"):
            skip = a in drop
        if not skip and not any(a.startswith(d + "=") for d in drop):
            out.append(a)
    return out


def run_trees(args, argv: list[str], spec: str = "run", **kw) -> list[dict]:
    """The whole run as a child per tree and round (see `trees`), each row tagged with its tree
    and round; a child that failed becomes one row holding its error."""
    rows = []
    for i, (label, tree) in enumerate(trees(args)):
        res = run_child(child_argv(argv), spec, tree, **kw)
        for r in res.get("rows", [res]):
            rows.append({**r, "tree": label, "round": i // 2 + 1})
        print(json.dumps({"tree": label, "error": res["error"]} if "error" in res else {"tree": label, "done": i}),
              flush=True)
    return rows


# -- what the scripts that train a model share (parity.py, grad_error.py; optim_step.py --loop) --

def pair_tokens(data, vocab: int):
    """`data` (bytes) in a vocabulary of `vocab` tokens, for a realistically sized LM head
    without a downloaded tokenizer: each byte pair at an even offset is one token (256 + its
    rank) if it is among the vocab - 256 pairs most frequent at even offsets of the train
    split, else its two bytes. Deterministic, a pure function of the data."""
    from coat_ds.train.data import TokenData

    if not 256 < vocab <= 256 + 65536:
        raise SystemExit(f"--pair-vocab must be in (256, {256 + 65536}], got {vocab}")
    train = data.train.long()
    pairs = train[:train.numel() // 2 * 2].view(-1, 2)
    freq = torch.bincount(pairs[:, 0] * 256 + pairs[:, 1], minlength=65536)
    rank = torch.full((65536,), -1, dtype=torch.long)
    rank[torch.sort(freq, descending=True, stable=True).indices[:vocab - 256]] = torch.arange(vocab - 256)

    def encode(t: torch.Tensor) -> torch.Tensor:
        t = t.long()
        p = t[:t.numel() // 2 * 2].view(-1, 2)
        r = rank[p[:, 0] * 256 + p[:, 1]]
        one = r >= 0
        width = torch.where(one, 1, 2)
        at = torch.cumsum(width, 0) - width
        out = torch.empty(int(width.sum()), dtype=torch.long)
        out[at[one]] = 256 + r[one]
        out[at[~one]], out[at[~one] + 1] = p[~one, 0], p[~one, 1]
        return out

    tr, va = encode(data.train), encode(data.val)
    return TokenData(tr, va, vocab, f"{data.description}, as {vocab} byte-pair tokens ({tr.numel():,} train / "
                     f"{va.numel():,} val)")


def lr_at(step: int, steps: int, warmup: int, peak: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def act_overrides(pairs: list[str]) -> dict:
    """--act-config KEY=VALUE pairs as ActivationConfig keywords ("true"/"false" as bools,
    digits as ints), checked by building the config once."""
    from coat_ds import ActivationConfig

    fields = {f.name for f in dataclasses.fields(ActivationConfig)}
    out = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or key not in fields:
            raise SystemExit(f"--act-config {pair!r}: expected KEY=VALUE with KEY one of {', '.join(sorted(fields))}")
        low = value.lower()
        out[key] = low == "true" if low in ("true", "false") else int(value) if value.lstrip("-").isdigit() else value
    try:
        ActivationConfig(**out)
    except (TypeError, ValueError) as e:
        raise SystemExit(f"--act-config: {e}") from None
    return out
