"""FP8 kernels for saved activations: per-tensor and per-group (1 x G) power-of-two scaling.

Scales are powers of two stored as exponents: one int32 per tensor, one int8 per group of G
elements along the last dim. A power-of-two scale is exact in both directions (no division
in the quantizer, no rounding in the dequantizer), so the Triton kernels and their torch
twins agree bit for bit, and an int8 exponent costs 1/16 byte per element at G = 16 where a
bf16 scale would cost 1/8 (that difference alone would push a Llama block above 0.55x of
BF16). Scaling by a power of two instead of max/448 only leaves the top 0..1 binade of the
FP8 range unused; FP8 precision is relative, so normal values lose nothing.

Per-tensor scaling takes the tensor max in two stages ("group scaling" in COAT): every
program reduces its block to one partial max, a single program reduces the partials and
writes the exponent, and the quantizer reads that exponent from memory, with no host sync.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .codec import decode_fp8, encode_fp8, pow2, scale_exponent
from .fp8 import get_format
from .layout import group_layout

__all__ = ["quantize_tensor", "dequantize_tensor", "quantize_rows", "dequantize_rows", "BLOCK_ELEMS"]

# Elements per program: enough in flight per program on a GPU, few programs under the
# interpreter (whose cost is per program instance).
BLOCK_ELEMS = 4096
_PARTIALS_BLOCK = 1024


@triton.jit
def _scale_exponent(amax, FMT: tl.constexpr):
    """Smallest e with amax * 2**-e <= the format's max, clamped to [-126, 126] so that both
    2**e and 2**-e are normal floats (an all-zero or subnormal group gets e = -126)."""
    return tl.minimum(tl.maximum(scale_exponent(amax, FMT), -126), 126)


@triton.jit
def _absmax_partial_kernel(x_ptr, partial_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(partial_ptr + pid, tl.max(tl.abs(x), axis=0))


@triton.jit
def _tensor_exponent_kernel(partial_ptr, exp_ptr, n_partials, FMT: tl.constexpr, BLOCK: tl.constexpr):
    acc = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, n_partials, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc = tl.maximum(acc, tl.load(partial_ptr + offs, mask=offs < n_partials, other=0.0))
    tl.store(exp_ptr, _scale_exponent(tl.max(acc, axis=0), FMT))


@triton.jit
def _quantize_tensor_kernel(x_ptr, exp_ptr, codes_ptr, n, FMT: tl.constexpr, BLOCK: tl.constexpr,
                            HW: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    e = tl.load(exp_ptr)
    tl.store(codes_ptr + offs, encode_fp8(x * pow2(-e), FMT, HW), mask=mask)


@triton.jit
def _dequantize_tensor_kernel(codes_ptr, exp_ptr, out_ptr, n, out_max, FMT: tl.constexpr, BLOCK: tl.constexpr,
                              HW: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    e = tl.load(exp_ptr)
    x = decode_fp8(tl.load(codes_ptr + offs, mask=mask, other=0), FMT, HW) * pow2(e)
    # Rounding up at the top of the fp32/fp16 range could overflow; keep results finite.
    x = tl.minimum(tl.maximum(x, -out_max), out_max)
    tl.store(out_ptr + offs, x.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _row_group_offsets(gi, n_groups, cols, gpr, G: tl.constexpr, EVEN: tl.constexpr):
    """Offsets [BG, G] and validity of groups `gi` of a (rows, cols) tensor; groups never
    cross a row, so a row whose length is not a multiple of G ends in a short group.

    EVEN promises cols % G == 0: group gi is then elements [gi * G, gi * G + G) of the flat
    tensor, a form whose contiguity Triton can see, so loads and stores are vectorized."""
    lane = tl.arange(0, G)
    if EVEN:
        return gi[:, None] * G + lane[None, :], (gi < n_groups)[:, None] & (lane < G)[None, :]
    row = gi // gpr
    col = (gi - row * gpr) * G
    valid = (gi < n_groups)[:, None] & ((col[:, None] + lane[None, :]) < cols)
    return (row * cols + col)[:, None] + lane[None, :], valid


@triton.jit
def _quantize_rows_kernel(x_ptr, codes_ptr, exp_ptr, n_groups, cols, gpr,
                          FMT: tl.constexpr, G: tl.constexpr, BG: tl.constexpr, EVEN: tl.constexpr,
                          HW: tl.constexpr):
    gi = tl.program_id(0).to(tl.int64) * BG + tl.arange(0, BG)
    offs, valid = _row_group_offsets(gi, n_groups, cols, gpr, G, EVEN)
    x = tl.load(x_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    e = _scale_exponent(tl.max(tl.abs(x), axis=1), FMT)
    tl.store(codes_ptr + offs, encode_fp8(x * pow2(-e)[:, None], FMT, HW), mask=valid)
    tl.store(exp_ptr + gi, e.to(tl.int8), mask=gi < n_groups)


@triton.jit
def _dequantize_rows_kernel(codes_ptr, exp_ptr, out_ptr, n_groups, cols, gpr, out_max,
                            FMT: tl.constexpr, G: tl.constexpr, BG: tl.constexpr, EVEN: tl.constexpr,
                            HW: tl.constexpr):
    gi = tl.program_id(0).to(tl.int64) * BG + tl.arange(0, BG)
    offs, valid = _row_group_offsets(gi, n_groups, cols, gpr, G, EVEN)
    e = tl.load(exp_ptr + gi, mask=gi < n_groups, other=0).to(tl.int32)
    x = decode_fp8(tl.load(codes_ptr + offs, mask=valid, other=0), FMT, HW) * pow2(e)[:, None]
    x = tl.minimum(tl.maximum(x, -out_max), out_max)
    tl.store(out_ptr + offs, x.to(out_ptr.dtype.element_ty), mask=valid)


def _hw(t: torch.Tensor) -> bool:
    """Compiled for a GPU (hardware FP8 casts) rather than run by the interpreter."""
    return t.device.type == "cuda"


def _flat(x: torch.Tensor) -> torch.Tensor:
    if not x.is_contiguous():
        raise ValueError("activation kernels take contiguous tensors")
    return x


def quantize_tensor(x: torch.Tensor, fmt="e4m3") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor FP8: (uint8 codes shaped like x, int32 exponent e of shape ()); x ~ q * 2**e."""
    f = get_format(fmt)
    x = _flat(x)
    n = x.numel()
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    exp = torch.empty((), dtype=torch.int32, device=x.device)
    n_prog = max(1, triton.cdiv(n, BLOCK_ELEMS))
    partial = torch.empty(n_prog, dtype=torch.float32, device=x.device)
    _absmax_partial_kernel[(n_prog,)](x, partial, n, BLOCK=BLOCK_ELEMS)
    _tensor_exponent_kernel[(1,)](partial, exp, n_prog, FMT=f.id, BLOCK=_PARTIALS_BLOCK)
    if n:
        _quantize_tensor_kernel[(n_prog,)](x, exp, codes, n, FMT=f.id, BLOCK=BLOCK_ELEMS, HW=_hw(x))
    return codes, exp


