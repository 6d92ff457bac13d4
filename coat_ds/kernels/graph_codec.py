"""The per-group FP8 codec of compiled graphs: torch ops only, written for what Inductor
makes of them.

Inductor fuses each quantization into one kernel that reads a saved tensor and writes its
codes. On an H100 that kernel is bound by instructions per element, not by memory: the
eager codec's non-finite handling (four selects on the codes) made it 50% slower and a
compiled 1.1B Llama step 4-5% slower (docs/history/benchmarks-2026-11.md). This codec keeps the same
guarantees with fewer instructions, by choosing codes the cast itself produces:

* the scale is a power of two putting a group's finite max in [0.8125, 1.625) * 2**E
  (the format's max is 1.75 * 2**E), so no finite value rounds to the top code. Normal
  values keep exactly the codes' relative precision; only the subnormal threshold moves,
  by under 8%;
* the top code (+-448 E4M3, +-57344 E5M2) therefore stands for +-inf: an inf is cast as
  +-max. A NaN is cast as it is and comes back as NaN (the formats' own NaN codes);
* the max is an integer max over the float bits of |x| (they order like |x|), with
  non-finite values counted as 0: no NaN checks in the reduction;
* groups are G consecutive elements of the flattened tensor, which is padded once at its
  end: a group may span two rows where a row is not a multiple of G. Padding each row
  (the eager layout) miscompiles on Inductor's CPU backend (torch 2.11 and 2.13; CUDA
  Inductor gets it right): the last group of every row read back as zeros after slicing
  the padding off.

Zeros keep their sign, all-zero groups stay zero, and finite values never come back as
inf (decoding clamps to the output dtype's range). Codes and exponents are private to the
graph that writes them (the eager hooks use kernels/act_quant.py's layout)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .fp8 import Fp8Format
from .reference import exponent_from_bits, pow2

__all__ = ["graph_quantize", "graph_dequantize", "graph_scale_exponent"]

_ABS_MASK = 0x7FFFFFFF
_INF_BITS = 0x7F800000
_MANTISSA_0625 = 0x500000  # 1.625 = 1 + 0x500000 / 2**23


def graph_scale_exponent(amax_bits: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """Smallest e with amax * 2**-e < 1.625 * 2**E (int32, clamped to [-126, 126]), from the
    int32 bits of a finite non-negative float32 amax: reference.scale_exponent's reading of
    the bits, with the mantissa threshold at 1.625 rather than above 1.75."""
    return exponent_from_bits(amax_bits, fmt, _MANTISSA_0625).clamp(-126, 126)


def _flat_groups(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """(ceil(numel / G), G) view of contiguous `x`, zero-padded at the end."""
    flat = x.reshape(-1)
    pad = -flat.numel() % group_size
    return (F.pad(flat, (0, pad)) if pad else flat).reshape(-1, group_size)


def graph_quantize(x: torch.Tensor, group_size: int, fmt: Fp8Format) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 codes shaped like x, int8 exponents (ceil(numel / G),)) of contiguous `x`."""
    xg = _flat_groups(x, group_size).to(torch.float32)
    mag = xg.view(torch.int32) & _ABS_MASK
    e = graph_scale_exponent(torch.where(mag < _INF_BITS, mag, 0).amax(-1), fmt)
    y = xg * pow2(-e)[..., None]
    y = torch.where(mag == _INF_BITS, torch.where(xg > 0, fmt.max, -fmt.max), y)
    codes = y.to(fmt.dtype).view(torch.uint8)
    return codes.reshape(-1)[: x.numel()].reshape(x.shape), e.to(torch.int8)


def graph_dequantize(codes: torch.Tensor, exps: torch.Tensor, group_size: int, fmt: Fp8Format,
                     dtype: torch.dtype) -> torch.Tensor:
    """Values of `graph_quantize`'s output, as `dtype`, shaped like `codes`."""
    d = _flat_groups(codes, group_size).view(fmt.dtype).to(torch.float32)
    out_max = torch.finfo(dtype).max
    x = d * pow2(exps.to(torch.int32))[..., None]
    # Rounding up at the top of dtype's range (fp16 65504 -> 65536) must not give inf; a
    # NaN here is replaced below, so these selects need not propagate it.
    x = torch.where(x > out_max, out_max, x)
    x = torch.where(x < -out_max, -out_max, x)
    x = torch.where(d.abs() < fmt.max, x, d * float("inf"))
    return x.reshape(-1)[: codes.numel()].reshape(codes.shape).to(dtype)
