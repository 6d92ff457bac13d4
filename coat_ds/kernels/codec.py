"""Triton device functions shared by every kernel: FP8 encode/decode and group (de)quantization.

FP8 casts are done with integer bit operations rather than `x.to(tl.float8e4nv)`: Triton's
interpreter mis-rounds that cast (ties away from even, subnormals truncated), and the bit
version rounds to nearest even exactly like the hardware and torch, so the code path tested
on CPU is the one that runs on the GPU. Formats are passed as constexpr ints: 0 = E4M3, 1 = E5M2.
"""
import triton
import triton.language as tl

@triton.jit
def fmt_max(FMT: tl.constexpr):
    if FMT == 0:
        return 448.0
    else:
        return 57344.0


@triton.jit
def encode_fp8(x, FMT: tl.constexpr):
    """float32 -> uint8 FP8 code, round to nearest even, saturating at the format's max."""
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
    code = code | tl.where(x < 0, 0x80, 0)
    return code.to(tl.uint8)


@triton.jit
def decode_fp8(code, FMT: tl.constexpr):
    """uint8 FP8 code -> float32 (no NaN/inf codes are ever written)."""
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
    return tl.where(c >= 0x80, -val, val)


@triton.jit
def round_to_bf16(x):
    """float32 rounded to the nearest bfloat16 value (ties to even), still as float32.

    The interpreter truncates in `.to(tl.bfloat16)`; after this the cast is exact."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def pow2(e):
    """Exact 2**e (float32) for int32 e in [-126, 127]."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def quantize_tile(x, FMT: tl.constexpr, DRE: tl.constexpr, DRE_KNUM: tl.constexpr):
    """Quantize a [groups, G] float32 tile, one group per row; masked lanes must hold 0.

    Returns (codes uint8, center f32, kcode uint8, sexp int8); see reference.quantize_groups."""
    a = tl.abs(x)
    amax = tl.max(a, axis=1)
    amin = tl.min(tl.where(a > 0, a, float("inf")), axis=1)
    nonzero = amax > 0
    if DRE:
        log2r = tl.log2(amax) - tl.log2(amin)
        kf = tl.floor(DRE_KNUM / log2r)
        kf = tl.where(log2r > 0, kf, 128.0)
        kf = tl.minimum(tl.maximum(kf, 1.0), 128.0)
        center = tl.where(amax == amin, amax, tl.sqrt_rn(amax) * tl.sqrt_rn(amin))
    else:
        kf = tl.full(amax.shape, 16.0, tl.float32)
        center = amax
    kf = tl.where(nonzero, kf, 16.0)
    center = tl.where(nonzero, center, 1.0)
    lc = tl.log2(center)
    k = kf * 0.0625
    y = tl.where(a > 0, tl.exp2(k[:, None] * (tl.log2(a) - lc[:, None])), 0.0)
    ymax = tl.where(nonzero, tl.max(y, axis=1), 1.0)
    tbits = (ymax / fmt_max(FMT)).to(tl.int32, bitcast=True)
    sexp = ((tbits >> 23) & 0xFF) - 127 + ((tbits & 0x7FFFFF) != 0).to(tl.int32)
    sexp = tl.where(nonzero, sexp, 0)
    q = tl.minimum(y * pow2(-sexp)[:, None], fmt_max(FMT))
    q = tl.where(x < 0, -q, q)
    return encode_fp8(q, FMT), center, kf.to(tl.uint8), sexp.to(tl.int8)


@triton.jit
def dequantize_tile(codes, center, kcode, sexp, FMT: tl.constexpr):
    """Inverse of quantize_tile on a [groups, G] tile of codes.

    |x| = 2 ** (log2(|q| * 2**e) / k + log2(c)): summing logs cannot overflow where a
    product of y ** (1/k) and c could; y == 1 (a constant group) returns c itself, exactly."""
    q = decode_fp8(codes, FMT)
    y = tl.abs(q) * pow2(sexp.to(tl.int32))[:, None]
    t = tl.log2(y) * (16.0 / kcode.to(tl.float32))[:, None]
    a = tl.where(t == 0.0, center[:, None], tl.exp2(t + tl.log2(center)[:, None]))
    a = tl.minimum(a, 3.4028234663852886e38)
    return tl.where(q < 0, -a, a)
