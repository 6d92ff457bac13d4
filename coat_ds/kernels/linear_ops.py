"""Dispatch for the FP8-linear kernels: a torch.library custom op over the Triton launcher,
or the torch twin.

The custom op (with a fake implementation giving output shapes) lets torch.compile trace a
converted layer without a graph break; the torch twin is plain torch ops, which Inductor
fuses into the kernels around it. Triton is imported only when the op runs on a device
where Triton runs."""
from __future__ import annotations

import torch

from . import reference
from .fp8 import GEMM_ALIGN, get_format, triton_usable, use_triton

__all__ = ["get_linear_ops"]

_FORMATS = ("e4m3", "e5m2")


def _split(codes, codes_t, e, rowwise: bool, transposed: bool):
    # A custom op returns tensors only: an absent output travels as an empty tensor.
    empty = e.new_empty((0,), dtype=torch.uint8)
    return (codes if rowwise else empty), (codes_t if transposed else empty), e


# Exponent guesses for weights (fp8_linear.linear_quantize's `guess`), by what identifies a
# weight between steps. A stale or mistaken entry costs only the second write of the codes.
_GUESSES: dict[tuple, torch.Tensor] = {}
_MAX_GUESSES = 4096


def _triton_quantize(x, fmt, rowwise, transposed, exp, weight):
    from .fp8_linear import linear_quantize, new_guess

    x = x.contiguous()
    if not weight or exp is not None:
        return linear_quantize(x, fmt, rowwise, transposed, GEMM_ALIGN, exp)
    key = (x.device, x.data_ptr(), tuple(x.shape), x.dtype, fmt)
    state = _GUESSES.get(key)
    out = linear_quantize(x, fmt, rowwise, transposed, GEMM_ALIGN, guess=state)
    if state is None:
        if len(_GUESSES) >= _MAX_GUESSES:
            _GUESSES.clear()
        _GUESSES[key] = new_guess(out[2])
    return out


@torch.library.custom_op("coat_ds::fp8_linear_quantize", mutates_args=())
def _quantize_op(x: torch.Tensor, fmt_id: int, rowwise: bool, transposed: bool,
                 exp: torch.Tensor | None = None, twin: bool = False,
                 weight: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    fmt = _FORMATS[fmt_id]
    if not twin and triton_usable(x.device):
        out = _triton_quantize(x, fmt, rowwise, transposed, exp, weight)
    else:
        out = reference.linear_quantize(x, fmt, rowwise, transposed, GEMM_ALIGN, exp)
        if exp is not None:
            out = (out[0], out[1], out[2].clone())  # a custom op's outputs may not alias its inputs
    return _split(*out, rowwise, transposed)


@_quantize_op.register_fake
def _(x, fmt_id, rowwise, transposed, exp=None, twin=False, weight=False):
    m, k = x.shape
    mp = -(-m // GEMM_ALIGN) * GEMM_ALIGN
    codes = x.new_empty((m, k) if rowwise else (0,), dtype=torch.uint8)
    codes_t = x.new_empty((k, mp) if transposed else (0,), dtype=torch.uint8)
    return codes, codes_t, x.new_empty((), dtype=torch.int32)


def _custom_quantize(x, fmt, rowwise, transposed, exp=None, split=0, twin=False, weight=False):
    # `split` shapes the twin's max reduction for Inductor; the Triton kernel has its own blocks.
    codes, codes_t, e = _quantize_op(x, get_format(fmt).id, rowwise, transposed, exp, twin, weight)
    return (codes if rowwise else None), (codes_t if transposed else None), e


def _opaque_twin(x, fmt, rowwise, transposed, exp=None, split=0, weight=False):
    return _custom_quantize(x, fmt, rowwise, transposed, exp, split, twin=True)


def _torch_quantize(x, fmt, rowwise, transposed, exp=None, split=0, weight=False):
    codes, codes_t, e = reference.linear_quantize(x, fmt, rowwise, transposed, GEMM_ALIGN, exp, split)
    if torch.compiler.is_compiling():
        codes, codes_t = _one_buffer(codes), _one_buffer(codes_t)
    return codes, codes_t, e


def _one_buffer(codes):
    """Inductor's _scaled_mm lowering writes a pointwise cast once per GEMM that reads it
    (q/k/v: three identical FP8 copies of their input); a fixed layout makes the cast one
    buffer that all of them read. Eagerly a no-op (the strides already match)."""
    if codes is None:
        return None
    return torch.ops.prims.inductor_force_stride_order.default(codes, codes.stride())


def get_linear_ops(device: torch.device, backend: str = "auto", opaque: bool = False):
    """`quantize(x2d, fmt, rowwise, transposed, exp=None, split=0, weight=False) -> (codes |
    None, codes_t | None, exp)` for tensors on `device` (`exp`: use this exponent instead of
    reading the max; `split`: reference.linear_finite_absmax's, for the twin; `weight`: the
    Triton kernels start from the exponent this tensor had last time, fp8_linear.py):
    "triton" (the custom op over the Triton kernels), "torch" (the twin)
    or "auto": the twin while torch.compile traces (Inductor then fuses the casts into their
    producers) and on CPU, the Triton op on CUDA.

    `opaque`: always a custom op (the twin inside it where the backend says so). What it
    returns is then saved for backward by torch.compile rather than recomputed there, as
    AOTAutograd recomputes only ops it knows."""
    if opaque:
        return _custom_quantize if use_triton(device, backend, "Fp8LinearConfig.backend") else _opaque_twin
    if backend == "auto" and torch.compiler.is_compiling():
        return _torch_quantize
    return _custom_quantize if use_triton(device, backend, "Fp8LinearConfig.backend") else _torch_quantize
