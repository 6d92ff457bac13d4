"""Every kernel as a custom op, `torch.ops.coat_ds.<name>`, over the registry's kernels.

Each op has a fake implementation (output shapes, for torch.compile and FakeTensorMode); its
CPU kernel runs the op's torch twins, its CUDA kernel the Triton launchers: the op takes no
backend and dispatches by device. Eager callers take the registry's kernels themselves
(registry.get), the very functions the ops run, without the dispatcher's hops per call. What
a kernel writes in place (parameters, moments, skip counts) is declared in its op's
`mutates_args`.

The FP8-linear quantize op, `coat_ds::fp8_linear_quantize`, lives in linear_ops.py: it
also carries the torch twin for torch.compile (see there)."""
import inspect
from typing import Callable, Optional

import torch
from torch import Tensor

from .act_codec import num_groups
from .layout import AdamWHyper, AdamWSlot, QuantizedGroups, group_layout
from .registry import table

__all__ = ["flat_slots", "OP_NAMES", "BODIES"]


# ---- The custom ops ----------------------------------------------------------------------
#
# Each op is defined by a body `body(kernels, *args)` over its registry op's kernels: its CPU
# kernel runs the body with the twins, its CUDA kernel with the Triton launchers. BODIES keeps
# them, with their registry op (tests run the CUDA body on CPU tensors under Triton's
# interpreter).

BODIES: dict[str, tuple[str, Callable]] = {}


def _define(name: str, registry_op: str, body: Callable, fake: Callable, mutates=()):
    sig = inspect.signature(body)
    params = list(sig.parameters.values())[1:]

    def cpu(*args):
        return body(table("torch")[registry_op], *args)

    cpu.__signature__ = sig.replace(parameters=params)
    cpu.__name__ = name
    op = torch.library.custom_op(f"coat_ds::{name}", cpu, mutates_args=mutates, device_types="cpu")
    op.register_kernel("cuda")(lambda *args: body(table("triton")[registry_op], *args))
    op.register_fake(fake)
    BODIES[name] = (registry_op, body)
    return op


def _quantize_groups(k, x: Tensor, group_size: int, fmt: str, dre: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return tuple(k.quantize(x, group_size, fmt, dre))


def _quantize_groups_fake(x, group_size, fmt, dre):
    meta = group_layout(x.shape, group_size).meta_shape
    return (x.new_empty(x.shape, dtype=torch.uint8), x.new_empty(meta, dtype=torch.float32),
            x.new_empty(meta, dtype=torch.uint8), x.new_empty(meta, dtype=torch.int8))


def _dequantize_groups(k, codes: Tensor, center: Tensor, kcode: Tensor, sexp: Tensor, group_size: int,
                       fmt: str, dtype: torch.dtype) -> Tensor:
    return k.dequantize(QuantizedGroups(codes, center, kcode, sexp), group_size, fmt, dtype)


def _decoded_fake(codes, *args):
    return codes.new_empty(codes.shape, dtype=args[-1])


def _cast_fp8(k, x: Tensor, fmt: str) -> tuple[Tensor, Tensor]:
    return k.cast(x, fmt)


def _cast_fp8_fake(x, fmt):
    return x.new_empty(x.shape, dtype=torch.uint8), x.new_empty(x.shape, dtype=torch.float32)


def flat_slots(slots: list[AdamWSlot]) -> tuple[list, list, list, list, list]:
    """`slots` as `coat_ds::adamw_step` takes them: parameters, gradients, first and second
    moments (an FP8 moment as its four tensors, in QuantizedGroups order), skip counters (an
    empty tensor where a slot has none: torch's functionalization of a written list takes no
    None in it)."""
    def moment(m):
        return list(m) if isinstance(m, QuantizedGroups) else [m]

    return ([s.param for s in slots], [s.grad for s in slots], [t for s in slots for t in moment(s.exp_avg)],
            [t for s in slots for t in moment(s.exp_avg_sq)],
            [s.param.new_empty((0,), dtype=torch.int32) if s.skips is None else s.skips for s in slots])


def _moments(flat: list[Tensor], n: int) -> list:
    if len(flat) == n:
        return flat
    return [QuantizedGroups(*flat[4 * i:4 * i + 4]) for i in range(n)]


# Plans of the op's Triton steps, per device (see adamw._bound_plan): the op keeps no state
# of its caller, whose prepared step (adamw.PreparedStep) holds its own.
_PLANS: dict = {}


def _adamw_step(k, params: list[Tensor], grads: list[Tensor], exp_avg: list[Tensor],
                exp_avg_sq: list[Tensor], skips: list[Tensor], hyper: list[float], group_size: int,
                fmt_m: str, fmt_v: str, dre: bool, skipped: Optional[Tensor]) -> None:
    n = len(params)
    if n == 0:
        return
    skips = [s if s.numel() else None for s in skips]  # a slot without groups is skipped either way
    slots = [AdamWSlot(*parts) for parts in zip(params, grads, _moments(exp_avg, n), _moments(exp_avg_sq, n), skips)]
    plans = _PLANS.setdefault((params[0].device.type, params[0].device.index), {})
    k.step(slots, AdamWHyper(*hyper), group_size=group_size, fmt_m=fmt_m, fmt_v=fmt_v, dre=dre,
                 skipped=skipped, plan_cache=plans)


def _adamw_step_fake(*args) -> None:
    return None


def _act_quantize_tensor(k, x: Tensor, fmt: str) -> tuple[Tensor, Tensor]:
    return k.quantize_tensor(x, fmt)


def _act_quantize_tensor_fake(x, fmt):
    return x.new_empty(x.shape, dtype=torch.uint8), x.new_empty((), dtype=torch.int32)


def _act_dequantize_tensor(k, codes: Tensor, exp: Tensor, fmt: str, dtype: torch.dtype) -> Tensor:
    return k.dequantize_tensor(codes, exp, fmt, dtype)


def _act_quantize_rows(k, x: Tensor, group_size: int, fmt: str) -> tuple[Tensor, Tensor]:
    return k.quantize_rows(x, group_size, fmt)


def _act_quantize_rows_fake(x, group_size, fmt):
    return (x.new_empty(x.shape, dtype=torch.uint8),
            x.new_empty((num_groups(x.numel(), group_size),), dtype=torch.int8))


def _act_dequantize_rows(k, codes: Tensor, exps: Tensor, group_size: int, fmt: str,
                         dtype: torch.dtype) -> Tensor:
    return k.dequantize_rows(codes, exps, group_size, fmt, dtype)


quantize_groups = _define("quantize_groups", "group_codec", _quantize_groups, _quantize_groups_fake)
dequantize_groups = _define("dequantize_groups", "group_codec", _dequantize_groups, _decoded_fake)
cast_fp8 = _define("cast_fp8", "cast_fp8", _cast_fp8, _cast_fp8_fake)
adamw_step = _define("adamw_step", "adamw", _adamw_step, _adamw_step_fake,
                     mutates=("params", "exp_avg", "exp_avg_sq", "skips", "skipped"))
act_quantize_tensor = _define("act_quantize_tensor", "act_codec", _act_quantize_tensor, _act_quantize_tensor_fake)
act_dequantize_tensor = _define("act_dequantize_tensor", "act_codec", _act_dequantize_tensor, _decoded_fake)
act_quantize_rows = _define("act_quantize_rows", "act_codec", _act_quantize_rows, _act_quantize_rows_fake)
act_dequantize_rows = _define("act_dequantize_rows", "act_codec", _act_dequantize_rows, _decoded_fake)

OP_NAMES = (*BODIES, "fp8_linear_quantize")
