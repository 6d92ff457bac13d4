"""Per-group FP8 with Dynamic Range Expansion: the optimizer moments' codec (registry op
"group_codec"; custom ops `quantize_groups`, `dequantize_groups`).

A group (G consecutive elements of a row, layout.py) stores codes q, a centre c, an exponent
k and a power-of-two scale 2**e with x = sign(q) * (|q| * 2**e) ** (1/k) * c. Zeros stay
exact zeros and a group of equal magnitudes decodes exactly (c is that magnitude); without
DRE, k = 1 and c = absmax.

The torch twin computes what the Triton kernel computes, in the same order where it decides
a result (exponent choice, centre, power-of-two scale), so the two agree to within one
rounding of the last FP8 bit (log2/exp2 differ there)."""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import Tensor

from .custom_ops import decoded_fake, define
from .fp8 import K_MAX_CODE, K_MIN_CODE, K_ONE, Fp8Format, get_format, kernel_isa
from .fp8_torch import encode_fp8, decode_fp8, exact_div, pow2, scale_exponent
from .fp8_triton import dequantize_tile, quantize_tile
from .jit import jit
from .layout import QuantizedGroups, group_layout

__all__ = ["quantize_groups", "dequantize_groups", "grouped", "ungrouped", "quantize_grouped", "dequantize_grouped",
           "group_offsets", "tile_shape", "GroupCodec", "TORCH", "TRITON"]

triton = tl = None  # jit.bind sets them when a Triton backend is chosen


# ---- The torch twin ---------------------------------------------------------------------


def grouped(x: Tensor, group_size: int) -> Tensor:
    """(rows, groups_per_row, G) view of `x` in its own dtype, zero-padded at row tails."""
    lay = group_layout(x.shape, group_size)
    x2 = x.reshape(lay.rows, lay.cols)
    pad = lay.groups_per_row * group_size - lay.cols
    if pad:
        x2 = torch.cat([x2, x2.new_zeros(lay.rows, pad)], dim=1)
    return x2.reshape(lay.rows, lay.groups_per_row, group_size)


def ungrouped(xg: Tensor, shape: torch.Size) -> Tensor:
    cols = shape[-1] if len(shape) else 1
    return xg.flatten(1)[:, :cols].reshape(shape)


def quantize_grouped(xg: Tensor, fmt: Fp8Format, dre: bool) -> QuantizedGroups:
    """`quantize_groups` of float32 groups `xg` (..., G); the codes stay grouped."""
    a = xg.abs()
    amax = a.amax(-1)
    amin = torch.where(a > 0, a, float("inf")).amin(-1)
    nonzero = amax > 0
    lmax = torch.log2(amax)
    if dre:
        # k stretches (or, below 1, compresses) the group's range onto the format's.
        log2r = lmax - torch.log2(amin)
        kf = torch.floor(exact_div(K_ONE * fmt.dre_log2_range, log2r))
        kf = torch.where(log2r > 0, kf, float(K_MAX_CODE)).clamp_(K_MIN_CODE, K_MAX_CODE)
        center = torch.where(amax == amin, amax, torch.sqrt(amax) * torch.sqrt(amin))
    else:
        kf = torch.full_like(amax, K_ONE)
        center = amax
    kf = torch.where(nonzero, kf, float(K_ONE))
    center = torch.where(nonzero, center, 1.0)
    lc = torch.log2(center)
    k = kf / K_ONE
    y = torch.where(a > 0, torch.exp2(k[..., None] * (torch.log2(a) - lc[..., None])), 0.0)
    ymax = torch.where(nonzero, torch.exp2(k * (lmax - lc)), 1.0)  # the image of amax
    sexp = torch.where(nonzero, scale_exponent(ymax, fmt), 0)
    q = torch.clamp(y * pow2(-sexp)[..., None], max=fmt.max)
    if dre:
        # Below the format's range (a group wider than range / k): the smallest code, not 0.
        q = torch.where((a > 0) & nonzero[..., None], q.clamp(min=fmt.min_subnormal), q)
    q = torch.where(xg < 0, -q, q)
    return QuantizedGroups(encode_fp8(q, fmt), center, kf.to(torch.uint8), sexp.to(torch.int8))


def dequantize_grouped(qg: QuantizedGroups, fmt: Fp8Format) -> Tensor:
    """float32 values of `quantize_grouped`'s output, grouped as its codes are."""
    q = decode_fp8(qg.codes, fmt)
    y = q.abs() * pow2(qg.sexp)[..., None]
    t = torch.log2(y) * exact_div(float(K_ONE), qg.kcode.to(torch.float32))[..., None]
    center = qg.center[..., None].expand_as(t)
    # Sum logs rather than multiply (no overflow); y == 1 returns the centre exactly.
    a = torch.where(t == 0, center, torch.exp2(t + torch.log2(center)))
    a = a.clamp_(max=torch.finfo(torch.float32).max)
    return torch.where(q < 0, -a, a)


def quantize_groups(x: Tensor, group_size: int = 128, fmt="e4m3", dre: bool = True) -> QuantizedGroups:
    """Per-group FP8 quantization along the last dim, with or without DRE (see above)."""
    fmt = get_format(fmt)
    qg = quantize_grouped(grouped(x, group_size).to(torch.float32), fmt, dre)
    return qg._replace(codes=ungrouped(qg.codes, x.shape).contiguous())


