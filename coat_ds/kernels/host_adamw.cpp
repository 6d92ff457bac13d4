// The host AdamW step with FP8 (DRE) or FP32 moments, fused per quantization group: the
// CPU counterpart of kernels/adamw.py, computing what reference.adamw_step (the oracle)
// computes, in the same float32 operations and order. log2/exp2 go through ATen's
// Vectorized<float> (SLEEF, as torch.log2/torch.exp2 do) and sqrt through MKL where torch
// uses it, so results match the reference bit for bit except where torch itself takes a
// scalar libm exp2 (loop tails). Built with -ffp-contract=off: a fused multiply-add would
// round differently from the reference's separate ops.
//
// Plain C ABI, called through ctypes (which releases the GIL): Python passes raw pointers
// of contiguous tensors and a range of groups; each call writes only its own groups, so
// threads given disjoint ranges never write the same bytes. Scalars every group shares come
// in `hyper`; a per-group input (say, bias corrections for groups that skipped steps) is one
// more pointer read at `gi`, next to the centre and exponents.
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

// torch.sqrt on CPU is MKL's vmsSqrt in high-accuracy mode where torch has MKL (not
// correctly rounded, so std::sqrt differs in the last bit). libtorch_cpu exports it; weak,
// so that without MKL the symbol is null and the exact sqrt runs, as torch's would.
extern "C" void vmsSqrt(int n, const float* a, float* r, long long mode) __attribute__((weak));
// Each host thread runs its own groups: MKL must not open an OpenMP team per call (two
// threads doing so spun in libgomp and took 5x longer than one thread). The C entry point
// (mkl_service.h maps mkl_set_num_threads_local to it; that name is the Fortran one).
extern "C" int MKL_Set_Num_Threads_Local(int n) __attribute__((weak));

namespace {

// VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE, the mode ATen's vml.h passes.
constexpr long long kVmlMode = 0x2 | 0x140000 | 0x100;

using Vec = at::vec::Vectorized<float>;
constexpr float kFloatMax = std::numeric_limits<float>::max();

inline uint32_t bits_of(float x) { uint32_t b; std::memcpy(&b, &x, 4); return b; }
inline float float_of(uint32_t b) { float x; std::memcpy(&x, &b, 4); return x; }
inline float pow2i(int32_t e) { return float_of(static_cast<uint32_t>(e + 127) << 23); }

void vlog2(float* x, int64_t n) {
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) Vec::loadu(x + i).log2().store(x + i);
  if (i < n) Vec::loadu(x + i, n - i).log2().store(x + i, n - i);
}

void vexp2(float* x, int64_t n) {
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) Vec::loadu(x + i).exp2().store(x + i);
  if (i < n) Vec::loadu(x + i, n - i).exp2().store(x + i, n - i);
}

void vsqrt(float* x, int64_t n) {
  if (vmsSqrt != nullptr) {
    vmsSqrt(static_cast<int>(n), x, x, kVmlMode);
    return;
  }
  for (int64_t i = 0; i < n; ++i) x[i] = std::sqrt(x[i]);
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

// FP8 code -> float32 in integer operations (no NaN/inf codes are ever written).
template <int FMT> void decode(const uint8_t* __restrict codes, float* __restrict out, int64_t n) {
  using F = Fp8<FMT>;
  for (int64_t i = 0; i < n; ++i) {
    // Branch-free (selects by mask) so that the loop vectorizes.
    uint32_t c = codes[i], mag = c & 0x7F, e = mag >> F::mb, man = mag & ((1u << F::mb) - 1);
    uint32_t normal = ((e + 127 - F::bias) << 23) | (man << (23 - F::mb));
    uint32_t sub = bits_of(static_cast<float>(man) * F::min_sub);
    uint32_t is_normal = 0u - static_cast<uint32_t>(e != 0);
    out[i] = float_of((normal & is_normal) | (sub & ~is_normal) | ((c & 0x80) << 24));
  }
}

// Saturating round-to-nearest-even encode of |x| <= max, sign bit copied from x (-0.0 too),
// in integer operations (the same as kernels/codec.py's software encode).
template <int FMT> void encode(const float* __restrict x, uint8_t* __restrict out, int64_t n) {
  using F = Fp8<FMT>;
  constexpr int shift = 23 - F::mb;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t xb = bits_of(x[i]), ab = xb & 0x7FFFFFFFu;
    float a = float_of(ab);
    int32_t rounded = static_cast<int32_t>(ab) + ((1 << (shift - 1)) - 1) + static_cast<int32_t>((ab >> shift) & 1);
    int32_t normal = std::min((rounded >> shift) - ((127 - F::bias) << F::mb), F::code_max);
    int32_t sub = static_cast<int32_t>((std::min(a, F::min_normal) * F::sub_scale + 8388608.0f) - 8388608.0f);
    int32_t code = a < F::min_normal ? sub : normal;
    out[i] = static_cast<uint8_t>(code | static_cast<int32_t>((xb >> 24) & 0x80));
  }
}

