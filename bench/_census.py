"""Host work of an eager step, counted on CPU: ATen ops dispatched, Triton launches (under
TRITON_INTERPRET=1, where every launch goes through `InterpretedFunction.run`), and coat_ds's
Python calls. At small shapes a GPU step waits on this host work, not on its kernels, so the
counts say where its time goes without a GPU. The interpreter executes each launched kernel
(`Census.kernel_s` is that time, kept out of the host figures), or with `execute=False` only
counts it: outputs then stay as allocated, and nothing on the host reads them (the tests
check that the counts are the same either way).

    with Census() as c:
        step()
    c.ops, c.launches                       # Counters: op name -> calls, kernel name -> launches
"""
from __future__ import annotations

import collections
import cProfile
import os
import pstats
import time

from torch.utils._python_dispatch import TorchDispatchMode

from coat_ds._compat.torch import custom_op_function
from coat_ds._compat.triton import interpreted_launches

__all__ = ["Census", "VIEW_OPS", "ALLOC_OPS", "kind", "python_calls"]

# Ops that launch no kernel on a GPU: views and metadata, and allocations without a fill.
# (reshape: as seen inside a custom op, below autograd; its copies would show as clone.)
VIEW_OPS = frozenset({"view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "slice", "select",
                      "unsqueeze", "squeeze", "alias", "detach", "as_strided", "_reshape_alias", "split", "unbind",
                      "lift_fresh", "promote_types", "_record_function_enter_new", "_record_function_exit"})
ALLOC_OPS = frozenset({"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"})
# coat_ds's custom ops: a dispatch of their own, then the ops inside them (counted apart).
CUSTOM_OPS = frozenset({"fp8_linear_quantize", "quantize_groups", "dequantize_groups", "cast_fp8", "adamw_step",
                        "act_quantize_tensor", "act_dequantize_tensor", "act_quantize_rows", "act_dequantize_rows"})


def kind(op: str) -> str:
    """"view" (no kernel, no memory), "alloc" (memory, no kernel), "custom" (a coat_ds custom
    op's own dispatch) or "kernel" (an op that launches a GPU kernel, or reads a value back)."""
    if op in VIEW_OPS:
        return "view"
    return "alloc" if op in ALLOC_OPS else "custom" if op in CUSTOM_OPS else "kernel"


class _OpCounter(TorchDispatchMode):
    def __init__(self, census: "Census"):
        super().__init__()
        self.census = census

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        census = self.census
        if census.in_kernel:  # the interpreter's own tensor work
            return func(*args, **kwargs)
        name = func.overloadpacket.__name__
        census.ops[name] += 1
        if func.namespace == "coat_ds":
            # Its Python function, run with the census active so that the ops inside it are
            # counted (the mode is off while its handler runs the op itself).
            impl = custom_op_function(func)
            if impl is not None:
                with self:
                    return impl(*args, **kwargs)
        return func(*args, **kwargs)


class Census:
    """Counts what runs inside `with`: `ops` (ATen and custom ops by name, as dispatched below
    autograd; a coat_ds custom op counts itself and the ops inside it), `launches` (Triton
    kernels by name) and `kernel_s` (seconds the interpreter spent executing them). With
    `ops=False` only launches are counted (for timing: the dispatch mode costs host time); with
    `execute=False` launched kernels do not run."""

    def __init__(self, ops: bool = True, execute: bool = True):
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("Census counts Triton launches through the interpreter: set TRITON_INTERPRET=1 "
                               "before triton is imported")
        self.ops: collections.Counter = collections.Counter()
        self.launches: collections.Counter = collections.Counter()
        self.kernel_s = 0.0
        self.in_kernel = False
        self.execute = execute
        self._mode = _OpCounter(self) if ops else None

    def _launch(self, fn, run):
        self.launches[fn.__name__] += 1
        if not self.execute:
            return None
        t0, self.in_kernel = time.perf_counter(), True
        try:
            return run()
        finally:
            self.in_kernel = False
            self.kernel_s += time.perf_counter() - t0

    def __enter__(self) -> "Census":
        self._hook = interpreted_launches(self._launch)
        self._hook.__enter__()
        if self._mode is not None:
            self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._mode is not None:
            self._mode.__exit__(*exc)
        self._hook.__exit__(*exc)

    def host_clock(self) -> float:
        """Wall time less the interpreter's kernel time: a clock that stops in kernels."""
        return time.perf_counter() - self.kernel_s


def python_calls(fn, package: str, execute: bool = True) -> tuple[int, float, list[tuple[str, int, float]]]:
    """Run `fn` under cProfile with kernel time removed from its clock: (calls of functions
    defined under the `package` folder, their own time in ms, the top of them as (name, calls,
    own ms) by own time). Executed, the interpreter's runs of kernels defined there count too."""
    census = Census(ops=False, execute=execute)
    with census:
        prof = cProfile.Profile(census.host_clock)
        prof.runcall(fn)
    calls, own, rows = 0, 0.0, []
    for (path, line, name), (_, nc, tt, _ct, _) in pstats.Stats(prof).stats.items():
        if path.startswith(package):
            calls += nc
            own += tt
            rows.append((f"{os.path.relpath(path, os.path.dirname(package))}:{name}", nc, tt * 1e3))
    rows.sort(key=lambda r: -r[2])
    return calls, own * 1e3, rows

