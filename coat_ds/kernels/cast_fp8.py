"""A plain saturating round-to-nearest-even FP8 cast (registry op "cast_fp8"; custom op
`cast_fp8`): the codes and their float32 values. Its kernel holds the shared FP8 encode and
decode (fp8_triton.py) to the torch casts, code for code."""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import Tensor

from .custom_ops import define
from .fp8 import get_format, kernel_isa
from .fp8_torch import decode_fp8, encode_fp8
from .fp8_triton import decode_fp8 as decode_fp8_tl
from .fp8_triton import encode_fp8 as encode_fp8_tl
from .fp8_triton import fmt_max
from .jit import jit

__all__ = ["cast_fp8", "CastFp8", "TORCH", "TRITON"]

triton = tl = None  # jit.bind sets them when a Triton backend is chosen

_BLOCK_ELEMS = 4096


def cast_fp8(x: Tensor, fmt="e4m3") -> tuple[Tensor, Tensor]:
    """Saturating RNE cast to FP8: (uint8 codes, their float32 values)."""
    f = get_format(fmt)
    codes = encode_fp8(x.to(torch.float32), f)
    return codes, decode_fp8(codes, f)


@jit
def _cast_fp8_kernel(x_ptr, codes_ptr, out_ptr, n, FMT: tl.constexpr, BLOCK: tl.constexpr, ISA: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    codes = encode_fp8_tl(tl.minimum(tl.maximum(x, -fmt_max(FMT)), fmt_max(FMT)), FMT, ISA)
    tl.store(codes_ptr + offs, codes, mask=mask)
    tl.store(out_ptr + offs, decode_fp8_tl(codes, FMT, ISA), mask=mask)


def cast_fp8_triton(x: Tensor, fmt="e4m3") -> tuple[Tensor, Tensor]:
    """`cast_fp8` by the Triton kernel."""
    f = get_format(fmt)
    x = x.contiguous()
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if x.numel():
        _cast_fp8_kernel[(triton.cdiv(x.numel(), _BLOCK_ELEMS),)](x, codes, out, x.numel(), FMT=f.id,
                                                                  BLOCK=_BLOCK_ELEMS, ISA=kernel_isa(x.device))
    return codes, out


def _cast_op(k, x: Tensor, fmt: str) -> tuple[Tensor, Tensor]:
    return k.cast(x, fmt)


def _cast_fake(x, fmt):
    return x.new_empty(x.shape, dtype=torch.uint8), x.new_empty(x.shape, dtype=torch.float32)


define("cast_fp8", __name__, _cast_op, _cast_fake)


class CastFp8(NamedTuple):
    """`cast(x, fmt) -> (codes, values)`."""

    cast: Callable


TORCH = CastFp8(cast_fp8)
TRITON = CastFp8(cast_fp8_triton)