// reference.scale_exponent: ceil(log2(ymax / max)) from ymax's bits.
template <int FMT> int32_t scale_exponent(float ymax) {
  uint32_t b = bits_of(ymax);
  return static_cast<int32_t>((b >> 23) & 0xFF) - (127 + Fp8<FMT>::log2_max) + ((b & 0x7FFFFF) > 0x600000 ? 1 : 0);
}

// One moment's storage: FP32 values (fmt < 0) or FP8 codes with per-group metadata.
struct Moment {
  void* data;
  float* center;
  uint8_t* kcode;
  int8_t* sexp;
  int fmt;
  float dre_num;  // K_ONE * the format's DRE log2 range
};

struct Step {
  int64_t cols, group_size, groups_per_row;
  float beta1, one_minus_beta1, beta2, one_minus_beta2, eps, decay, step_size, inv_bc2_sqrt;
  // Groups that skipped steps before (skips[gi] > 0) are bias-corrected at step - skips[gi]
  // (reference._group_bias_corrections): lr / (1 - beta1^n), 1 / sqrt(1 - beta2^n) in float32.
  float lr, step, log2_beta1, log2_beta2;
  int32_t* skips;  // per group, or null: no group skipped before and none is counted
  int dre, k_min, k_max, k_one;
};

// Per-group scratch, reused across the groups of one call.
struct Scratch {
  std::vector<float> p, g, m, v, a, t;
  explicit Scratch(int64_t n) : p(n), g(n), m(n), v(n), a(n), t(n) {}
};

inline float lane0(const Vec& v) {
  float out[Vec::size()];
  v.store(out);
  return out[0];
}

// reference._dequantize_grouped on one group.
template <int FMT> void dequantize(const Moment& mo, int64_t gi, int64_t off, int64_t n, float* __restrict out,
                                   float* __restrict q) {
  decode<FMT>(static_cast<const uint8_t*>(mo.data) + off, q, n);
  const Vec scale(pow2i(mo.sexp[gi]));
  const Vec inv_k(static_cast<float>(16) / static_cast<float>(mo.kcode[gi]));
  const float c = mo.center[gi];
  const Vec center(c), lc(lane0(Vec(c).log2())), zero(0.0f), fmax(kFloatMax);
  for (int64_t i = 0; i < n; i += Vec::size()) {
    int64_t cnt = std::min<int64_t>(Vec::size(), n - i);
    Vec qv = Vec::loadu(q + i, cnt);
    Vec t = (qv.abs() * scale).log2() * inv_k;
    Vec a = Vec::blendv((t + lc).exp2(), center, t == zero);
    a = at::vec::minimum(a, fmax);
    Vec::blendv(a, a.neg(), qv < zero).store(out + i, cnt);
  }
}

// reference._quantize_grouped on one group of finite values x[0..n).
template <int FMT> void quantize(const Moment& mo, const Step& s, int64_t gi, int64_t off, int64_t n,
                                 const float* __restrict x, float* __restrict q) {
  using F = Fp8<FMT>;
  const Vec zero(0.0f), inf(std::numeric_limits<float>::infinity());
  Vec vmax = zero, vmin = inf;
  for (int64_t i = 0; i < n; i += Vec::size()) {
    int64_t cnt = std::min<int64_t>(Vec::size(), n - i);
    Vec a = Vec::loadu(x + i, cnt).abs();
    vmax = at::vec::maximum(vmax, a);
    vmin = at::vec::minimum(vmin, Vec::blendv(inf, a, a > zero));
  }
  float hi[Vec::size()], lo[Vec::size()];
  vmax.store(hi);
  vmin.store(lo);
  float amax = hi[0], amin = lo[0];
  for (int l = 1; l < Vec::size(); ++l) {
    amax = std::max(amax, hi[l]);
    amin = std::min(amin, lo[l]);
  }
  bool nonzero = amax > 0.0f;
  float lg[2] = {amax, amin};
  vlog2(lg, 2);
  float lmax = lg[0], kf, center;
  if (s.dre) {
    float log2r = lmax - lg[1];
    kf = log2r > 0.0f ? std::floor(mo.dre_num / log2r) : static_cast<float>(s.k_max);
    kf = std::min(std::max(kf, static_cast<float>(s.k_min)), static_cast<float>(s.k_max));
    float sq[2] = {amax, amin};
    vsqrt(sq, 2);
    center = amax == amin ? amax : sq[0] * sq[1];
  } else {
    kf = static_cast<float>(s.k_one);
    center = amax;
  }
  if (!nonzero) {
    kf = static_cast<float>(s.k_one);
    center = 1.0f;
  }
  const float lc = lane0(Vec(center).log2());
  const float k = kf / static_cast<float>(s.k_one);
  const float ymax = nonzero ? lane0(Vec(k * (lmax - lc)).exp2()) : 1.0f;
  const int32_t sexp = nonzero ? scale_exponent<FMT>(ymax) : 0;
  const Vec vk(k), vlc(lc), inv_scale(pow2i(-sexp)), vfmax(F::max), vmin_sub(F::min_sub);
  const bool floor_sub = s.dre && nonzero;
  for (int64_t i = 0; i < n; i += Vec::size()) {
    int64_t cnt = std::min<int64_t>(Vec::size(), n - i);
    Vec xv = Vec::loadu(x + i, cnt);
    Vec a = xv.abs();
    Vec pos = a > zero;
    Vec y = Vec::blendv(zero, (vk * (a.log2() - vlc)).exp2(), pos);
    Vec qv = at::vec::minimum(y * inv_scale, vfmax);
    if (floor_sub) qv = Vec::blendv(qv, at::vec::maximum(qv, vmin_sub), pos);
    Vec::blendv(qv, qv.neg(), xv < zero).store(q + i, cnt);
  }
  encode<FMT>(q, static_cast<uint8_t*>(mo.data) + off, n);
  mo.center[gi] = center;
  mo.kcode[gi] = static_cast<uint8_t>(kf);
  mo.sexp[gi] = static_cast<int8_t>(sexp);
}

