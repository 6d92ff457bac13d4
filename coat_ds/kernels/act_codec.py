"""The FP8 codec of saved activations (registry op "act_codec"; custom ops
`act_quantize_tensor`, `act_dequantize_tensor`, `act_quantize_rows`, `act_dequantize_rows`):
the one definition of what the eager hooks and compiled graphs store, in torch ops, and its
Triton kernels, which compute the same codes and exponents bit for bit.

Compiled graphs trace the torch functions (activation/traced.py; Inductor fuses each into
the kernels that produce and read the tensor). A fused kernel quantizing a saved tensor is
bound by instructions per element on a GPU, not by memory: non-finite handling by selects on
the codes made a compiled step measurably slower (docs/benchmarks.md). So the guarantees are
kept with codes the cast itself produces:

* the scale is a power of two 2**e putting the finite max in [0.8125, 1.625) * 2**E (the
  format's max is 1.75 * 2**E), so no finite value rounds to the top code. Normal values
  keep exactly the codes' relative precision; only the subnormal threshold moves (< 8%);
* the top code (+-448 E4M3, +-57344 E5M2) therefore stands for +-inf: an inf is cast as
  +-max (as the hardware's saturating conversion does). A NaN is cast as it is and comes
  back as NaN (the formats' own NaN codes);
* the max is an integer max over the float bits of |x| (they order like |x|), non-finite
  values counted as 0: no NaN checks in the reduction;
* per group, groups are G consecutive elements of the contiguous tensor, the last one padded
  with zeros: a group may span two rows. (Padding each row instead miscompiles on Inductor's
  CPU backend: the last group of every row read back as zeros.) Per tensor, one group.

Zeros keep their sign, all-zero groups stay zero, finite values never come back as inf
(decoding clamps to the output dtype's range). Codes and exponents live from a forward to
its backward only: no checkpoint holds them.

The kernels store scales as exponents, one int32 per tensor, one int8 per group: exact both
ways, and 1/16 byte per element at G = 16. Each operation is one launch (a saved tensor's
cost is its launches on the host) except per-tensor quantization: a first kernel folds each
block's max into one int32 with `atomic_max` (non-negative float bits order like the float,
NaN above inf), which the quantizer reads back from device memory: no host sync. Offsets in
a program are int32 from an int64 block base; a program's groups are one contiguous run of
its block (16-byte loads whatever the shape). Non-finite values cost work only where they
occur: a program (per tensor, the max kernel) reduces the bits of |x|, and where all are
finite takes the plain path, a scale and a cast; else its max is over the finite values,
and a NaN's code is set where the software conversion saturated it.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .custom_ops import decoded_fake, define
from .fp8 import Fp8Format, get_format, tensor_isa
from .fp8_torch import exponent_from_bits, pow2
from .fp8_triton import decode_fp8 as decode_fp8_tl, encode_fp8 as encode_fp8_tl, pow2 as pow2_tl
from .jit import constexpr, jit, launch

__all__ = ["scale_exponent", "num_groups", "quantize_groups", "dequantize_groups", "quantize_tensor",
           "dequantize_tensor", "BLOCK_ELEMS", "ActCodec", "TORCH", "TRITON"]

triton = tl = None  # jit.bind sets them when a Triton backend is chosen

# ---- The torch definition -----------------------------------------------------------------

_ABS_MASK, _INF_BITS = 0x7FFFFFFF, 0x7F800000
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


# ---- The Triton kernels -------------------------------------------------------------------

# Elements per program: a few thousand keeps enough bytes in flight per program on a GPU
# (4 warps, 32 elements per thread: 16-byte loads of BF16) and few programs under the
# interpreter, whose cost is per program instance.
BLOCK_ELEMS = 4096
_NUM_WARPS = 4

_OUT_MAX: dict = {}


def _out_max(dtype: torch.dtype) -> float:
    """torch.finfo(dtype).max, kept: finfo is slow on the host, and this runs per dequantized tensor."""
    m = _OUT_MAX.get(dtype)
    return m if m is not None else _OUT_MAX.setdefault(dtype, torch.finfo(dtype).max)


_TL_INF_BITS, _TL_NAN_CODE = constexpr(_INF_BITS), constexpr(0x7F)  # +inf's bits, a NaN code of both formats


@jit
def _abs_bits(x):
    """The int32 bits of float32 |x|: one integer max tells whether all are finite."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@jit
def _finite_max(ab, axis: tl.constexpr):
    """Max of the |x| bits `ab` over the finite values (non-finite counted as 0)."""
    return tl.max(tl.where(ab < _TL_INF_BITS, ab, 0), axis=axis)


@jit
def _scale_exponent(amax_bits, FMT: tl.constexpr):
    """act_codec.scale_exponent: smallest e with amax * 2**-e < 1.625 * 2**E, clamped to
    [-126, 126], from the bits of a finite amax (the format's max is 1.75 * 2**E)."""
    if FMT == 0:
        E: tl.constexpr = 8
    else:
        E: tl.constexpr = 15
    e = ((amax_bits >> 23) & 0xFF) - (127 + E) + ((amax_bits & 0x7FFFFF) >= 0x500000).to(tl.int32)
    return tl.minimum(tl.maximum(e, -126), 126)


