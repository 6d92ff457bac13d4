"""Each kernel as a custom op, `torch.ops.coat_ds.<name>`, defined in its op's file by `define`.

An op has a fake implementation (output shapes, for torch.compile and FakeTensorMode); its
CPU kernel runs the op file's torch twins, its CUDA kernel the Triton launchers: the op takes
no backend and dispatches by device. What a kernel writes in place (parameters, moments,
skip counts) is declared in `mutates`. Eager callers take the registry's kernels instead, the
very functions the ops run, without the dispatcher's hops per call."""
from __future__ import annotations

import inspect
import sys
from typing import Callable

import torch

from .jit import bind

__all__ = ["define", "decoded_fake", "BODIES"]

# name -> (the registry op whose kernels it runs, its body): tests run an op's CUDA body on
# CPU tensors under Triton's interpreter.
BODIES: dict[str, tuple[str, Callable]] = {}


def define(name: str, module: str, body: Callable, fake: Callable, mutates=()):
    """The custom op `coat_ds::<name>`, computing `body(kernels, *args)` with the kernels of op
    file `module` (its `__name__`): `TORCH` on CPU, `TRITON` on CUDA."""
    sig = inspect.signature(body, eval_str=True)  # its types, read where the body is defined

    def cpu(*args):
        return body(sys.modules[module].TORCH, *args)

    def cuda(*args):
        op_file = sys.modules[module]
        bind(op_file)
        return body(op_file.TRITON, *args)

    cpu.__signature__ = sig.replace(parameters=list(sig.parameters.values())[1:])
    cpu.__name__ = name
    op = torch.library.custom_op(f"coat_ds::{name}", cpu, mutates_args=mutates, device_types="cpu")
    op.register_kernel("cuda")(cuda)
    op.register_fake(fake)
    BODIES[name] = (module.rsplit(".", 1)[1], body)
    return op


def decoded_fake(codes: torch.Tensor, *args) -> torch.Tensor:
    """The fake of a dequantizing op: codes' shape, in the dtype passed last."""
    return codes.new_empty(codes.shape, dtype=args[-1])
