"""Per-group FP8 quantize / dequantize kernels (with or without DRE), a plain FP8 cast, and
their launchers."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .codec import fmt_max, decode_fp8, dequantize_tile, encode_fp8, quantize_tile
from .fp8 import K_ONE, get_format, kernel_isa
from .layout import QuantizedGroups, group_layout

__all__ = ["quantize_groups", "dequantize_groups", "cast_fp8", "tile_shape"]

# Elements one program handles. Interpreter cost grows with program count, GPU cost wants
# a few thousand elements in flight per program.
_BLOCK_ELEMS = 4096


def tile_shape(group_size: int) -> int:
    """Groups per program for a power-of-two group size."""
    return max(1, _BLOCK_ELEMS // group_size)


@triton.jit
def _group_offsets(gi, n_groups, cols, gpr, G: tl.constexpr, ALIGNED: tl.constexpr):
    """Element offsets [BG, G] and validity of groups `gi` (int32) in a (rows, cols) tensor.

    ALIGNED promises cols % 16 == 0 (and 16-byte-aligned bases), which lets loads and
    stores be 16 bytes wide: the row-tail mask is then constant over runs of 16 lanes, and
    it is written so that Triton's alignment analysis can see that."""
    row = gi // gpr
    col0 = (gi - row * gpr) * G
    lane = tl.arange(0, G)
    base = row.to(tl.int64) * cols + col0
    if ALIGNED:
        base = tl.multiple_of(base, 16)
        lane_run = (lane // 16) * 16
    else:
        lane_run = lane
    valid = (gi < n_groups)[:, None] & ((col0[:, None] + lane_run[None, :]) < cols)
    return base[:, None] + lane[None, :], valid


@triton.jit
def _quantize_groups_kernel(x_ptr, codes_ptr, center_ptr, kcode_ptr, sexp_ptr, n_groups, cols, gpr,
                            FMT: tl.constexpr, DRE: tl.constexpr, DRE_KNUM: tl.constexpr,
                            G: tl.constexpr, BG: tl.constexpr, ISA: tl.constexpr):
    gi = tl.program_id(0) * BG + tl.arange(0, BG)
    offs, valid = _group_offsets(gi, n_groups, cols, gpr, G, False)
    x = tl.load(x_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    codes, center, kcode, sexp = quantize_tile(x, FMT, DRE, DRE_KNUM, ISA)
    tl.store(codes_ptr + offs, codes, mask=valid)
    gmask = gi < n_groups
    tl.store(center_ptr + gi, center, mask=gmask)
    tl.store(kcode_ptr + gi, kcode, mask=gmask)
    tl.store(sexp_ptr + gi, sexp, mask=gmask)


@triton.jit
def _dequantize_groups_kernel(codes_ptr, center_ptr, kcode_ptr, sexp_ptr, out_ptr, n_groups, cols, gpr,
                              FMT: tl.constexpr, G: tl.constexpr, BG: tl.constexpr, ISA: tl.constexpr):
    gi = tl.program_id(0) * BG + tl.arange(0, BG)
    offs, valid = _group_offsets(gi, n_groups, cols, gpr, G, False)
    gmask = gi < n_groups
    codes = tl.load(codes_ptr + offs, mask=valid, other=0)
    center = tl.load(center_ptr + gi, mask=gmask, other=1.0)
    kcode = tl.load(kcode_ptr + gi, mask=gmask, other=16)
    sexp = tl.load(sexp_ptr + gi, mask=gmask, other=0)
    x = dequantize_tile(codes, center, kcode, sexp, FMT, ISA)
    tl.store(out_ptr + offs, x.to(out_ptr.dtype.element_ty), mask=valid)


def quantize_groups(x: torch.Tensor, group_size: int = 128, fmt="e4m3", dre: bool = True) -> QuantizedGroups:
    """Triton twin of `reference.quantize_groups`; `x` contiguous, any float dtype."""
    f = get_format(fmt)
    x = x.contiguous()
    lay = group_layout(x.shape, group_size)
    out = QuantizedGroups(
        torch.empty(x.shape, dtype=torch.uint8, device=x.device),
        torch.empty(lay.meta_shape, dtype=torch.float32, device=x.device),
        torch.empty(lay.meta_shape, dtype=torch.uint8, device=x.device),
        torch.empty(lay.meta_shape, dtype=torch.int8, device=x.device),
    )
    if lay.num_groups:
        bg = tile_shape(group_size)
        _quantize_groups_kernel[(triton.cdiv(lay.num_groups, bg),)](
            x, *out, lay.num_groups, lay.cols, lay.groups_per_row,
            FMT=f.id, DRE=dre, DRE_KNUM=K_ONE * f.dre_log2_range, G=group_size, BG=bg,
            ISA=kernel_isa(x.device))
    return out


def dequantize_groups(qg: QuantizedGroups, group_size: int = 128, fmt="e4m3",
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Triton twin of `reference.dequantize_groups`."""
    f = get_format(fmt)
    lay = group_layout(qg.codes.shape, group_size)
    out = torch.empty(qg.codes.shape, dtype=dtype, device=qg.codes.device)
    if lay.num_groups:
        bg = tile_shape(group_size)
        _dequantize_groups_kernel[(triton.cdiv(lay.num_groups, bg),)](
            qg.codes.contiguous(), qg.center, qg.kcode, qg.sexp, out, lay.num_groups, lay.cols,
            lay.groups_per_row, FMT=f.id, G=group_size, BG=bg, ISA=kernel_isa(out.device))
    return out


@triton.jit
def _cast_fp8_kernel(x_ptr, codes_ptr, out_ptr, n, FMT: tl.constexpr, BLOCK: tl.constexpr, ISA: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    codes = encode_fp8(tl.minimum(tl.maximum(x, -fmt_max(FMT)), fmt_max(FMT)), FMT, ISA)
    tl.store(codes_ptr + offs, codes, mask=mask)
    tl.store(out_ptr + offs, decode_fp8(codes, FMT, ISA), mask=mask)


def cast_fp8(x: torch.Tensor, fmt="e4m3") -> tuple[torch.Tensor, torch.Tensor]:
    """Saturating RNE cast to FP8: (uint8 codes, their float32 values). Twin of
    `reference.encode_fp8` / `reference.decode_fp8`."""
    f = get_format(fmt)
    x = x.contiguous()
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if x.numel():
        _cast_fp8_kernel[(triton.cdiv(x.numel(), _BLOCK_ELEMS),)](x, codes, out, x.numel(), FMT=f.id,
                                                                  BLOCK=_BLOCK_ELEMS, ISA=kernel_isa(x.device))
    return codes, out
