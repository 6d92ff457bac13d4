"""The one kernel table and the `torch.ops.coat_ds` custom ops over it.

`Kernels` names every kernel once; there are two of them: the Triton launchers
(`triton_kernels()`, imported on first use so that triton is imported only where it runs)
and the torch twins (`torch_kernels()`: the pure-torch reference, and the fused C++ host
step for AdamW). `get_ops`, `get_act_ops` and `get_linear_ops` all return `kernels_for`'s
choice (or one of its entries), so `backend="triton"` on CPU tensors under
TRITON_INTERPRET=1 reaches the Triton launchers directly.

Each kernel is also a custom op, `torch.ops.coat_ds.<name>`, with a fake implementation
(output shapes, for torch.compile and FakeTensorMode), whose CPU kernel is the torch
table's entry and whose CUDA kernel is the Triton table's: the op takes no backend and
dispatches by device. The eager paths call the table's entries themselves, the very
functions the ops run, which saves the dispatcher's hops per call (the activation hooks
call a kernel per saved tensor). What a kernel writes in place (parameters, moments, skip
counts) is declared in its op's `mutates_args`.

The FP8-linear quantize op, `coat_ds::fp8_linear_quantize`, lives in linear_ops.py: it
also carries the torch twin for torch.compile (see there)."""
import inspect
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from .act_codec import num_groups
from .fp8 import use_triton
from .layout import AdamWHyper, AdamWSlot, QuantizedGroups, group_layout

__all__ = ["Kernels", "kernels_for", "torch_kernels", "triton_kernels", "get_linear_ops", "get_rms_norm_ops", "get_swiglu_ops", "get_cross_entropy_ops", "flat_slots", "OP_NAMES", "BODIES"]


@dataclass(frozen=True)
class Kernels:
    """One backend's kernels, each with the signature of its reference twin in reference.py
    (activations' `quantize_*`/`dequantize_*`: act_codec.py's; `quantize_rows` quantizes
    per group of G consecutive elements; `linear_quantize*`: linear_ops.get_linear_ops's; `prepare_adamw_step`: a step prepared
    once for fixed tensors, or None where the per-tensor work dwarfs the Python around it)."""

    name: str
    quantize_groups: Callable
    dequantize_groups: Callable
    cast_fp8: Callable
    adamw_step: Callable
    prepare_adamw_step: Optional[Callable]
    quantize_tensor: Callable
    dequantize_tensor: Callable
    quantize_rows: Callable
    dequantize_rows: Callable
    linear_quantize: Callable
    linear_quantize_opaque: Callable


_TABLES: dict = {}


def torch_kernels() -> Kernels:
    table = _TABLES.get("torch")
    if table is None:
        from . import act_codec as A, host, linear_ops, reference as R

        table = _TABLES["torch"] = Kernels(
            "torch", R.quantize_groups, R.dequantize_groups, R.cast_fp8,
            host.adamw_step,  # the reference, chunked on host tensors, or the C++ step: see host.py
            None, A.quantize_tensor, A.dequantize_tensor, A.quantize_groups, A.dequantize_groups,
            linear_ops._torch_quantize, linear_ops._opaque_twin)
    return table


def triton_kernels() -> Kernels:
    table = _TABLES.get("triton")
    if table is None:
        from . import act_quant, adamw, linear_ops, quantize

        table = _TABLES["triton"] = Kernels(
            "triton", quantize.quantize_groups, quantize.dequantize_groups, quantize.cast_fp8, adamw.adamw_step,
            adamw.PreparedStep, act_quant.quantize_tensor, act_quant.dequantize_tensor, act_quant.quantize_groups,
            act_quant.dequantize_groups, linear_ops._custom_quantize, linear_ops._custom_quantize)
    return table


def kernels_for(device: torch.device, backend: str = "auto", option: str = "backend") -> Kernels:
    """The kernels for tensors on `device`: "triton", "torch" (reference) or "auto" (Triton on
    CUDA, the reference elsewhere; CPU tensors reach Triton only through backend="triton"
    under TRITON_INTERPRET=1). Raises where "triton" cannot run, naming `option`."""
    return triton_kernels() if use_triton(device, backend, option) else torch_kernels()


