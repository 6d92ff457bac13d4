"""FP8 in Triton: device functions that every kernel shares (encode, decode, rounding, group
(de)quantization); fp8_torch.py holds what the torch twins share.

Every function takes a constexpr ISA (see fp8.py) saying what the compiled code may use:
- ISA_NVIDIA_FP8 (2, compute capability 8.9+): the hardware's saturating round-to-nearest-
  even FP8 conversions, and log2/exp2/rcp from the special-function unit (a precise log2
  is many instructions and made the optimizer step compute-bound);
- ISA_NVIDIA (1, older NVIDIA GPUs, or forced): the same special functions, FP8 coded in
  integer bit operations. Those round exactly like the hardware conversion, so codes are
  bit-identical to ISA 2's (tests/test_kernel_paths.py checks it on a GPU);
- ISA_GENERIC (0, the interpreter and ROCm): no inline PTX at all; precise log2/exp2 and
  the integer FP8 coding (the interpreter's own FP8 casts mis-round: ties away from even,
  subnormals truncated).
Formats are constexpr ints: 0 = E4M3, 1 = E5M2. Defined with jit.py's deferred `jit`.
"""
from __future__ import annotations

from .jit import jit

triton = tl = None  # jit.bind sets them when a Triton backend is chosen


@jit
def fmt_max(FMT: tl.constexpr):
    if FMT == 0:
        return 448.0
    else:
        return 57344.0


@jit
def fmt_min_subnormal(FMT: tl.constexpr):
    if FMT == 0:
        return 0.001953125
    else:
        return 1.52587890625e-05


