"""Launching the activation kernels with less host work per call.

`JITFunction.__getitem__(grid)(...)` costs 26 us per launch on an H100 host (Triton 3.6),
where the compiled kernel's own launcher takes 10 us, and a typical saved tensor is a few
microseconds of GPU work. Compression launches once or twice per saved tensor, so in a
step that is already host-bound this cost, not bandwidth, is what shows in step time.
Here each compiled kernel is looked up once per specialization and then launched through
its launcher directly (`coat_ds._compat.triton.fast_launcher`, which names the Triton
versions that was checked on). Where that is unavailable, every call goes through the public
`fn[grid](...)`, and a warning says so once. Under the interpreter (CPU tensors) every call
goes through `fn[grid]`."""
from __future__ import annotations

from functools import partial

from .._compat.triton import fast_launcher
from .._compat.triton import specialization_key as _spec

__all__ = ["launch"]

_COMPILED: dict = {}


def _public_launch(fn, num_warps: int, n_prog: int, args: tuple, consts: tuple) -> None:
    fn[(n_prog,)](*args, *consts, num_warps=num_warps)


def _launcher(fn, kernel, num_warps: int):
    """How later calls with the specialization `kernel` was compiled for launch it."""
    return fast_launcher(kernel) or partial(_public_launch, fn, num_warps)


def launch(fn, n_prog: int, args: tuple, consts: tuple, num_warps: int) -> None:
    """`fn[(n_prog,)](*args, *consts, num_warps=num_warps)`: `args` are the kernel's runtime
    parameters, first a tensor on the device it runs on; `consts` its constexprs, in order."""
    x = args[0]
    if not x.is_cuda:
        fn[(n_prog,)](*args, *consts, num_warps=num_warps)
        return
    key = (fn, x.get_device(), num_warps, consts, _spec(args))
    run = _COMPILED.get(key)
    if run is None:
        _COMPILED[key] = _launcher(fn, fn[(n_prog, 1, 1)](*args, *consts, num_warps=num_warps), num_warps)
        return
    run(n_prog, args, consts)
