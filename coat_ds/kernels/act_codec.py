"""The FP8 codec of saved activations, in torch ops: the one definition of what the eager
hooks and compiled graphs store.

Compiled graphs trace these functions (activation/traced.py; Inductor fuses each into the
kernels that produce and read the tensor), the eager hooks run them as the CPU kernels of
the kernel table (ops.py), and the Triton kernels (act_quant.py) compute the same codes and
exponents bit for bit. A fused kernel quantizing a saved tensor is bound by instructions
per element on an H100, not by memory: non-finite handling by four selects on the codes
made Inductor's kernel 50% slower and a compiled 1.1B Llama step 4-5% slower
(docs/history/benchmarks-2026-11.md). This definition keeps the guarantees with codes the
cast itself produces:

* the scale is a power of two 2**e putting the finite max in [0.8125, 1.625) * 2**E (the
  format's max is 1.75 * 2**E), so no finite value rounds to the top code. Normal values
  keep exactly the codes' relative precision; only the subnormal threshold moves, by
  under 8%;
* the top code (+-448 E4M3, +-57344 E5M2) therefore stands for +-inf: an inf is cast as
  +-max (what Hopper's saturating conversion does with it by itself). A NaN is cast as it
  is and comes back as NaN (the formats' own NaN codes);
* the max is an integer max over the float bits of |x| (they order like |x|), with
  non-finite values counted as 0: no NaN checks in the reduction;
* per group, groups are G consecutive elements of the contiguous tensor, whose last group
  is padded with zeros: a group may span two rows where a row is not a multiple of G.
  Padding each row instead miscompiles on Inductor's CPU backend (torch 2.11 and 2.13;
  CUDA Inductor gets it right): the last group of every row read back as zeros after
  slicing the padding off. Per tensor, the tensor is one group.

Zeros keep their sign, all-zero groups stay zero, and finite values never come back as
inf (decoding clamps to the output dtype's range). Codes and exponents live from a forward
to its backward only: no checkpoint holds them."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .fp8 import Fp8Format, get_format
from .reference import exponent_from_bits, pow2

__all__ = ["scale_exponent", "num_groups", "quantize_groups", "dequantize_groups", "quantize_tensor",
           "dequantize_tensor"]

_ABS_MASK = 0x7FFFFFFF
_INF_BITS = 0x7F800000
_MANTISSA_0625 = 0x500000  # 1.625 = 1 + 0x500000 / 2**23


def scale_exponent(amax_bits: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """Smallest e with amax * 2**-e < 1.625 * 2**E (int32, clamped to [-126, 126] so that
    2**e and 2**-e are normal floats), from the int32 bits of a finite non-negative float32
    amax: an all-zero group gets -126."""
    return exponent_from_bits(amax_bits, fmt, _MANTISSA_0625).clamp(-126, 126)


def num_groups(numel: int, group_size: int) -> int:
    """Exponents per-group quantization writes for `numel` elements: ceil(numel / G)."""
    return -(-numel // group_size)


def _flat_groups(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """(ceil(numel / G), G) view of contiguous `x`, zero-padded at the end."""
    flat = x.reshape(-1)
    pad = -flat.numel() % group_size
    return (F.pad(flat, (0, pad)) if pad else flat).reshape(-1, group_size)


def _encode(xf: torch.Tensor, e: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """uint8 codes of float32 `xf` at scale 2**e (broadcastable). Finite values scale below
    1.625 * 2**E, so the clamp only turns +-inf into the top code; a NaN stays NaN."""
    return (xf * pow2(-e)).clamp_(-fmt.max, fmt.max).to(fmt.dtype).view(torch.uint8)


def _finite_amax_bits(xf: torch.Tensor, dim=None) -> torch.Tensor:
    """int32 bits of max |x| over the finite elements (0 where none): the bits of |x| order
    like |x|, non-finite ones counted as 0."""
    mag = xf.view(torch.int32) & _ABS_MASK
    mag.masked_fill_(mag >= _INF_BITS, 0)
    return mag.amax() if dim is None else mag.amax(dim)


def _decode(codes: torch.Tensor, e: torch.Tensor, fmt: Fp8Format, dtype: torch.dtype) -> torch.Tensor:
    """float32 values of `codes` at scale 2**e (broadcastable), in `dtype`'s finite range. The
    top magnitude code (+-inf) and those above it (NaN) are told from the codes, so no float
    copy of them stays alive beside the values (the peak of a CPU backward)."""
    out_max = torch.finfo(dtype).max
    # Rounding up at the top of dtype's range (fp16 65504 -> 65536) must not give inf.
    x = (codes.view(fmt.dtype).to(torch.float32) * pow2(e.to(torch.int32))).clamp_(-out_max, out_max)
    return torch.where((codes & 0x7F) >= fmt.code_max, x * float("inf"), x)


def quantize_groups(x: torch.Tensor, group_size: int = 16, fmt="e4m3") -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 codes shaped like x, int8 exponents (ceil(numel / G),)) of contiguous `x`."""
    fmt = get_format(fmt)
    xg = _flat_groups(x, group_size).to(torch.float32)
    e = scale_exponent(_finite_amax_bits(xg, -1), fmt)
    codes = _encode(xg, e[..., None], fmt)
    return codes.reshape(-1)[: x.numel()].reshape(x.shape), e.to(torch.int8)


def dequantize_groups(codes: torch.Tensor, exps: torch.Tensor, group_size: int = 16, fmt="e4m3",
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values of `quantize_groups`'s output, as `dtype`, shaped like `codes`."""
    x = _decode(_flat_groups(codes, group_size), exps[..., None], get_format(fmt), dtype)
    return x.reshape(-1)[: codes.numel()].reshape(codes.shape).to(dtype)


def quantize_tensor(x: torch.Tensor, fmt="e4m3") -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 codes shaped like x, int32 exponent e of shape ()): one scale for the tensor."""
    fmt = get_format(fmt)
    xf = x.to(torch.float32)
    amax = _finite_amax_bits(xf) if x.numel() else torch.zeros((), dtype=torch.int32, device=x.device)
    e = scale_exponent(amax, fmt)
    return _encode(xf, e, fmt), e


def dequantize_tensor(codes: torch.Tensor, exp: torch.Tensor, fmt="e4m3",
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values of `quantize_tensor`'s output, as `dtype`."""
    return _decode(codes, exp, get_format(fmt), dtype).to(dtype)
