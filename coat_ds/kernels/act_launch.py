"""Launching the activation kernels with less host work per call.

`JITFunction.__getitem__(grid)(...)` binds and re-specializes every argument, builds a cache
key and checks globals on each call: 26 us per launch on an H100 host (Triton 3.6), where
the compiled kernel's own launcher takes 10 us, and a typical saved tensor is a few
microseconds of GPU work. Compression launches once or twice per saved tensor, so in a
step that is already host-bound this cost, not bandwidth, is what shows in step time.
Here each compiled kernel is looked up once per specialization and then launched through
its launcher directly, with the arguments `JITFunction.run` gives it (grid, raw stream of
the current device, function handle, packed metadata, launch metadata and hooks, every
parameter in order).

The cache key holds everything Triton specializes these kernels on: each tensor's dtype
and 16-byte alignment, each integer's divisibility by 16, equality to 1 and width, the
constexprs, num_warps and the device, so a kernel compiled under one specialization is
never launched with arguments of another. Where a launch hook is installed (a profiler
such as proton) the launch goes through `CompiledKernel[grid]`, which builds the hooks'
metadata. Triton 3.6 on keeps its launch hooks in a `HookChain`, never None: a chain with no
hooks counts as none (taking it for an installed hook sent every launch down the slow path,
which builds launch metadata and calls the empty chain twice). Under the interpreter (CPU
tensors) every call goes through `JITFunction`."""
from __future__ import annotations

import torch

from .fp8 import triton_version

__all__ = ["launch", "DIRECT_LAUNCH"]

DIRECT_LAUNCH = ((3, 6), (3, 9))
if triton_version() in DIRECT_LAUNCH:
    from triton import knobs
    _runtime = knobs.runtime
else:
    _runtime = None

_COMPILED: dict = {}
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_current_device = getattr(torch._C, "_cuda_getDevice", None)
_Tensor = torch.Tensor
_I32_END = 2**31


def _hooked(hook) -> bool:
    return hook is not None and bool(getattr(hook, "calls", True))


def _spec(args: tuple) -> tuple:
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


def launch(fn, n_prog: int, args: tuple, consts: tuple, num_warps: int) -> None:
    """`fn[(n_prog,)](*args, *consts, num_warps=num_warps)`: `args` are the kernel's runtime
    parameters, first a tensor on the device it runs on; `consts` its constexprs, in order."""
    x = args[0]
    if not x.is_cuda:
        fn[(n_prog,)](*args, *consts, num_warps=num_warps)
        return
    key = (fn, x.get_device(), num_warps, consts, _spec(args))
    kernel = _COMPILED.get(key)
    if kernel is None:
        _COMPILED[key] = fn[(n_prog, 1, 1)](*args, *consts, num_warps=num_warps)
        return
    rt = _runtime
    if rt is None or _raw_stream is None or _hooked(rt.launch_enter_hook) or _hooked(rt.launch_exit_hook):
        kernel[(n_prog, 1, 1)](*args, *consts)
        return
    kernel.run(n_prog, 1, 1, _raw_stream(_current_device()), kernel.function, kernel.packed_metadata, None, None,
               None, *args, *consts)