# ---- The custom ops ----------------------------------------------------------------------
#
# Each op is defined by a body `body(kernels, *args)`: its CPU kernel runs the body with the
# torch table, its CUDA kernel with the Triton table. BODIES keeps them (tests run the CUDA
# body on CPU tensors under Triton's interpreter).

BODIES: dict[str, Callable] = {}


def _define(name: str, body: Callable, fake: Callable, mutates=()):
    sig = inspect.signature(body)
    params = list(sig.parameters.values())[1:]

    def cpu(*args):
        return body(torch_kernels(), *args)

    cpu.__signature__ = sig.replace(parameters=params)
    cpu.__name__ = name
    op = torch.library.custom_op(f"coat_ds::{name}", cpu, mutates_args=mutates, device_types="cpu")
    op.register_kernel("cuda")(lambda *args: body(triton_kernels(), *args))
    op.register_fake(fake)
    BODIES[name] = body
    return op


def _quantize_groups(k: Kernels, x: Tensor, group_size: int, fmt: str, dre: bool
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return tuple(k.quantize_groups(x, group_size, fmt, dre))


def _quantize_groups_fake(x, group_size, fmt, dre):
    meta = group_layout(x.shape, group_size).meta_shape
    return (x.new_empty(x.shape, dtype=torch.uint8), x.new_empty(meta, dtype=torch.float32),
            x.new_empty(meta, dtype=torch.uint8), x.new_empty(meta, dtype=torch.int8))


def _dequantize_groups(k: Kernels, codes: Tensor, center: Tensor, kcode: Tensor, sexp: Tensor, group_size: int,
                       fmt: str, dtype: torch.dtype) -> Tensor:
    return k.dequantize_groups(QuantizedGroups(codes, center, kcode, sexp), group_size, fmt, dtype)


def _decoded_fake(codes, *args):
    return codes.new_empty(codes.shape, dtype=args[-1])


def _cast_fp8(k: Kernels, x: Tensor, fmt: str) -> tuple[Tensor, Tensor]:
    return k.cast_fp8(x, fmt)


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


def _adamw_step(k: Kernels, params: list[Tensor], grads: list[Tensor], exp_avg: list[Tensor],
                exp_avg_sq: list[Tensor], skips: list[Tensor], hyper: list[float], group_size: int,
                fmt_m: str, fmt_v: str, dre: bool, skipped: Optional[Tensor]) -> None:
    n = len(params)
    if n == 0:
        return
    skips = [s if s.numel() else None for s in skips]  # a slot without groups is skipped either way
    slots = [AdamWSlot(*parts) for parts in zip(params, grads, _moments(exp_avg, n), _moments(exp_avg_sq, n), skips)]
    plans = _PLANS.setdefault((params[0].device.type, params[0].device.index), {})
    k.adamw_step(slots, AdamWHyper(*hyper), group_size=group_size, fmt_m=fmt_m, fmt_v=fmt_v, dre=dre,
                 skipped=skipped, plan_cache=plans)


def _adamw_step_fake(*args) -> None:
    return None


def _act_quantize_tensor(k: Kernels, x: Tensor, fmt: str) -> tuple[Tensor, Tensor]:
    return k.quantize_tensor(x, fmt)


def _act_quantize_tensor_fake(x, fmt):
    return x.new_empty(x.shape, dtype=torch.uint8), x.new_empty((), dtype=torch.int32)


def _act_dequantize_tensor(k: Kernels, codes: Tensor, exp: Tensor, fmt: str, dtype: torch.dtype) -> Tensor:
    return k.dequantize_tensor(codes, exp, fmt, dtype)


def _act_quantize_rows(k: Kernels, x: Tensor, group_size: int, fmt: str) -> tuple[Tensor, Tensor]:
    return k.quantize_rows(x, group_size, fmt)


def _act_quantize_rows_fake(x, group_size, fmt):
    return (x.new_empty(x.shape, dtype=torch.uint8),
            x.new_empty((num_groups(x.numel(), group_size),), dtype=torch.int8))


def _act_dequantize_rows(k: Kernels, codes: Tensor, exps: Tensor, group_size: int, fmt: str,
                         dtype: torch.dtype) -> Tensor:
    return k.dequantize_rows(codes, exps, group_size, fmt, dtype)


quantize_groups = _define("quantize_groups", _quantize_groups, _quantize_groups_fake)
dequantize_groups = _define("dequantize_groups", _dequantize_groups, _decoded_fake)
cast_fp8 = _define("cast_fp8", _cast_fp8, _cast_fp8_fake)
adamw_step = _define("adamw_step", _adamw_step, _adamw_step_fake,
                     mutates=("params", "exp_avg", "exp_avg_sq", "skips", "skipped"))
act_quantize_tensor = _define("act_quantize_tensor", _act_quantize_tensor, _act_quantize_tensor_fake)
act_dequantize_tensor = _define("act_dequantize_tensor", _act_dequantize_tensor, _decoded_fake)
act_quantize_rows = _define("act_quantize_rows", _act_quantize_rows, _act_quantize_rows_fake)
act_dequantize_rows = _define("act_dequantize_rows", _act_dequantize_rows, _decoded_fake)

OP_NAMES = (*BODIES, "fp8_linear_quantize")


def get_linear_ops(device: torch.device, backend: str = "auto", opaque: bool = False):
    """`quantize(x2d, fmt, rowwise, transposed, exp=None, split=0, guess=None, amax=None) ->
    (codes | None, codes_t | None, exp)` for tensors on `device` (`exp`: use this exponent
    instead of reading the max; `split`: reference.linear_finite_absmax's, for the twin;
    `guess`: a weight's fp8_linear.new_guess state on its device, which the Triton kernels
    start from and update in place; the twin ignores it; `amax`: x's finite max, found by
    the fused RMSNorm or SwiGLU that wrote x, as int32 float bits):
    "triton" (the custom op over the Triton kernels), "torch" (the twin)
    or "auto": the twin while torch.compile traces (Inductor then fuses the casts into their
    producers) and on CPU, the Triton op on CUDA.

    `opaque`: always a custom op (the twin inside it where the backend says so). What it
    returns is then saved for backward by torch.compile rather than recomputed there, as
    AOTAutograd recomputes only ops it knows."""
    if backend == "auto" and not opaque and torch.compiler.is_compiling():
        return torch_kernels().linear_quantize
    kernels = kernels_for(device, backend, "Fp8LinearConfig.backend")
    return kernels.linear_quantize_opaque if opaque else kernels.linear_quantize


def get_rms_norm_ops(device: torch.device, backend: str = "auto", hidden: int = 0, option: str = "backend"):
    """`(forward, backward)` of the fused RMSNorm for rows of `hidden` elements on `device`:
    the Triton launchers of rms_norm.py or their torch twins (reference.rms_norm_forward/
    _backward), chosen as `kernels_for` chooses (CPU tensors reach Triton only through
    "triton" under TRITON_INTERPRET=1); None where Triton is chosen but its kernels do not
    take rows that wide. Raises where "triton" cannot run, naming `option`."""
    if use_triton(device, backend, option):
        from . import rms_norm

        return (rms_norm.rms_norm_forward, rms_norm.rms_norm_backward) if hidden <= rms_norm.MAX_HIDDEN else None
    from . import reference

    return reference.rms_norm_forward, reference.rms_norm_backward


def get_swiglu_ops(device: torch.device, backend: str = "auto", option: str = "backend"):
    """`(forward, backward)` of the fused SwiGLU activation on `device`: the Triton launchers
    of swiglu.py or their torch twins (reference.swiglu_forward/_backward), chosen as
    `kernels_for` chooses. Raises where "triton" cannot run, naming `option`."""
    if use_triton(device, backend, option):
        from . import swiglu

        return swiglu.swiglu_forward, swiglu.swiglu_backward
    from . import reference

    return reference.swiglu_forward, reference.swiglu_backward


def get_cross_entropy_ops(device: torch.device, backend: str = "auto", option: str = "backend"):
    """`cross_entropy_rows(logits, labels, scale, ignore_index) -> per-row loss` on `device`:
    the Triton launcher of cross_entropy.py or its torch twin (reference.cross_entropy_rows),
    chosen as `kernels_for` chooses. Raises where "triton" cannot run, naming `option`."""
    if use_triton(device, backend, option):
        from . import cross_entropy

        return cross_entropy.cross_entropy_rows
    from . import reference

    return reference.cross_entropy_rows
