"""Triton kernels of the saved activations' FP8 codec (kernels/act_codec.py defines it;
these compute its codes and exponents bit for bit): per tensor and per group of G
consecutive elements, with power-of-two scales.

Scales are powers of two stored as exponents: one int32 per tensor, one int8 per group. A
power-of-two scale is exact in both directions (no division in the quantizer, no rounding
in the dequantizer), so the kernels and the torch definition agree bit for bit, and an int8
exponent costs 1/16 byte per element at G = 16 where a bf16 scale would cost 1/8 (that
difference alone would push a Llama block above 0.55x of BF16).

Launches are what a saved tensor costs on the host, so each operation is one launch except
per-tensor quantization, which needs the whole tensor's max before it can scale: every
program of a first kernel folds its block's max into one int32 with `atomic_max` (the bits
of a non-negative float order like the float, NaN above inf as torch's amax has it), and
the quantizer reads that max back from device memory: two launches and a memset, no host
sync. Offsets inside a program are int32 from an int64 block base: 64-bit arithmetic per
element would cost instructions on the GPU for nothing. A group is G consecutive elements,
so a program's groups are one contiguous run of its block: 16-byte vector loads whatever
the tensor's shape, and only the tensor's last group is short.

Non-finite values (act_codec's rules: scales from finite values, inf as the top code, NaN as
a NaN code) cost work only where they occur: each quantizing program reduces the int32 bits
of |x| (inf above every finite value, NaN above inf) (per tensor: the max kernel does, over
the whole tensor), and where that is finite takes the plain path, a scale and a cast. A
block (tensor) holding an inf or a NaN takes its max over the finite values only. The
conversions map inf to the top code themselves (they saturate); Hopper's maps NaN to NaN,
the software one to the max code, which the non-finite path then replaces.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .act_codec import num_groups
from .act_launch import launch
from .codec import decode_fp8, encode_fp8, pow2
from .fp8 import get_format, tensor_isa

__all__ = ["quantize_tensor", "dequantize_tensor", "quantize_groups", "dequantize_groups", "BLOCK_ELEMS"]

# Elements per program: a few thousand keeps enough bytes in flight per program on a GPU
# (4 warps, 32 elements per thread: 16-byte loads of BF16) and few programs under the
# interpreter, whose cost is per program instance.
BLOCK_ELEMS = 4096
_NUM_WARPS = 4

_OUT_MAX: dict = {}


def _out_max(dtype: torch.dtype) -> float:
    # torch.finfo costs a few microseconds a call; this runs once per dequantized tensor.
    m = _OUT_MAX.get(dtype)
    if m is None:
        m = _OUT_MAX[dtype] = torch.finfo(dtype).max
    return m


_INF_BITS = tl.constexpr(0x7F800000)  # the bits of +inf: |x|'s bits are below them iff x is finite
_NAN_CODE = tl.constexpr(0x7F)  # a NaN in both formats


@triton.jit
def _abs_bits(x):
    """The int32 bits of float32 |x|: they order like |x|, +inf above every finite value and
    NaN above +inf, so one integer max per block tells whether it is all finite."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _finite_max(ab, axis: tl.constexpr):
    """Max of the |x| bits `ab` over the finite values (non-finite counted as 0)."""
    return tl.max(tl.where(ab < _INF_BITS, ab, 0), axis=axis)


@triton.jit
def _scale_exponent(amax_bits, FMT: tl.constexpr):
    """act_codec.scale_exponent: smallest e with amax * 2**-e < 1.625 * 2**E, clamped to
    [-126, 126], from the bits of a finite amax (the format's max is 1.75 * 2**E)."""
    if FMT == 0:
        E: tl.constexpr = 8
    else:
        E: tl.constexpr = 15
    e = ((amax_bits >> 23) & 0xFF) - (127 + E) + ((amax_bits & 0x7FFFFF) >= 0x500000).to(tl.int32)
    return tl.minimum(tl.maximum(e, -126), 126)


@triton.jit
def _encode_non_finite(x, e, FMT: tl.constexpr, ISA: tl.constexpr):
    """Codes of float32 `x` holding inf or NaN, scaled by 2**-e (e broadcastable to x)."""
    c = encode_fp8(x * pow2(-e), FMT, ISA)
    if ISA != 2:
        c = tl.where(x != x, _NAN_CODE, c).to(tl.uint8)  # the software conversion saturates NaN
    return c