def dequantize_groups(qg: QuantizedGroups, group_size: int = 128, fmt="e4m3",
                      dtype: torch.dtype = torch.float32) -> Tensor:
    fmt = get_format(fmt)
    x = dequantize_grouped(qg._replace(codes=grouped(qg.codes, group_size)), fmt)
    return ungrouped(x, qg.codes.shape).to(dtype).contiguous()


# ---- The Triton kernels -----------------------------------------------------------------

# Elements one program handles. Interpreter cost grows with program count, GPU cost wants
# a few thousand elements in flight per program.
_BLOCK_ELEMS = 4096


def tile_shape(group_size: int) -> int:
    """Groups per program for a power-of-two group size."""
    return max(1, _BLOCK_ELEMS // group_size)


@jit
def group_offsets(gi, n_groups, cols, gpr, G: tl.constexpr, ALIGNED: tl.constexpr):
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


@jit
def _quantize_groups_kernel(x_ptr, codes_ptr, center_ptr, kcode_ptr, sexp_ptr, n_groups, cols, gpr,
                            FMT: tl.constexpr, DRE: tl.constexpr, DRE_KNUM: tl.constexpr,
                            G: tl.constexpr, BG: tl.constexpr, ISA: tl.constexpr):
    gi = tl.program_id(0) * BG + tl.arange(0, BG)
    offs, valid = group_offsets(gi, n_groups, cols, gpr, G, False)
    x = tl.load(x_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    codes, center, kcode, sexp = quantize_tile(x, FMT, DRE, DRE_KNUM, ISA)
    tl.store(codes_ptr + offs, codes, mask=valid)
    gmask = gi < n_groups
    tl.store(center_ptr + gi, center, mask=gmask)
    tl.store(kcode_ptr + gi, kcode, mask=gmask)
    tl.store(sexp_ptr + gi, sexp, mask=gmask)


@jit
def _dequantize_groups_kernel(codes_ptr, center_ptr, kcode_ptr, sexp_ptr, out_ptr, n_groups, cols, gpr,
                              FMT: tl.constexpr, G: tl.constexpr, BG: tl.constexpr, ISA: tl.constexpr):
    gi = tl.program_id(0) * BG + tl.arange(0, BG)
    offs, valid = group_offsets(gi, n_groups, cols, gpr, G, False)
    gmask = gi < n_groups
    codes = tl.load(codes_ptr + offs, mask=valid, other=0)
    center = tl.load(center_ptr + gi, mask=gmask, other=1.0)
    kcode = tl.load(kcode_ptr + gi, mask=gmask, other=16)
    sexp = tl.load(sexp_ptr + gi, mask=gmask, other=0)
    x = dequantize_tile(codes, center, kcode, sexp, FMT, ISA)
    tl.store(out_ptr + offs, x.to(out_ptr.dtype.element_ty), mask=valid)


def quantize_groups_triton(x: Tensor, group_size: int = 128, fmt="e4m3", dre: bool = True) -> QuantizedGroups:
    """`quantize_groups` by the Triton kernel; `x` contiguous, any float dtype."""
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


def dequantize_groups_triton(qg: QuantizedGroups, group_size: int = 128, fmt="e4m3",
                             dtype: torch.dtype = torch.float32) -> Tensor:
    """`dequantize_groups` by the Triton kernel."""
    f = get_format(fmt)
    lay = group_layout(qg.codes.shape, group_size)
    out = torch.empty(qg.codes.shape, dtype=dtype, device=qg.codes.device)
    if lay.num_groups:
        bg = tile_shape(group_size)
        _dequantize_groups_kernel[(triton.cdiv(lay.num_groups, bg),)](
            qg.codes.contiguous(), qg.center, qg.kcode, qg.sexp, out, lay.num_groups, lay.cols,
            lay.groups_per_row, FMT=f.id, G=group_size, BG=bg, ISA=kernel_isa(out.device))
    return out


# ---- The custom ops and the registry's kernels ---------------------------------------------


def _quantize_op(k, x: Tensor, group_size: int, fmt: str, dre: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return tuple(k.quantize(x, group_size, fmt, dre))


def _quantize_fake(x, group_size, fmt, dre):
    meta = group_layout(x.shape, group_size).meta_shape
    return (x.new_empty(x.shape, dtype=torch.uint8), x.new_empty(meta, dtype=torch.float32),
            x.new_empty(meta, dtype=torch.uint8), x.new_empty(meta, dtype=torch.int8))


def _dequantize_op(k, codes: Tensor, center: Tensor, kcode: Tensor, sexp: Tensor, group_size: int, fmt: str,
                   dtype: torch.dtype) -> Tensor:
    return k.dequantize(QuantizedGroups(codes, center, kcode, sexp), group_size, fmt, dtype)


define("quantize_groups", __name__, _quantize_op, _quantize_fake)
define("dequantize_groups", __name__, _dequantize_op, decoded_fake)


class GroupCodec(NamedTuple):
    """`quantize(x, group_size, fmt, dre) -> QuantizedGroups`, `dequantize(qg, group_size,
    fmt, dtype) -> Tensor`."""

    quantize: Callable
    dequantize: Callable


TORCH = GroupCodec(quantize_groups, dequantize_groups)
TRITON = GroupCodec(quantize_groups_triton, dequantize_groups_triton)
