"""How this package's Triton kernels are defined, compiled and launched.

Defined without importing Triton. `@jit` marks a kernel or device function where
`@triton.jit` would stand, `constexpr(v)` a module constant that kernels read where
`tl.constexpr(v)` would, and a module of kernels binds `triton = tl = None` at its top. When
the registry first hands out a module's Triton kernels it calls `bind(module)`: Triton is
imported into the module's `triton` and `tl`, each marked function there (its own, or one it
imported) becomes `triton.jit`'s, once per process, and each constant `tl.constexpr`'s.
Triton then compiles or, under TRITON_INTERPRET=1, interprets them as if decorated at
import: from their module's source and globals, which hold Triton by then. So one file holds
an op whole, its kernels beside their torch twins, and importing coat_ds or running every op
on its twins imports no Triton.

Launched with less host work per call. `JITFunction.__getitem__(grid)(...)` re-binds and
re-specializes every argument on each call, where the compiled kernel's own launcher does
far less, and a typical saved activation is little GPU work, launched once or twice: in a
step that is already host-bound this cost, not bandwidth, is what shows in step time. `launch` looks each compiled kernel up once per specialization and then calls its
launcher directly (`coat_ds._compat.triton.fast_launcher`, which names the Triton versions
that was checked on). Where that is unavailable, every call goes through the public
`fn[grid](...)`, and a warning says so once; under the interpreter (CPU tensors) always."""
from __future__ import annotations

import threading
from functools import partial

from .._compat.triton import fast_launcher
from .._compat.triton import specialization_key as _spec

__all__ = ["jit", "constexpr", "bind", "launch"]

_MARK = "__coat_ds_jit__"
# Each marked function's Triton function: one per process, whichever modules name it.
_JITTED: dict = {}
_lock = threading.Lock()


def jit(fn):
    """`triton.jit`, applied by `bind`."""
    setattr(fn, _MARK, True)
    return fn


class constexpr:
    """`tl.constexpr(value)`, made by `bind`."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def bind(module) -> None:
    """Make `module`'s kernels Triton's (see above); a no-op once done."""
    if vars(module).get("tl") is None:
        with _lock:
            _bind(vars(module))


def _bind(names: dict) -> None:
    if names.get("tl") is not None:
        return
    import triton
    import triton.language as tl

    # Set first: a module reached again through the functions it lends is bound once.
    names["triton"], names["tl"] = triton, tl
    for name, value in list(names.items()):
        if isinstance(value, constexpr):
            names[name] = tl.constexpr(value.value)
        elif getattr(value, _MARK, False):
            if value.__globals__ is not names:
                _bind(value.__globals__)  # an imported device function: its module's names too
            fn = _JITTED.get(value)
            if fn is None:
                fn = _JITTED[value] = triton.jit(value)
            names[name] = fn


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
