// FP8 coding and the per-element math of the host AdamW step (host_adamw.cpp, its only
// includer): format constants, the integer encode, the decode table of log2 magnitudes and
// the log2/exp2 polynomials used to encode. Header-only and in an unnamed namespace: the
// step is one translation unit. host_native.py hashes this file with the .cpp, so an edit
// here rebuilds the library.
#pragma once

#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr float kFloatMax = std::numeric_limits<float>::max();

inline uint32_t bits_of(float x) { uint32_t b; std::memcpy(&b, &x, 4); return b; }
inline float float_of(uint32_t b) { float x; std::memcpy(&x, &b, 4); return x; }
// 2**e for e in [-126, 127]; the reference's pow2 bits elsewhere (0 at -127, inf at 128).
inline float pow2i(int32_t e) { return float_of(static_cast<uint32_t>(e + 127) << 23); }

// Per-element log2 and exp2 for encoding, our own polynomials (fit once, near-minimax on
// their ranges), evaluated with explicit fused multiply-adds: the reference's ops are not
// mirrored here, only its values to ~1 ulp. Branch-free so that the loops vectorize.

// 2**x * 2**e for finite |x| < 2**22 and integer e: 2**(n + e) * p(x - n), n = round(x), p a
// degree-6 fit to 2**r on [-1/2, 1/2] (relative error 2e-9; p(0) = 1, so integer x is exact).
// The reference scales exp2's float result by 2**e exactly, which is this where both are
// normal; n + e is clamped to [-127, 128]: 0 below (the reference's would be under 2**-126,
// below any FP8 code), inf above.
inline float exp2_scaled(float x, int32_t e) {
  const float n = (x + 12582912.0f) - 12582912.0f;  // 1.5 * 2**23: rounds |x| < 2**22 to an integer
  const float r = x - n;
  float p = std::fma(1.535336e-04f, r, 1.3398875e-03f);
  p = std::fma(p, r, 9.618437e-03f);
  p = std::fma(p, r, 5.5503324e-02f);
  p = std::fma(p, r, 2.4022648e-01f);
  p = std::fma(p, r, 6.931472e-01f);
  p = std::fma(p, r, 1.0f);
  const int32_t ne = std::min(std::max(static_cast<int32_t>(n) + e, -127), 128);
  return p * pow2i(ne);
}

// log2(a) for finite a > 0 (subnormals too): e + log2(m) with m in [sqrt(1/2), sqrt(2)),
// log2(m) an odd polynomial in s = (m - 1) / (m + 1) fit on that range (absolute error
// 2e-10, ~1 ulp after float rounding; exact 0 at a = 1).
inline float log2_poly(float a) {
  // Selects of constants, not of results: GCC would sink a selected product or conversion
  // into a branch it may not if-convert (it could trap), and the loop would not vectorize.
  const bool sub = a < 1.17549435e-38f;
  const uint32_t b = bits_of(a * (sub ? 16777216.0f : 1.0f));
  const int32_t e = static_cast<int32_t>(b - 0x3F3504F3u) >> 23;  // 0x3F3504F3: sqrt(1/2)
  const float m = float_of(b - (static_cast<uint32_t>(e) << 23));
  const float s = (m - 1.0f) / (m + 1.0f), z = s * s;
  const float p = s * std::fma(z, std::fma(z, std::fma(z, 0.434255928f, 0.576584518f), 0.961800754f), 2.88539004f);
  return (static_cast<float>(e) - (sub ? 24.0f : 0.0f)) + p;
}

// FP8 formats as compile-time constants (0 = E4M3, 1 = E5M2, as the reference's Fp8Format.id),
// so the code loops vectorize with constant shifts.
template <int FMT> struct Fp8;
template <> struct Fp8<0> {
  static constexpr int mb = 3, bias = 7, code_max = 0x7E, log2_max = 8;
  static constexpr float max = 448.0f, min_sub = 0.001953125f, min_normal = 0.015625f, sub_scale = 512.0f;
};
template <> struct Fp8<1> {
  static constexpr int mb = 2, bias = 15, code_max = 0x7B, log2_max = 15;
  static constexpr float max = 57344.0f, min_sub = 1.52587890625e-05f, min_normal = 6.103515625e-05f,
                         sub_scale = 65536.0f;
};