def dequantize_tensor(codes: torch.Tensor, exp: torch.Tensor, fmt="e4m3",
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize_tensor`, written in `dtype`."""
    f = get_format(fmt)
    codes = _flat(codes)
    out = torch.empty(codes.shape, dtype=dtype, device=codes.device)
    n = codes.numel()
    if n:
        _dequantize_tensor_kernel[(triton.cdiv(n, BLOCK_ELEMS),)](
            codes, exp, out, n, torch.finfo(dtype).max, FMT=f.id, BLOCK=BLOCK_ELEMS, HW=_hw(codes))
    return out


def quantize_rows(x: torch.Tensor, group_size: int = 16, fmt="e4m3") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group FP8 along the last dim: (uint8 codes shaped like x, int8 exponents of shape
    (rows, ceil(cols / G))); a short last group per row is padded with zeros."""
    f = get_format(fmt)
    x = _flat(x)
    lay = group_layout(x.shape, group_size)
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    exps = torch.empty(lay.meta_shape, dtype=torch.int8, device=x.device)
    if lay.num_groups:
        bg = max(1, BLOCK_ELEMS // group_size)
        _quantize_rows_kernel[(triton.cdiv(lay.num_groups, bg),)](
            x, codes, exps, lay.num_groups, lay.cols, lay.groups_per_row, FMT=f.id, G=group_size, BG=bg,
            EVEN=lay.cols % group_size == 0, HW=_hw(x))
    return codes, exps


def dequantize_rows(codes: torch.Tensor, exps: torch.Tensor, group_size: int = 16, fmt="e4m3",
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize_rows`, written in `dtype`."""
    f = get_format(fmt)
    codes = _flat(codes)
    lay = group_layout(codes.shape, group_size)
    out = torch.empty(codes.shape, dtype=dtype, device=codes.device)
    if lay.num_groups:
        bg = max(1, BLOCK_ELEMS // group_size)
        _dequantize_rows_kernel[(triton.cdiv(lay.num_groups, bg),)](
            codes, exps, out, lay.num_groups, lay.cols, lay.groups_per_row, torch.finfo(dtype).max,
            FMT=f.id, G=group_size, BG=bg, EVEN=lay.cols % group_size == 0, HW=_hw(codes))
    return out