@triton.jit
def _decode(c, e, out_max, FMT: tl.constexpr, ISA: tl.constexpr):
    """act_codec's decoding: 2**e times the code's value, clamped to the output dtype's
    finite range (rounding up at the top of the fp32/fp16 range must not turn a finite input
    into inf); the top code is +-inf, the NaN codes NaN."""
    d = decode_fp8(c, FMT, ISA)
    x = tl.minimum(tl.maximum(d * pow2(e), -out_max), out_max)
    mag = c.to(tl.int32) & 0x7F
    if FMT == 0:
        TOP: tl.constexpr = 0x7E
        LAST_INF: tl.constexpr = 0x7E
    else:
        TOP: tl.constexpr = 0x7B
        LAST_INF: tl.constexpr = 0x7C  # E5M2's own inf code, never written: torch's value
    if ISA == 2:
        special = d * float("inf")  # the hardware decodes the NaN codes as NaN
    else:
        # The software decoding reads them as finite values; sign | inf's bits give +-inf.
        special = tl.where(mag > LAST_INF, 0x7FC00000,
                           ((c.to(tl.int32) & 0x80) << 24) | 0x7F800000).to(tl.float32, bitcast=True)
    return tl.where(mag < TOP, x, special)


@triton.jit
def _absmax_kernel(x_ptr, amax_bits_ptr, n, BLOCK: tl.constexpr):
    """Folds its block into [max finite |x|, -, max |x| of blocks holding a non-finite value]
    (int32 bits; non-finite |x| is above every finite one): the quantizer reads the first for
    its scale and the third to tell an all-finite tensor, whose programs then all take the
    plain path."""
    base = tl.program_id(0).to(tl.int64) * BLOCK
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + base + offs, mask=offs < n - base, other=0.0).to(tl.float32)
    ab = _abs_bits(x)
    block_max = tl.max(ab, axis=0)
    # One reduction and one atomic for a finite block; the third slot is written only by
    # blocks holding an inf or a NaN.
    if block_max < _INF_BITS:
        tl.atomic_max(amax_bits_ptr, block_max)
    else:
        tl.atomic_max(amax_bits_ptr, _finite_max(ab, 0))
        tl.atomic_max(amax_bits_ptr + 2, block_max)