// |value| of a 7-bit FP8 magnitude code, in double (no NaN/inf codes are ever written).
template <int FMT> double magnitude(int c) {
  using F = Fp8<FMT>;
  const int e = c >> F::mb, man = c & ((1 << F::mb) - 1);
  return e == 0 ? man * static_cast<double>(F::min_sub)
                : std::ldexp(1.0 + man / static_cast<double>(1 << F::mb), e - F::bias);
}

// log2(|q| * 2**e) for every 7-bit magnitude code q and every int8 scale exponent e (row
// e + 128), in float as the reference computes it: the product rounded to float (the
// reference's pow2 bits, so e = -128 and -127 give what it gives), then its log2 correctly
// rounded, which is what torch.log2 (SLEEF) returns for every such product (checked for all
// normal ones). Decoding reads its log2 here instead of computing it, bit for bit the same.
template <int FMT> const float* log2_rows() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256 * 128);
    for (int e = -128; e < 128; ++e) {
      const float scale = pow2i(e);
      for (int c = 0; c < 128; ++c) {
        const float y = static_cast<float>(magnitude<FMT>(c)) * scale;
        t[(e + 128) * 128 + c] = static_cast<float>(std::log2(static_cast<double>(y)));
      }
    }
    return t;
  }();
  return table.data();
}

// Saturating round-to-nearest-even code of a magnitude 0 <= a <= max, in integer operations
// (the same as kernels/fp8_triton.py's software encode).
template <int FMT> inline uint32_t encode_mag(float a) {
  using F = Fp8<FMT>;
  constexpr int shift = 23 - F::mb;
  const int32_t ab = static_cast<int32_t>(bits_of(a));
  const int32_t rounded = ab + ((1 << (shift - 1)) - 1) + ((ab >> shift) & 1);
  const int32_t normal = std::min((rounded >> shift) - ((127 - F::bias) << F::mb), F::code_max);
  const int32_t sub = static_cast<int32_t>((std::min(a, F::min_normal) * F::sub_scale + 8388608.0f) - 8388608.0f);
  return static_cast<uint32_t>(a < F::min_normal ? sub : normal);
}

// fp8_torch.scale_exponent: ceil(log2(ymax / max)) from ymax's bits.
template <int FMT> int32_t scale_exponent(float ymax) {
  uint32_t b = bits_of(ymax);
  return static_cast<int32_t>((b >> 23) & 0xFF) - (127 + Fp8<FMT>::log2_max) + ((b & 0x7FFFFF) > 0x600000 ? 1 : 0);
}

#if defined(CPU_CAPABILITY_AVX512)
// A 128-float table row held in eight registers: a lookup is four two-register permutes and
// three blends (by bits 5 and 6 of the index), where a gather took ~40 % of decoding.
struct Row128 {
  __m512 t[8];
  explicit Row128(const float* row) {
    for (int r = 0; r < 8; ++r) t[r] = _mm512_loadu_ps(row + 16 * r);
  }
  // row[codes[l] & 0x7F] for the first cnt codes (the rest: row[0]).
  Vec lookup(const uint8_t* codes, int64_t cnt) const {
    const __mmask16 live = static_cast<__mmask16>((1u << cnt) - 1u);
    const __m512i c = _mm512_and_si512(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(live, codes)), _mm512_set1_epi32(0x7F));
    const __mmask16 b5 = _mm512_test_epi32_mask(c, _mm512_set1_epi32(32));
    const __mmask16 b6 = _mm512_test_epi32_mask(c, _mm512_set1_epi32(64));
    const __m512 lo = _mm512_mask_blend_ps(b5, _mm512_permutex2var_ps(t[0], c, t[1]), _mm512_permutex2var_ps(t[2], c, t[3]));
    const __m512 hi = _mm512_mask_blend_ps(b5, _mm512_permutex2var_ps(t[4], c, t[5]), _mm512_permutex2var_ps(t[6], c, t[7]));
    return Vec(_mm512_mask_blend_ps(b6, lo, hi));
  }
};
#else
// Elsewhere a gather from the row (idx: 16 ints of scratch).
struct Row128 {
  const float* row;
  explicit Row128(const float* r) : row(r) {}
  Vec lookup(const uint8_t* codes, int64_t cnt) const {
    int32_t idx[Vec::size()] = {};
    for (int64_t l = 0; l < cnt; ++l) idx[l] = codes[l] & 0x7F;
    return at::vec::gather<sizeof(float)>(row, at::vec::Vectorized<int32_t>::loadu(idx));
  }
};
#endif

}  // namespace
