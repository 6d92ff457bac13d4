"""The FP8-linear quantize kernels: a torch.library custom op over the Triton launcher, and
the torch twin; the registry's "fp8_linear" kernels are these.

The custom op (with a fake implementation giving output shapes) lets torch.compile trace a
converted layer without a graph break (eagerly the launcher is called directly, saving the
op's dispatch per call); the torch twin is plain torch ops, which Inductor fuses into the
kernels around it. Triton is imported only when the op runs on a device
where Triton runs."""
from __future__ import annotations

import torch

from .._compat.torch import force_stride_order
from . import reference
from .fp8 import GEMM_ALIGN, get_format, triton_usable

_FORMATS = ("e4m3", "e5m2")


def _split(codes, codes_t, e, rowwise: bool, transposed: bool):
    # A custom op returns tensors only: an absent output travels as an empty tensor.
    empty = e.new_empty((0,), dtype=torch.uint8)
    return (codes if rowwise else empty), (codes_t if transposed else empty), e


def _triton_quantize(x, fmt, rowwise, transposed, exp, guess, amax):
    from .fp8_linear import linear_quantize

    return linear_quantize(x.contiguous(), fmt, rowwise, transposed, GEMM_ALIGN, exp, guess, amax)


# `guess`: fp8_linear.new_guess's state, which the Triton kernels start from and update in
# place (the twin ignores it). It has no default: torch 2.11 drops a trailing argument left at
# its default before bumping the version of each mutated one, and then fails indexing it.
# `amax`: x's finite max already found (reference.linear_quantize's), eager calls only.
@torch.library.custom_op("coat_ds::fp8_linear_quantize", mutates_args=("guess",))
def _quantize_op(x: torch.Tensor, fmt_id: int, rowwise: bool, transposed: bool, guess: torch.Tensor | None,
                 exp: torch.Tensor | None = None, twin: bool = False,
                 amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    fmt = _FORMATS[fmt_id]
    if not twin and triton_usable(x.device):
        out = _triton_quantize(x, fmt, rowwise, transposed, exp, guess, amax)
    else:
        out = reference.linear_quantize(x, fmt, rowwise, transposed, GEMM_ALIGN, exp, amax=amax)
        if exp is not None:
            out = (out[0], out[1], out[2].clone())  # a custom op's outputs may not alias its inputs
    return _split(*out, rowwise, transposed)


@_quantize_op.register_fake
def _(x, fmt_id, rowwise, transposed, guess, exp=None, twin=False, amax=None):
    m, k = x.shape
    mp = -(-m // GEMM_ALIGN) * GEMM_ALIGN
    codes = x.new_empty((m, k) if rowwise else (0,), dtype=torch.uint8)
    codes_t = x.new_empty((k, mp) if transposed else (0,), dtype=torch.uint8)
    return codes, codes_t, x.new_empty((), dtype=torch.int32)


def _custom_quantize(x, fmt, rowwise, transposed, exp=None, split=0, guess=None, twin=False, amax=None):
    # `split` shapes the twin's max reduction for Inductor; the Triton kernel has its own blocks.
    if not twin and not torch.compiler.is_compiling():
        # Eagerly the launcher itself, as the op would run it: the op's dispatch costs host
        # time per call (issue 30: small layers wait on the host) and an empty tensor per
        # absent output. (This table is Triton's only where Triton runs on x's device.)
        return _triton_quantize(x, fmt, rowwise, transposed, exp, guess, amax)
    codes, codes_t, e = _quantize_op(x, get_format(fmt).id, rowwise, transposed, guess, exp, twin, amax)
    return (codes if rowwise else None), (codes_t if transposed else None), e


def _opaque_twin(x, fmt, rowwise, transposed, exp=None, split=0, guess=None, amax=None):
    # Not handed the guess: the twin never reads it, and a compiled graph would copy it back.
    return _custom_quantize(x, fmt, rowwise, transposed, exp, split, twin=True, amax=amax)


def _torch_quantize(x, fmt, rowwise, transposed, exp=None, split=0, guess=None, amax=None):
    codes, codes_t, e = reference.linear_quantize(x, fmt, rowwise, transposed, GEMM_ALIGN, exp, split, amax)
    if torch.compiler.is_compiling():
        codes, codes_t = _one_buffer(codes), _one_buffer(codes_t)
    return codes, codes_t, e


def _one_buffer(codes):
    """Inductor's _scaled_mm lowering writes a pointwise cast once per GEMM that reads it
    (q/k/v: three identical FP8 copies of their input); a fixed layout makes the cast one
    buffer that all of them read. Eagerly a no-op (the strides already match)."""
    if codes is None:
        return None
    return force_stride_order(codes)
