"""Triton: its version, and launching a compiled kernel without `JITFunction`'s per-call work.

`JITFunction.__getitem__(grid)(...)` binds and re-specializes every argument, builds a cache
key and checks globals on each call: several times the host time of the compiled kernel's
own launcher, for a typical saved tensor's little GPU work. `fast_launcher(kernel)` calls
that launcher directly, with the arguments `JITFunction.run` gives it (grid, raw stream of
the current device, function handle, packed metadata, launch metadata and hooks, every
parameter in order). None of that
is public: the launcher's argument order, `CompiledKernel.run` / `.function` /
`.packed_metadata`, `triton.knobs.runtime`'s launch hooks and torch's raw-stream getters
(`torch._C._cuda_getCurrentRawStream`, `torch._C._cuda_getDevice`).

Checked on Triton 3.6 (the GPU runs) and 3.9 (CPU CI, interpreter). Probe: the installed
version is one of those, the hooks and the stream getters exist, the compiled kernel has its
handles. Fallback where it fails on a CUDA device: the public `fn[grid](...)` launch, more
host time per launch; one RuntimeWarning says so. CPU tensors (the interpreter)
always launch through `fn[grid]`, so they neither need the probe nor warn.

The caller caches one launcher per `specialization_key`: everything Triton specializes these
kernels on, so that a kernel compiled under one specialization is never launched with
arguments of another.
"""
from __future__ import annotations

from contextlib import contextmanager
from functools import lru_cache

import torch

from . import warn_once

__all__ = ["TRITON_MIN", "DIRECT_LAUNCH", "parse_version", "triton_version", "specialization_key", "fast_launcher",
           "interpreted_launches"]

# Older versions get the torch reference kernels (coat_ds.kernels.fp8 logs it).
TRITON_MIN = (3, 6)
# The versions whose compiled-kernel launcher `fast_launcher` was checked against.
DIRECT_LAUNCH = ((3, 6), (3, 9))

_Tensor = torch.Tensor
_I32_END = 2**31


def parse_version(v: str) -> tuple[int, int]:
    """(major, minor) of a version string; (0, 0) when it has no two leading numbers.

    Plain string methods, no `re`: torch.compile traces this when a layer first asks for
    its kernels while being compiled, and torch 2.11's Dynamo breaks the graph inside `re`."""
    parts = v.split("+")[0].split(".")[:2]
    if len(parts) < 2:
        return (0, 0)
    digits = []
    for part in parts:
        n = len(part) - len(part.lstrip("0123456789"))
        if n == 0:
            return (0, 0)
        digits.append(int(part[:n]))
    return (digits[0], digits[1])


@lru_cache(maxsize=None)
def triton_version() -> tuple[int, int] | None:
    """(major, minor) of an importable Triton, None when there is none."""
    try:
        import triton
    except Exception:
        return None
    return parse_version(getattr(triton, "__version__", "0.0"))


def specialization_key(args: tuple) -> tuple:
    """What Triton specializes a kernel on, per runtime argument: each tensor's dtype and
    16-byte alignment, each integer's divisibility by 16, equality to 1 and width."""
    out = []
    for a in args:
        if type(a) is int:
            out.append(((a & 15) == 0) | ((a == 1) << 1) | ((a >= _I32_END) << 2))
        elif isinstance(a, _Tensor):
            out.append(a.dtype)
            out.append((a.data_ptr() & 15) == 0)
        else:
            out.append(type(a))
    return tuple(out)


@lru_cache(maxsize=None)
def _direct_launch_parts():
    """(launch hooks, raw-stream getter, device getter), or the reason they are unusable."""
    version = triton_version()
    if version not in DIRECT_LAUNCH:
        return "its launcher's arguments were checked only on " + ", ".join(f"{a}.{b}" for a, b in DIRECT_LAUNCH)
    raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    current_device = getattr(torch._C, "_cuda_getDevice", None)
    if raw_stream is None or current_device is None:
        return f"torch {torch.__version__} lacks torch._C._cuda_getCurrentRawStream / _cuda_getDevice"
    try:
        from triton import knobs

        runtime = knobs.runtime
        runtime.launch_enter_hook, runtime.launch_exit_hook
    except (ImportError, AttributeError):
        return "it has no triton.knobs.runtime.launch_enter_hook / launch_exit_hook"
    return runtime, raw_stream, current_device


def _unavailable(why: str) -> None:
    v = triton_version()
    warn_once("triton.direct_launch",
              f"coat_ds: direct launch of compiled Triton kernels is unavailable with Triton "
              f"{'none' if v is None else f'{v[0]}.{v[1]}'} ({why}); launching through the public "
              "kernel[grid](...) instead: same results, about 16 us more host time per launch")


def fast_launcher(kernel):
    """`launch(n_prog, args, consts)` running the compiled `kernel` (what `fn[grid](...)`
    returned on a CUDA device) with those arguments, or None where the probe fails (then
    one RuntimeWarning; the caller launches through `fn[grid]`)."""
    parts = _direct_launch_parts()
    if isinstance(parts, str):
        _unavailable(parts)
        return None
    if not all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata")):
        _unavailable(f"its compiled kernel ({type(kernel).__name__}) has no run / function / packed_metadata")
        return None
    rt, raw_stream, current_device = parts

    def launch(n_prog: int, args: tuple, consts: tuple) -> None:
        # Where a launch hook is installed (a profiler such as proton) the launch goes through
        # `CompiledKernel[grid]`, which builds the hooks' metadata. Triton 3.6 on keeps its
        # hooks in a `HookChain`, never None: a chain with no hooks counts as none (taking it
        # for an installed hook sent every launch down the slow path).
        enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
        if (enter is not None and getattr(enter, "calls", True)) or \
                (leave is not None and getattr(leave, "calls", True)):
            kernel[(n_prog, 1, 1)](*args, *consts)
            return
        kernel.run(n_prog, 1, 1, raw_stream(current_device()), kernel.function, kernel.packed_metadata, None, None,
                   None, *args, *consts)

    return launch


@contextmanager
def interpreted_launches(on_launch):
    """Within the block, every kernel launch under TRITON_INTERPRET=1 calls
    `on_launch(fn, run)` instead, where `fn` is the kernel and `run()` launches it: the
    interpreter's `InterpretedFunction.run`, wrapped (not public; checked on Triton 3.9).
    Raises RuntimeError where that is missing: there is no other place every interpreted
    launch passes through, and a count without it would be silently wrong."""
    from triton.runtime import interpreter

    cls = getattr(interpreter, "InterpretedFunction", None)
    original = getattr(cls, "run", None)
    if original is None:
        raise RuntimeError(f"Triton {triton_version()} has no triton.runtime.interpreter.InterpretedFunction.run "
                           "to count interpreted launches by")

    def run(fn, *args, **kwargs):
        return on_launch(fn, lambda: original(fn, *args, **kwargs))

    cls.run = run
    try:
        yield
    finally:
        cls.run = original
