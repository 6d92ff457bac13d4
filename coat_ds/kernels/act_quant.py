"""FP8 kernels for saved activations: per-tensor and per-group (1 x G) power-of-two scaling.

Scales are powers of two stored as exponents: one int32 per tensor, one int8 per group of G
elements along the last dim. A power-of-two scale is exact in both directions (no division
in the quantizer, no rounding in the dequantizer), so the Triton kernels and their torch
twins agree bit for bit, and an int8 exponent costs 1/16 byte per element at G = 16 where a
bf16 scale would cost 1/8 (that difference alone would push a Llama block above 0.55x of
BF16). Scaling by a power of two instead of max/448 only leaves the top 0..1 binade of the
FP8 range unused; FP8 precision is relative, so normal values lose nothing.

Launches are what a saved tensor costs on the host, so each operation is one launch except
per-tensor quantization, which needs the whole tensor's max before it can scale: every
program of a first kernel folds its block's max into one int32 with `atomic_max` (the bits
of a non-negative float order like the float, NaN above inf as torch's amax has it), and
the quantizer reads that max back from device memory: two launches and a memset, no host
sync. Offsets inside a program are int32 from an int64 block base: 64-bit arithmetic per
element would cost instructions on the GPU for nothing.

Non-finite values pass through exactly (`reference.ACT_POS_INF` and co. say how): every max
is over the finite values only, so a masked -inf logit cannot turn its group's finite values
into zeros. Their selects are paid only where they are needed: each quantizing program
reduces the int32 bits of |x| (which order like |x|, inf above every finite value and NaN
above inf) (per tensor: the max kernel does, over the whole tensor), and where that is
finite takes the plain path, whose only extra step writes a value rounding to zero as +0
(the -0 code stands for NaN). Blocks (tensors) holding an inf or a NaN take the full path;
both give the same codes as the torch twins.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference
from .act_launch import launch
from .codec import decode_fp8, encode_fp8, fmt_min_subnormal, pow2, scale_exponent
from .fp8 import get_format, tensor_isa

__all__ = ["quantize_tensor", "dequantize_tensor", "quantize_rows", "dequantize_rows", "BLOCK_ELEMS"]

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


@triton.jit
def _scale_exponent(amax, FMT: tl.constexpr):
    """Smallest e with amax * 2**-e <= the format's max, clamped to [-126, 126] so that both
    2**e and 2**-e are normal floats (an all-zero or subnormal group gets e = -126)."""
    return tl.minimum(tl.maximum(scale_exponent(amax, FMT), -126), 126)


_POS_INF = tl.constexpr(reference.ACT_POS_INF)
_NEG_INF = tl.constexpr(reference.ACT_NEG_INF)
_NAN = tl.constexpr(reference.ACT_NAN)
_INF_BITS = tl.constexpr(0x7F800000)  # the bits of +inf: |x|'s bits are below them iff x is finite


@triton.jit
def _abs_bits(x):
    """The int32 bits of float32 |x|: they order like |x|, +inf above every finite value and
    NaN above +inf, so one integer max per block tells whether it is all finite."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _encode_finite(x, e, FMT: tl.constexpr, ISA: tl.constexpr):
    """Codes of float32 `x` scaled by 2**-e (e broadcastable to x), finite values that round
    to zero (the -0 code stands for NaN) as +0; non-finite values get no code of their own."""
    y = x * pow2(-e)
    # |y| <= half the smallest subnormal rounds to zero (the tie goes to the even zero).
    # Settled on the float: on the codes, which the conversion returns four to a register,
    # the same compare and select first unpack them (about twice the instructions).
    y = tl.where(tl.abs(y) <= fmt_min_subnormal(FMT) * 0.5, 0.0, y)
    return encode_fp8(y, FMT, ISA)


@triton.jit
def _encode_act(x, e, FMT: tl.constexpr, ISA: tl.constexpr):
    """Codes of float32 `x` scaled by 2**-e (e broadcastable to x), non-finite values as
    their own codes, finite zeros as +0."""
    c = _encode_finite(x, e, FMT, ISA)
    c = tl.where(x == float("inf"), _POS_INF, c)
    c = tl.where(x == float("-inf"), _NEG_INF, c)
    return tl.where(x != x, _NAN, c).to(tl.uint8)