@jit
def _encode_non_finite(x, e, FMT: tl.constexpr, ISA: tl.constexpr):
    """Codes of float32 `x` holding inf or NaN, scaled by 2**-e (e broadcastable to x)."""
    c = encode_fp8_tl(x * pow2_tl(-e), FMT, ISA)
    if ISA != 2:
        c = tl.where(x != x, _TL_NAN_CODE, c).to(tl.uint8)  # the software conversion saturates NaN
    return c


@jit
def _decode_tl(c, e, out_max, FMT: tl.constexpr, ISA: tl.constexpr):
    """`_decode`: 2**e times the code's value in the output dtype's finite range; the top
    code is +-inf, the NaN codes NaN."""
    d = decode_fp8_tl(c, FMT, ISA)
    x = tl.minimum(tl.maximum(d * pow2_tl(e), -out_max), out_max)
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


@jit
def _absmax_kernel(x_ptr, amax_bits_ptr, n, BLOCK: tl.constexpr):
    """Folds its block into [max finite |x|, -, max |x| of blocks holding a non-finite value]
    (int32 bits): the quantizer's scale, and whether all its programs take the plain path."""
    base = tl.program_id(0).to(tl.int64) * BLOCK
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + base + offs, mask=offs < n - base, other=0.0).to(tl.float32)
    ab = _abs_bits(x)
    block_max = tl.max(ab, axis=0)
    if block_max < _TL_INF_BITS:
        tl.atomic_max(amax_bits_ptr, block_max)
    else:
        tl.atomic_max(amax_bits_ptr, _finite_max(ab, 0))
        tl.atomic_max(amax_bits_ptr + 2, block_max)


@jit
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
    if tl.load(amax_bits_ptr + 2) < _TL_INF_BITS:
        c = encode_fp8_tl(x * pow2_tl(-e), FMT, ISA)
    else:
        c = _encode_non_finite(x, e, FMT, ISA)
    tl.store(codes_ptr + base + offs, c, mask=mask)


