"""FP8 in torch ops: what the pure-torch twins of several ops share (encode, decode, power-of-
two scales), computed as their Triton kernels compute it (fp8_triton.py)."""
from __future__ import annotations

import torch

from .fp8 import Fp8Format

__all__ = ["encode_fp8", "decode_fp8", "exponent_from_bits", "scale_exponent", "pow2", "exact_div"]


def encode_fp8(x: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """Round-to-nearest-even, saturating FP8 encode of float32 `x`, as uint8 codes (the
    sign bit copied from x, -0.0 included, as the hardware conversion does)."""
    mag = x.abs().clamp_(max=fmt.max).to(fmt.dtype).view(torch.uint8)
    return mag | (torch.signbit(x).to(torch.uint8) << 7)


def decode_fp8(codes: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    return codes.view(fmt.dtype).to(torch.float32)


def exponent_from_bits(bits: torch.Tensor, fmt: Fp8Format, mantissa_cut: int) -> torch.Tensor:
    """(int32) The exponent of the float32 whose bits are `bits`, less the format's E (both
    formats' max is 1.75 * 2**E), plus one where its mantissa field is >= `mantissa_cut`:
    the smallest power-of-two scale putting the value below 1 + mantissa_cut / 2**23 times
    2**E. The scales of every codec here are this with their own cut."""
    return ((bits >> 23) & 0xFF) - (127 + int(fmt.log2_max)) + ((bits & 0x7FFFFF) >= mantissa_cut).to(torch.int32)


def scale_exponent(ymax: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """Exact ceil(log2(ymax / fmt.max)) (int32) for positive normal float32 `ymax`: ymax's
    exponent - E, plus one when its mantissa exceeds 1.75."""
    return exponent_from_bits(ymax.view(torch.int32), fmt, 0x600001)


def pow2(e: torch.Tensor) -> torch.Tensor:
    """Exact 2**e as float32 for integer e in [-126, 127]."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def exact_div(num: float, den: torch.Tensor) -> torch.Tensor:
    """num / den, divided as the kernels divide: torch's `float / tensor` multiplies by a
    reciprocal."""
    return torch.div(torch.full_like(den, num), den)
