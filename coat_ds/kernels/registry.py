"""The one kernel registry: `get(op, device, backend)`, an op's kernels for tensors on a device.

An op's kernels come as a named tuple with the same fields whatever the backend: the Triton
launchers ("triton") or their pure-torch twins ("torch"); "auto" takes Triton for CUDA
tensors where it runs and the twins elsewhere (CPU tensors reach Triton only through
"triton" under TRITON_INTERPRET=1). Triton is imported only when a Triton backend is chosen.

A caller resolves its kernels once (a layer per device, an optimizer bucket, the activation
hooks per device) and keeps them: a call is then the launcher or the twin itself, with no
lookup and no custom-op dispatch. Each kernel is also a custom op, `torch.ops.coat_ds.<name>`
(ops.py), for compiled graphs and for callers that want the dispatcher to pick by device."""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

from .fp8 import use_triton

__all__ = ["get", "OPS", "ActCodec", "AdamWKernels", "CastFp8", "CrossEntropyKernels", "Fp8LinearKernels",
           "GroupCodec", "RMSNormKernels", "SwiGLUKernels"]


class ActCodec(NamedTuple):
    """The saved activations' FP8 codec (act_codec.py), per tensor and per group of G
    consecutive elements ("rows")."""

    quantize_tensor: Callable
    dequantize_tensor: Callable
    quantize_rows: Callable
    dequantize_rows: Callable


class GroupCodec(NamedTuple):
    """Per-group FP8 with Dynamic Range Expansion (the optimizer's moments)."""

    quantize: Callable
    dequantize: Callable


class AdamWKernels(NamedTuple):
    """The fused AdamW step; `prepare`: a step prepared once for fixed tensors, or None where
    the per-tensor work dwarfs the Python around it."""

    step: Callable
    prepare: Optional[Callable]


class CastFp8(NamedTuple):
    """A plain saturating FP8 cast."""

    cast: Callable


class Fp8LinearKernels(NamedTuple):
    """The FP8 linear layers' per-tensor quantizer, `quantize(x2d, fmt, rowwise, transposed,
    exp=None, split=0, guess=None, amax=None) -> (codes | None, codes_t | None, exp)`, and the
    same as a custom op even where the twin runs (`quantize_kept`: compiled graphs save what a
    custom op returns rather than recompute it)."""

    quantize: Callable
    quantize_kept: Callable


class RMSNormKernels(NamedTuple):
    """The fused RMSNorm's forward and backward, for rows of at most `max_hidden` elements."""

    forward: Callable
    backward: Callable
    max_hidden: float


class SwiGLUKernels(NamedTuple):
    """The fused SwiGLU activation's forward and backward."""

    forward: Callable
    backward: Callable


class CrossEntropyKernels(NamedTuple):
    """Per-row cross-entropy of logit rows, their gradient written over them; `fp32_copy`:
    whether it makes an FP32 copy of 16-bit logits to work in (the twin does)."""

    rows: Callable
    fp32_copy: bool


def _torch_kernels() -> dict:
    from . import act_codec as A, host, linear_ops, reference as R

    return {
        "act_codec": ActCodec(A.quantize_tensor, A.dequantize_tensor, A.quantize_groups, A.dequantize_groups),
        # host.py: the reference, chunked on host tensors, or the C++ step.
        "adamw": AdamWKernels(host.adamw_step, None),
        "cast_fp8": CastFp8(R.cast_fp8),
        "cross_entropy": CrossEntropyKernels(R.cross_entropy_rows, True),
        "fp8_linear": Fp8LinearKernels(linear_ops._torch_quantize, linear_ops._opaque_twin),
        "group_codec": GroupCodec(R.quantize_groups, R.dequantize_groups),
        "rms_norm": RMSNormKernels(R.rms_norm_forward, R.rms_norm_backward, float("inf")),
        "swiglu": SwiGLUKernels(R.swiglu_forward, R.swiglu_backward),
    }


def _triton_kernels() -> dict:
    from . import act_quant, adamw, cross_entropy, linear_ops, quantize, rms_norm, swiglu

    return {
        "act_codec": ActCodec(act_quant.quantize_tensor, act_quant.dequantize_tensor, act_quant.quantize_groups,
                              act_quant.dequantize_groups),
        "adamw": AdamWKernels(adamw.adamw_step, adamw.PreparedStep),
        "cast_fp8": CastFp8(quantize.cast_fp8),
        "cross_entropy": CrossEntropyKernels(cross_entropy.cross_entropy_rows, False),
        "fp8_linear": Fp8LinearKernels(linear_ops._custom_quantize, linear_ops._custom_quantize),
        "group_codec": GroupCodec(quantize.quantize_groups, quantize.dequantize_groups),
        "rms_norm": RMSNormKernels(rms_norm.rms_norm_forward, rms_norm.rms_norm_backward, rms_norm.MAX_HIDDEN),
        "swiglu": SwiGLUKernels(swiglu.swiglu_forward, swiglu.swiglu_backward),
    }


_TABLES: dict[str, dict] = {}


def table(backend: str) -> dict:
    """Every op's kernels of `backend` ("torch" or "triton"), by op name."""
    kernels = _TABLES.get(backend)
    if kernels is None:
        kernels = _TABLES[backend] = _triton_kernels() if backend == "triton" else _torch_kernels()
    return kernels


OPS = ("act_codec", "adamw", "cast_fp8", "cross_entropy", "fp8_linear", "group_codec", "rms_norm", "swiglu")


def get(op: str, device: torch.device, backend: str = "auto", option: str = "backend"):
    """The kernels of `op` (one of OPS) for tensors on `device`: "triton", "torch" or "auto"
    (see above). Raises where "triton" cannot run there, naming `option` (the setting that
    asked for it)."""
    if op not in OPS:
        raise ValueError(f"unknown kernel op {op!r}; expected one of {OPS}")
    return table("triton" if use_triton(device, backend, option) else "torch")[op]


table("torch")  # built now, not first while torch.compile traces a layer asking for it