@jit
def _dequantize_tensor_kernel(codes_ptr, exp_ptr, out_ptr, n, out_max, FMT: tl.constexpr, BLOCK: tl.constexpr,
                              ISA: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * BLOCK
    offs = tl.arange(0, BLOCK)
    mask = offs < n - base
    e = tl.load(exp_ptr)
    x = _decode_tl(tl.load(codes_ptr + base + offs, mask=mask, other=0), e, out_max, FMT, ISA)
    tl.store(out_ptr + base + offs, x.to(out_ptr.dtype.element_ty), mask=mask)


@jit
def _group_tile(n, G: tl.constexpr, BG: tl.constexpr):
    """(int64 element base, int32 offsets [BG, G] from it, their mask, the first group's
    index, group offsets [BG] from it, their mask) of this program's BG groups."""
    g0 = tl.program_id(0).to(tl.int64) * BG
    base = g0 * G
    gl = tl.arange(0, BG)
    offs = gl[:, None] * G + tl.arange(0, G)[None, :]
    return base, offs, offs < n - base, g0, gl, gl * G < n - base


@jit
def _quantize_groups_kernel(x_ptr, codes_ptr, exp_ptr, n, FMT: tl.constexpr, G: tl.constexpr,
                            BG: tl.constexpr, ISA: tl.constexpr):
    base, offs, mask, g0, gl, gmask = _group_tile(n, G, BG)
    x = tl.load(x_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    ab = _abs_bits(x)
    gmax = tl.max(ab, axis=1)  # each group's max |x| as bits, if the group is finite
    if tl.max(gmax, axis=0) < _TL_INF_BITS:
        e = _scale_exponent(gmax, FMT)
        c = encode_fp8_tl(x * pow2_tl(-e)[:, None], FMT, ISA)
    else:
        e = _scale_exponent(_finite_max(ab, 1), FMT)
        c = _encode_non_finite(x, e[:, None], FMT, ISA)
    tl.store(codes_ptr + base + offs, c, mask=mask)
    tl.store(exp_ptr + g0 + gl, e.to(tl.int8), mask=gmask)


@jit
def _dequantize_groups_kernel(codes_ptr, exp_ptr, out_ptr, n, out_max, FMT: tl.constexpr,
                              G: tl.constexpr, BG: tl.constexpr, ISA: tl.constexpr):
    base, offs, mask, g0, gl, gmask = _group_tile(n, G, BG)
    e = tl.load(exp_ptr + g0 + gl, mask=gmask, other=0).to(tl.int32)
    x = _decode_tl(tl.load(codes_ptr + base + offs, mask=mask, other=0), e[:, None], out_max, FMT, ISA)
    tl.store(out_ptr + base + offs, x.to(out_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor) -> int:
    """The kernels' ISA constexpr for x's device (see fp8.py). Outputs are then allocated
    with `empty_like` (cheaper on the host than `torch.empty(shape, device=...)`)."""
    if not x.is_contiguous():
        raise ValueError("activation kernels take contiguous tensors")
    return tensor_isa(x)


def quantize_tensor_triton(x: torch.Tensor, fmt="e4m3") -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_tensor` by the Triton kernels."""
    isa = _check(x)
    fmt_id = get_format(fmt).id
    n = x.numel()
    codes = torch.empty_like(x, dtype=torch.uint8)  # contiguous, as x is (_check)
    # [max finite |x|, exponent, max |x|] (the maxima as int32 bits): one buffer, one memset.
    scratch = torch.zeros(3, dtype=torch.int32, device=x.device)
    exp = scratch[1]
    n_prog = max(1, triton.cdiv(n, BLOCK_ELEMS))
    if n:
        launch(_absmax_kernel, n_prog, (x, scratch, n), (BLOCK_ELEMS,), _NUM_WARPS)
    launch(_quantize_tensor_kernel, n_prog, (x, scratch, exp, codes, n), (fmt_id, BLOCK_ELEMS, isa), _NUM_WARPS)
    return codes, exp


def dequantize_tensor_triton(codes: torch.Tensor, exp: torch.Tensor, fmt="e4m3",
                             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`dequantize_tensor` by the Triton kernel."""
    isa = _check(codes)
    out = torch.empty_like(codes, dtype=dtype)
    n = codes.numel()
    if n:
        launch(_dequantize_tensor_kernel, triton.cdiv(n, BLOCK_ELEMS), (codes, exp, out, n, _out_max(dtype)),
               (get_format(fmt).id, BLOCK_ELEMS, isa), _NUM_WARPS)
    return out


def quantize_groups_triton(x: torch.Tensor, group_size: int = 16, fmt="e4m3") -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_groups` by the Triton kernel."""
    isa = _check(x)
    n = x.numel()
    codes = torch.empty_like(x, dtype=torch.uint8)
    exps = x.new_empty((num_groups(n, group_size),), dtype=torch.int8)
    if n:
        bg = max(1, BLOCK_ELEMS // group_size)  # groups per program
        launch(_quantize_groups_kernel, triton.cdiv(n, bg * group_size), (x, codes, exps, n),
               (get_format(fmt).id, group_size, bg, isa), _NUM_WARPS)
    return codes, exps


def dequantize_groups_triton(codes: torch.Tensor, exps: torch.Tensor, group_size: int = 16, fmt="e4m3",
                             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`dequantize_groups` by the Triton kernel."""
    isa = _check(codes)
    out = torch.empty_like(codes, dtype=dtype)
    n = codes.numel()
    if n:
        bg = max(1, BLOCK_ELEMS // group_size)  # groups per program
        launch(_dequantize_groups_kernel, triton.cdiv(n, bg * group_size), (codes, exps, out, n, _out_max(dtype)),
               (get_format(fmt).id, group_size, bg, isa), _NUM_WARPS)
    return out


# ---- The custom ops and the registry's kernels ---------------------------------------------


def _quantize_tensor_op(k, x: Tensor, fmt: str) -> tuple[Tensor, Tensor]:
    return k.quantize_tensor(x, fmt)


def _quantize_tensor_fake(x, fmt):
    return x.new_empty(x.shape, dtype=torch.uint8), x.new_empty((), dtype=torch.int32)


def _dequantize_tensor_op(k, codes: Tensor, exp: Tensor, fmt: str, dtype: torch.dtype) -> Tensor:
    return k.dequantize_tensor(codes, exp, fmt, dtype)


def _quantize_rows_op(k, x: Tensor, group_size: int, fmt: str) -> tuple[Tensor, Tensor]:
    return k.quantize_rows(x, group_size, fmt)


def _quantize_rows_fake(x, group_size, fmt):
    return x.new_empty(x.shape, dtype=torch.uint8), x.new_empty((num_groups(x.numel(), group_size),), dtype=torch.int8)


def _dequantize_rows_op(k, codes: Tensor, exps: Tensor, group_size: int, fmt: str, dtype: torch.dtype) -> Tensor:
    return k.dequantize_rows(codes, exps, group_size, fmt, dtype)


define("act_quantize_tensor", __name__, _quantize_tensor_op, _quantize_tensor_fake)
define("act_dequantize_tensor", __name__, _dequantize_tensor_op, decoded_fake)
define("act_quantize_rows", __name__, _quantize_rows_op, _quantize_rows_fake)
define("act_dequantize_rows", __name__, _dequantize_rows_op, decoded_fake)


class ActCodec(NamedTuple):
    """The codec per tensor and per group of G consecutive elements ("rows"), as the ops."""

    quantize_tensor: Callable
    dequantize_tensor: Callable
    quantize_rows: Callable
    dequantize_rows: Callable


TORCH = ActCodec(quantize_tensor, dequantize_tensor, quantize_groups, dequantize_groups)
TRITON = ActCodec(quantize_tensor_triton, dequantize_tensor_triton, quantize_groups_triton, dequantize_groups_triton)