@triton.jit
def _decode_act(c, e, out_max, FMT: tl.constexpr, ISA: tl.constexpr):
    """Inverse of `_encode_act`, clamped to the output dtype's finite range: rounding up at
    the top of the fp32/fp16 range must not turn a finite input into inf."""
    x = decode_fp8(c, FMT, ISA) * pow2(e)
    x = tl.minimum(tl.maximum(x, -out_max), out_max)
    x = tl.where(c == _POS_INF, float("inf"), x)
    x = tl.where(c == _NEG_INF, float("-inf"), x)
    return tl.where(c == _NAN, float("nan"), x)


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
    # One reduction and one atomic for a finite block, as before non-finite values were
    # handled; the third slot is written only by blocks holding an inf or a NaN.
    if block_max < _INF_BITS:
        tl.atomic_max(amax_bits_ptr, block_max)
    else:
        tl.atomic_max(amax_bits_ptr, tl.max(tl.where(ab < _INF_BITS, ab, 0), axis=0))  # non-finite as 0
        tl.atomic_max(amax_bits_ptr + 2, block_max)


@triton.jit
def _quantize_tensor_kernel(x_ptr, amax_bits_ptr, exp_ptr, codes_ptr, n, FMT: tl.constexpr, BLOCK: tl.constexpr,
                            ISA: tl.constexpr):
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * BLOCK
    offs = tl.arange(0, BLOCK)
    mask = offs < n - base
    x = tl.load(x_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    e = _scale_exponent(tl.load(amax_bits_ptr).to(tl.float32, bitcast=True), FMT)
    if pid == 0:
        tl.store(exp_ptr, e)
    if tl.load(amax_bits_ptr + 2) < _INF_BITS:
        c = _encode_finite(x, e, FMT, ISA)
    else:
        c = _encode_act(x, e, FMT, ISA)
    tl.store(codes_ptr + base + offs, c, mask=mask)


@triton.jit
def _dequantize_tensor_kernel(codes_ptr, exp_ptr, out_ptr, n, out_max, FMT: tl.constexpr, BLOCK: tl.constexpr,
                              ISA: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * BLOCK
    offs = tl.arange(0, BLOCK)
    mask = offs < n - base
    e = tl.load(exp_ptr)
    x = _decode_act(tl.load(codes_ptr + base + offs, mask=mask, other=0), e, out_max, FMT, ISA)
    tl.store(out_ptr + base + offs, x.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _row_group_offsets(g0, n_groups, cols, gpr, G: tl.constexpr, BG: tl.constexpr, EVEN: tl.constexpr):
    """(element offsets [BG, G], validity [BG, G], group indices [BG]) of the BG groups from
    g0 on, as int32 offsets from the element where group g0 starts (the caller adds that
    int64 base). Groups never cross a row: a row whose length is not a multiple of G ends
    in a short group.

    EVEN promises cols % G == 0: the groups are then consecutive runs of G elements, a form
    whose contiguity Triton can see, so loads and stores are 16-byte vectors."""
    lane = tl.arange(0, G)
    gl = tl.arange(0, BG)
    live = gl < n_groups - g0
    if EVEN:
        return gl[:, None] * G + lane[None, :], live[:, None] & (lane < G)[None, :], gl
    # Ragged rows: offsets relative to the start of g0's row, which sits at an int64 base.
    row0 = g0 // gpr
    gr = (g0 - row0 * gpr).to(tl.int32) + gl  # group index counted from row0's first group
    row = gr // gpr
    col = (gr - row * gpr) * G
    valid = live[:, None] & ((col[:, None] + lane[None, :]) < cols)
    return (row * cols + col)[:, None] + lane[None, :], valid, gl


@triton.jit
def _row_base(g0, cols, gpr, G: tl.constexpr, EVEN: tl.constexpr):
    """int64 element offset that `_row_group_offsets`'s offsets are relative to."""
    if EVEN:
        return g0 * G
    return (g0 // gpr) * cols


@triton.jit
def _quantize_rows_kernel(x_ptr, codes_ptr, exp_ptr, n_groups, cols, gpr,
                          FMT: tl.constexpr, G: tl.constexpr, BG: tl.constexpr, EVEN: tl.constexpr,
                          ISA: tl.constexpr):
    g0 = tl.program_id(0).to(tl.int64) * BG
    offs, valid, gl = _row_group_offsets(g0, n_groups, cols, gpr, G, BG, EVEN)
    base = _row_base(g0, cols, gpr, G, EVEN)
    x = tl.load(x_ptr + base + offs, mask=valid, other=0.0).to(tl.float32)
    ab = _abs_bits(x)
    gmax = tl.max(ab, axis=1)  # each group's max |x| as bits, if the group is finite
    if tl.max(gmax, axis=0) < _INF_BITS:
        e = _scale_exponent(gmax.to(tl.float32, bitcast=True), FMT)
        c = _encode_finite(x, e[:, None], FMT, ISA)
    else:
        gmax = tl.max(tl.where(ab < _INF_BITS, ab, 0), axis=1)
        e = _scale_exponent(gmax.to(tl.float32, bitcast=True), FMT)
        c = _encode_act(x, e[:, None], FMT, ISA)
    tl.store(codes_ptr + base + offs, c, mask=valid)
    tl.store(exp_ptr + g0 + gl, e.to(tl.int8), mask=gl < n_groups - g0)


@triton.jit
def _dequantize_rows_kernel(codes_ptr, exp_ptr, out_ptr, n_groups, cols, gpr, out_max,
                            FMT: tl.constexpr, G: tl.constexpr, BG: tl.constexpr, EVEN: tl.constexpr,
                            ISA: tl.constexpr):
    g0 = tl.program_id(0).to(tl.int64) * BG
    offs, valid, gl = _row_group_offsets(g0, n_groups, cols, gpr, G, BG, EVEN)
    base = _row_base(g0, cols, gpr, G, EVEN)
    e = tl.load(exp_ptr + g0 + gl, mask=gl < n_groups - g0, other=0).to(tl.int32)
    x = _decode_act(tl.load(codes_ptr + base + offs, mask=valid, other=0), e[:, None], out_max, FMT, ISA)
    tl.store(out_ptr + base + offs, x.to(out_ptr.dtype.element_ty), mask=valid)


def _check(x: torch.Tensor) -> int:
    """The kernels' ISA constexpr for x's device (see fp8.py). Outputs are then allocated
    with `empty_like` (about half the host time of `torch.empty(shape, device=...)`), which
    gives contiguous tensors for this contiguous x."""
    if not x.is_contiguous():
        raise ValueError("activation kernels take contiguous tensors")
    return tensor_isa(x)


def _rows(shape, numel: int, group_size: int) -> tuple[int, int, int]:
    """(rows, cols, groups per row) of the kernels' (rows, cols) view: see layout.group_layout."""
    cols = shape[-1] if len(shape) else 1
    rows = numel // cols if cols else 0
    return rows, cols, (-(-cols // group_size) if cols else 0)


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


def quantize_rows(x: torch.Tensor, group_size: int = 16, fmt="e4m3") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group FP8 along the last dim: (uint8 codes shaped like x, int8 exponents of shape
    (rows, ceil(cols / G))); a short last group per row is padded with zeros."""
    isa = _check(x)
    rows, cols, gpr = _rows(x.shape, x.numel(), group_size)
    codes = torch.empty_like(x, dtype=torch.uint8)
    exps = x.new_empty((rows, gpr), dtype=torch.int8)
    n_groups = rows * gpr
    if n_groups:
        bg = max(1, BLOCK_ELEMS // group_size)
        launch(_quantize_rows_kernel, triton.cdiv(n_groups, bg), (x, codes, exps, n_groups, cols, gpr),
               (get_format(fmt).id, group_size, bg, cols % group_size == 0, isa), _NUM_WARPS)
    return codes, exps


def dequantize_rows(codes: torch.Tensor, exps: torch.Tensor, group_size: int = 16, fmt="e4m3",
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize_rows`, written in `dtype`."""
    isa = _check(codes)
    rows, cols, gpr = _rows(codes.shape, codes.numel(), group_size)
    out = torch.empty_like(codes, dtype=dtype)
    n_groups = rows * gpr
    if n_groups:
        bg = max(1, BLOCK_ELEMS // group_size)
        launch(_dequantize_rows_kernel, triton.cdiv(n_groups, bg), (codes, exps, out, n_groups, cols, gpr,
                                                                    _out_max(dtype)),
               (get_format(fmt).id, group_size, bg, cols % group_size == 0, isa), _NUM_WARPS)
    return out