void moment_in(const Moment& mo, int64_t gi, int64_t off, int64_t n, float* out, float* tmp) {
  if (mo.fmt == 0) return dequantize<0>(mo, gi, off, n, out, tmp);
  if (mo.fmt == 1) return dequantize<1>(mo, gi, off, n, out, tmp);
  std::memcpy(out, static_cast<const float*>(mo.data) + off, n * sizeof(float));
}

void moment_out(const Moment& mo, const Step& s, int64_t gi, int64_t off, int64_t n, const float* x, Scratch& w) {
  if (mo.fmt == 0) return quantize<0>(mo, s, gi, off, n, x, w.t.data());
  if (mo.fmt == 1) return quantize<1>(mo, s, gi, off, n, x, w.t.data());
  std::memcpy(static_cast<float*>(mo.data) + off, x, n * sizeof(float));
}

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) { return float_of(static_cast<uint32_t>(p[i]) << 16); }
inline void store(float* p, int64_t i, float x) { p[i] = x; }
inline void store(uint16_t* p, int64_t i, float x) {
  // c10::BFloat16's rounding: to nearest even, NaN to the canonical quiet NaN.
  uint32_t b = bits_of(x);
  p[i] = std::isnan(x) ? 0x7FC0 : static_cast<uint16_t>((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
}

// x * 0 is NaN exactly for inf and NaN, and NaN survives the sum.
inline bool all_finite(const float* x, int64_t n) {
  Vec acc(0.0f);
  const Vec zero(0.0f);
  for (int64_t i = 0; i < n; i += Vec::size()) {
    acc = acc + Vec::loadu(x + i, std::min<int64_t>(Vec::size(), n - i)) * zero;
  }
  float lanes[Vec::size()];
  acc.store(lanes);
  float sum = 0.0f;
  for (int l = 0; l < Vec::size(); ++l) sum += lanes[l];
  return sum == 0.0f;
}

template <typename PT, typename GT>
int64_t run(PT* param, const GT* grad, const Moment& mm, const Moment& mv, const Step& s, int64_t g0, int64_t g1) {
  const int64_t G = s.group_size;
  Scratch w(G);
  float *P = w.p.data(), *Gr = w.g.data(), *M = w.m.data(), *V = w.v.data();
  int64_t skipped = 0;
  for (int64_t gi = g0; gi < g1; ++gi) {
    int64_t r = gi / s.groups_per_row, j = gi % s.groups_per_row;
    float step_size = s.step_size, inv_bc2_sqrt = s.inv_bc2_sqrt;
    if (s.skips != nullptr && s.skips[gi] > 0) {
      const float n_steps = s.step - static_cast<float>(s.skips[gi]);
      float pw[2] = {n_steps * s.log2_beta1, n_steps * s.log2_beta2};
      vexp2(pw, 2);
      step_size = s.lr / (1.0f - pw[0]);
      inv_bc2_sqrt = 1.0f / std::sqrt(1.0f - pw[1]);
    }
    int64_t off = r * s.cols + j * G, n = std::min(G, s.cols - j * G);
    for (int64_t i = 0; i < n; ++i) Gr[i] = load(grad, off + i);
    moment_in(mm, gi, off, n, M, w.t.data());
    moment_in(mv, gi, off, n, V, w.t.data());
    for (int64_t i = 0; i < n; ++i) {
      M[i] = s.beta1 * M[i] + s.one_minus_beta1 * Gr[i];
      V[i] = s.beta2 * V[i] + s.one_minus_beta2 * (Gr[i] * Gr[i]);
    }
    if (!(all_finite(Gr, n) && all_finite(M, n) && all_finite(V, n))) {
      ++skipped;  // the group keeps its parameter and both moments
      if (s.skips != nullptr) ++s.skips[gi];
      continue;
    }
    float* D = w.t.data();
    std::memcpy(D, V, n * sizeof(float));
    vsqrt(D, n);
    for (int64_t i = 0; i < n; ++i) {
      float denom = D[i] * inv_bc2_sqrt + s.eps;
      P[i] = load(param, off + i) * s.decay - step_size * (M[i] / denom);
    }
    for (int64_t i = 0; i < n; ++i) store(param, off + i, P[i]);
    moment_out(mm, s, gi, off, n, M, w);
    moment_out(mv, s, gi, off, n, V, w);
  }
  return skipped;
}

}  // namespace

extern "C" {

// One AdamW step over groups [g0, g1) of a contiguous (rows, cols) tensor; returns how many
// of them were skipped for non-finite values. p_bf16 / g_bf16: BF16 instead of FP32.
// m_fmt / v_fmt: -1 FP32 moment (center, kcode, sexp unused), 0 E4M3, 1 E5M2.
// hyper: lr * weight decay complement (1 - lr * wd), beta1, beta2, eps, step_size,
// 1 / bias_correction2_sqrt, 1 - beta1, 1 - beta2, lr, step, log2(beta1), log2(beta2), as
// float64 (cast to float32 here, as torch casts a Python scalar). skips: int32 per group
// (rows x groups per row) or null. fmt_dre: K_ONE * dre_log2_range of m's and v's formats.
// kcodes: K_ONE, K_MIN_CODE, K_MAX_CODE.
int64_t coat_host_adamw_step(void* param, int p_bf16, const void* grad, int g_bf16, void* m, float* m_center,
                             uint8_t* m_kcode, int8_t* m_sexp, int m_fmt, void* v, float* v_center, uint8_t* v_kcode,
                             int8_t* v_sexp, int v_fmt, int64_t cols, int64_t group_size, const double* hyper,
                             const double* fmt_dre, const int64_t* kcodes, int dre, int32_t* skips, int64_t g0,
                             int64_t g1) {
  Step s;
  s.cols = cols;
  s.group_size = group_size;
  s.groups_per_row = (cols + group_size - 1) / group_size;
  s.decay = static_cast<float>(hyper[0]);
  s.beta1 = static_cast<float>(hyper[1]);
  s.beta2 = static_cast<float>(hyper[2]);
  s.eps = static_cast<float>(hyper[3]);
  s.step_size = static_cast<float>(hyper[4]);
  s.inv_bc2_sqrt = static_cast<float>(hyper[5]);
  s.one_minus_beta1 = static_cast<float>(hyper[6]);
  s.one_minus_beta2 = static_cast<float>(hyper[7]);
  s.lr = static_cast<float>(hyper[8]);
  s.step = static_cast<float>(hyper[9]);
  s.log2_beta1 = static_cast<float>(hyper[10]);
  s.log2_beta2 = static_cast<float>(hyper[11]);
  s.skips = skips;
  s.dre = dre;
  s.k_one = static_cast<int>(kcodes[0]);
  s.k_min = static_cast<int>(kcodes[1]);
  s.k_max = static_cast<int>(kcodes[2]);
  Moment mm{m, m_center, m_kcode, m_sexp, m_fmt, static_cast<float>(fmt_dre[0])};
  Moment mv{v, v_center, v_kcode, v_sexp, v_fmt, static_cast<float>(fmt_dre[1])};
  int mkl_threads = MKL_Set_Num_Threads_Local != nullptr ? MKL_Set_Num_Threads_Local(1) : 0;
  int64_t skipped;
  if (p_bf16) {
    skipped = g_bf16 ? run(static_cast<uint16_t*>(param), static_cast<const uint16_t*>(grad), mm, mv, s, g0, g1)
                     : run(static_cast<uint16_t*>(param), static_cast<const float*>(grad), mm, mv, s, g0, g1);
  } else {
    skipped = g_bf16 ? run(static_cast<float*>(param), static_cast<const uint16_t*>(grad), mm, mv, s, g0, g1)
                     : run(static_cast<float*>(param), static_cast<const float*>(grad), mm, mv, s, g0, g1);
  }
  if (MKL_Set_Num_Threads_Local != nullptr) MKL_Set_Num_Threads_Local(mkl_threads);  // 0: the global setting again
  return skipped;
}

}  // extern "C"