@jit
def _sfu(x, ASM: tl.constexpr):
    # The .ftz forms are one special-function instruction; without .ftz ptxas wraps each in
    # subnormal range fix-ups. Callers treat subnormal magnitudes as zero on the GPU.
    return tl.inline_asm_elementwise(ASM, "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)


@jit
def log2(x, ISA: tl.constexpr):
    if ISA >= 1:
        return _sfu(x, "lg2.approx.ftz.f32 $0, $1;")
    else:
        return tl.log2(x)


@jit
def exp2(x, ISA: tl.constexpr):
    if ISA >= 1:
        return _sfu(x, "ex2.approx.ftz.f32 $0, $1;")
    else:
        return tl.exp2(x)


@jit
def rcp(x, ISA: tl.constexpr):
    if ISA >= 1:
        return _sfu(x, "rcp.approx.ftz.f32 $0, $1;")
    else:
        return 1.0 / x


@jit
def encode_fp8(x, FMT: tl.constexpr, ISA: tl.constexpr):
    """float32 -> uint8 FP8 code, round to nearest even, saturating at the format's max."""
    if ISA == 2:
        # The hardware's saturating conversion, four floats to four codes per instruction
        # pair. (Triton's own `.to(tl.float8e4nv)` returned wrong codes here on a GPU.)
        if FMT == 0:
            return tl.inline_asm_elementwise(
                "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; "
                "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; mov.b32 $0, {lo, hi}; }",
                "=r,r,r,r,r", [x], dtype=tl.uint8, is_pure=True, pack=4)
        else:
            return tl.inline_asm_elementwise(
                "{ .reg .b16 lo, hi; cvt.rn.satfinite.e5m2x2.f32 lo, $2, $1; "
                "cvt.rn.satfinite.e5m2x2.f32 hi, $4, $3; mov.b32 $0, {lo, hi}; }",
                "=r,r,r,r,r", [x], dtype=tl.uint8, is_pure=True, pack=4)
    return _encode_fp8_bits(x, FMT)


@jit
def decode_fp8(code, FMT: tl.constexpr, ISA: tl.constexpr):
    """uint8 FP8 code -> float32 (no NaN/inf codes are ever written)."""
    if ISA == 2:
        if FMT == 0:
            return code.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            return code.to(tl.float8e5, bitcast=True).to(tl.float32)
    return _decode_fp8_bits(code, FMT)


@jit
def _encode_fp8_bits(x, FMT: tl.constexpr):
    if FMT == 0:
        MB: tl.constexpr = 3
        BIAS: tl.constexpr = 7
        MIN_NORMAL: tl.constexpr = 0.015625
        SUB_SCALE: tl.constexpr = 512.0
        CODE_MAX: tl.constexpr = 0x7E
    else:
        MB: tl.constexpr = 2
        BIAS: tl.constexpr = 15
        MIN_NORMAL: tl.constexpr = 6.103515625e-05
        SUB_SCALE: tl.constexpr = 65536.0
        CODE_MAX: tl.constexpr = 0x7B
    SHIFT: tl.constexpr = 23 - MB
    a = tl.abs(x)
    bits = a.to(tl.int32, bitcast=True)
    rounded = bits + ((1 << (SHIFT - 1)) - 1) + ((bits >> SHIFT) & 1)
    normal = tl.minimum((rounded >> SHIFT) - ((127 - BIAS) << MB), CODE_MAX)
    # Adding then removing 2**23 rounds a float in [0, 2**22) to an integer, ties to even.
    sub = ((tl.minimum(a, MIN_NORMAL) * SUB_SCALE + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(a < MIN_NORMAL, sub, normal)
    code = code | ((x.to(tl.int32, bitcast=True) >> 24) & 0x80)  # sign bit, -0.0 too
    return code.to(tl.uint8)


@jit
def _decode_fp8_bits(code, FMT: tl.constexpr):
    if FMT == 0:
        MB: tl.constexpr = 3
        BIAS: tl.constexpr = 7
        SUB_UNIT: tl.constexpr = 0.001953125
    else:
        MB: tl.constexpr = 2
        BIAS: tl.constexpr = 15
        SUB_UNIT: tl.constexpr = 1.52587890625e-05
    c = code.to(tl.int32)
    mag = c & 0x7F
    e = mag >> MB
    man = mag & ((1 << MB) - 1)
    normal = (((e + (127 - BIAS)) << 23) | (man << (23 - MB))).to(tl.float32, bitcast=True)
    val = tl.where(e == 0, man.to(tl.float32) * SUB_UNIT, normal)
    # The sign goes in as a bit: compiled for a GPU, Triton's `-val` is `0 - val`, which turns
    # code 0x80 into +0.0 where the hardware conversion (and torch) give -0.0.
    return (val.to(tl.int32, bitcast=True) | ((c & 0x80) << 24)).to(tl.float32, bitcast=True)


@jit
def finite_abs(x):
    """|x|, non-finite values as 0 (NaN compares false too): what a max that sets a scale
    reads."""
    a = tl.abs(x)
    return tl.where(a < float("inf"), a, 0.0)


@jit
def round_to_bf16(x):
    """float32 rounded to the nearest bfloat16 value (ties to even), still as float32.

    The interpreter truncates in `.to(tl.bfloat16)`; after this the cast is exact. A NaN
    stays NaN (one with only low mantissa bits would otherwise round to inf)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(x == x, bits.to(tl.float32, bitcast=True), x)


@jit
def round_to(x, dtype: tl.constexpr):
    """float32 `x` rounded to `dtype` (bfloat16, float16 or float32; nearest, ties to even),
    still as float32: what storing it in `dtype` keeps, so later math sees the stored value."""
    if dtype == tl.bfloat16:
        return round_to_bf16(x)
    elif dtype == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@jit
def pow2(e):
    """Exact 2**e (float32) for int32 e in [-126, 127]."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@jit
def scale_exponent(ymax, FMT: tl.constexpr):
    """Exact ceil(log2(ymax / max)) for positive normal ymax, from its bits: both formats'
    max is 1.75 * 2**E, so it is ymax's exponent - E, plus one when its mantissa > 1.75."""
    if FMT == 0:
        E: tl.constexpr = 8
    else:
        E: tl.constexpr = 15
    bits = ymax.to(tl.int32, bitcast=True)
    return ((bits >> 23) & 0xFF) - (127 + E) + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)


@jit
def quantize_tile(x, FMT: tl.constexpr, DRE: tl.constexpr, DRE_KNUM: tl.constexpr, ISA: tl.constexpr):
    """Quantize a [groups, G] float32 tile, one group per row; masked lanes must hold 0.

    Returns (codes uint8, center f32, kcode uint8, sexp int8); see group_codec.quantize_groups.
    Per-group values come from the row's max and min: the largest y is the image of the
    largest |x| under the same formula, so it needs no second reduction. On NVIDIA GPUs
    (ISA >= 1) subnormal magnitudes count as zero (the special-function log2 flushes them),
    so a group's min is clamped to the smallest normal and a group of only subnormals is a
    zero group."""
    a = tl.abs(x)
    amax = tl.max(a, axis=1)
    amin = tl.min(tl.where(a > 0, a, float("inf")), axis=1)
    if ISA >= 1:
        nonzero = amax >= 1.1754943508222875e-38
        amin = tl.maximum(amin, 1.1754943508222875e-38)
    else:
        nonzero = amax > 0
    lmax = log2(amax, ISA)
    if DRE:
        log2r = lmax - log2(amin, ISA)
        kf = tl.floor(DRE_KNUM * rcp(log2r, ISA))
        kf = tl.where(log2r > 0, kf, 128.0)
        kf = tl.minimum(tl.maximum(kf, 4.0), 128.0)  # fp8.K_MIN_CODE, K_MAX_CODE
        center = tl.where(amax == amin, amax, tl.sqrt(amax) * tl.sqrt(amin))
    else:
        kf = tl.full(amax.shape, 16.0, tl.float32)
        center = amax
    kf = tl.where(nonzero, kf, 16.0)
    center = tl.where(nonzero, center, 1.0)
    lc = log2(center, ISA)
    k = kf * 0.0625
    if ISA >= 1:
        # log2(0) = -inf and exp2(-inf) = 0: zeros need no select here.
        y = exp2(k[:, None] * (log2(a, ISA) - lc[:, None]), ISA)
    else:
        y = tl.where(a > 0, exp2(k[:, None] * (log2(a, ISA) - lc[:, None]), ISA), 0.0)
    ymax = tl.where(nonzero, exp2(k * (lmax - lc), ISA), 1.0)
    sexp = tl.where(nonzero, scale_exponent(ymax, FMT), 0)
    q = y * pow2(-sexp)[:, None]
    if ISA != 2:
        q = tl.minimum(q, fmt_max(FMT))  # the hardware conversion saturates by itself
    if DRE:
        # Below the format's range (a group wider than range / k): the smallest code, not 0.
        q = tl.where((a > 0) & nonzero[:, None], tl.maximum(q, fmt_min_subnormal(FMT)), q)
    q = tl.where(x < 0, -q, q)
    return encode_fp8(q, FMT, ISA), center, kf.to(tl.uint8), sexp.to(tl.int8)


@jit
def dequantize_tile(codes, center, kcode, sexp, FMT: tl.constexpr, ISA: tl.constexpr):
    """Inverse of quantize_tile on a [groups, G] tile of codes.

    |x| = 2 ** (log2(|q| * 2**e) / k + log2(c)): summing logs cannot overflow where a
    product of y ** (1/k) and c could; y == 1 (a constant group) returns c itself, exactly."""
    q = decode_fp8(codes, FMT, ISA)
    y = tl.abs(q) * pow2(sexp.to(tl.int32))[:, None]
    t = log2(y, ISA) * (16.0 * rcp(kcode.to(tl.float32), ISA))[:, None]
    a = tl.where(t == 0.0, center[:, None], exp2(t + log2(center, ISA)[:, None], ISA))
    a = tl.minimum(a, 3.4028234663852886e38)
    return tl.where(q < 0, -a, a)