@triton.jit
def _quantize_tensor_kernel(x_ptr, amax_bits_ptr, exp_ptr, codes_ptr, n, FMT: tl.constexpr, BLOCK: tl.constexpr,
                            ISA: tl.constexpr):
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * BLOCK
    offs = tl.arange(0, BLOCK)
    mask = offs < n - base
    x = tl.load(x_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    e = _scale_exponent(tl.load(amax_bits_ptr), FMT)
    if pid == 0:
        tl.store(exp_ptr, e)
    if tl.load(amax_bits_ptr + 2) < _INF_BITS:
        c = encode_fp8(x * pow2(-e), FMT, ISA)
    else:
        c = _encode_non_finite(x, e, FMT, ISA)
    tl.store(codes_ptr + base + offs, c, mask=mask)


@triton.jit
def _dequantize_tensor_kernel(codes_ptr, exp_ptr, out_ptr, n, out_max, FMT: tl.constexpr, BLOCK: tl.constexpr,
                              ISA: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * BLOCK
    offs = tl.arange(0, BLOCK)
    mask = offs < n - base
    e = tl.load(exp_ptr)
    x = _decode(tl.load(codes_ptr + base + offs, mask=mask, other=0), e, out_max, FMT, ISA)
    tl.store(out_ptr + base + offs, x.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _group_tile(n, G: tl.constexpr, BG: tl.constexpr):
    """(int64 element base, int32 offsets [BG, G] from it, their mask, index of the
    program's first group, group offsets [BG] from it, their mask) of this program's BG
    groups: a group exists where its first element does."""
    g0 = tl.program_id(0).to(tl.int64) * BG
    base = g0 * G
    gl = tl.arange(0, BG)
    offs = gl[:, None] * G + tl.arange(0, G)[None, :]
    return base, offs, offs < n - base, g0, gl, gl * G < n - base


@triton.jit
def _quantize_groups_kernel(x_ptr, codes_ptr, exp_ptr, n, FMT: tl.constexpr, G: tl.constexpr,
                            BG: tl.constexpr, ISA: tl.constexpr):
    base, offs, mask, g0, gl, gmask = _group_tile(n, G, BG)
    x = tl.load(x_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    ab = _abs_bits(x)
    gmax = tl.max(ab, axis=1)  # each group's max |x| as bits, if the group is finite
    if tl.max(gmax, axis=0) < _INF_BITS:
        e = _scale_exponent(gmax, FMT)
        c = encode_fp8(x * pow2(-e)[:, None], FMT, ISA)
    else:
        e = _scale_exponent(_finite_max(ab, 1), FMT)
        c = _encode_non_finite(x, e[:, None], FMT, ISA)
    tl.store(codes_ptr + base + offs, c, mask=mask)
    tl.store(exp_ptr + g0 + gl, e.to(tl.int8), mask=gmask)


@triton.jit
def _dequantize_groups_kernel(codes_ptr, exp_ptr, out_ptr, n, out_max, FMT: tl.constexpr,
                              G: tl.constexpr, BG: tl.constexpr, ISA: tl.constexpr):
    base, offs, mask, g0, gl, gmask = _group_tile(n, G, BG)
    e = tl.load(exp_ptr + g0 + gl, mask=gmask, other=0).to(tl.int32)
    x = _decode(tl.load(codes_ptr + base + offs, mask=mask, other=0), e[:, None], out_max, FMT, ISA)
    tl.store(out_ptr + base + offs, x.to(out_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor) -> int:
    """The kernels' ISA constexpr for x's device (see fp8.py). Outputs are then allocated
    with `empty_like` (about half the host time of `torch.empty(shape, device=...)`), which
    gives contiguous tensors for this contiguous x."""
    if not x.is_contiguous():
        raise ValueError("activation kernels take contiguous tensors")
    return tensor_isa(x)


def quantize_tensor(x: torch.Tensor, fmt="e4m3") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor FP8: (uint8 codes shaped like x, int32 exponent e of shape ()); x ~ q * 2**e."""
    isa = _check(x)
    fmt_id = get_format(fmt).id
    n = x.numel()
    codes = torch.empty_like(x, dtype=torch.uint8)  # x is contiguous (_check), so codes are too
    # [max finite |x|, exponent, max |x|] (the maxima as int32 bits): one buffer, one memset.
    scratch = torch.zeros(3, dtype=torch.int32, device=x.device)
    exp = scratch[1]
    n_prog = max(1, triton.cdiv(n, BLOCK_ELEMS))
    if n:
        launch(_absmax_kernel, n_prog, (x, scratch, n), (BLOCK_ELEMS,), _NUM_WARPS)
    launch(_quantize_tensor_kernel, n_prog, (x, scratch, exp, codes, n), (fmt_id, BLOCK_ELEMS, isa), _NUM_WARPS)
    return codes, exp


def dequantize_tensor(codes: torch.Tensor, exp: torch.Tensor, fmt="e4m3",
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize_tensor`, written in `dtype`."""
    isa = _check(codes)
    out = torch.empty_like(codes, dtype=dtype)
    n = codes.numel()
    if n:
        launch(_dequantize_tensor_kernel, triton.cdiv(n, BLOCK_ELEMS), (codes, exp, out, n, _out_max(dtype)),
               (get_format(fmt).id, BLOCK_ELEMS, isa), _NUM_WARPS)
    return out


def _groups_per_block(group_size: int) -> int:
    return max(1, BLOCK_ELEMS // group_size)


def quantize_groups(x: torch.Tensor, group_size: int = 16, fmt="e4m3") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group FP8, groups of G consecutive elements: (uint8 codes shaped like x, int8
    exponents of shape (ceil(numel / G),)); the last group is padded with zeros."""
    isa = _check(x)
    n = x.numel()
    codes = torch.empty_like(x, dtype=torch.uint8)
    exps = x.new_empty((num_groups(n, group_size),), dtype=torch.int8)
    if n:
        bg = _groups_per_block(group_size)
        launch(_quantize_groups_kernel, triton.cdiv(n, bg * group_size), (x, codes, exps, n),
               (get_format(fmt).id, group_size, bg, isa), _NUM_WARPS)
    return codes, exps


def dequantize_groups(codes: torch.Tensor, exps: torch.Tensor, group_size: int = 16, fmt="e4m3",
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize_groups`, written in `dtype`."""
    isa = _check(codes)
    out = torch.empty_like(codes, dtype=dtype)
    n = codes.numel()
    if n:
        bg = _groups_per_block(group_size)
        launch(_dequantize_groups_kernel, triton.cdiv(n, bg * group_size), (codes, exps, out, n, _out_max(dtype)),
               (get_format(fmt).id, group_size, bg, isa), _NUM_WARPS)
    return out
