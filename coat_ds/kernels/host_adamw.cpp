// The host AdamW step with FP8 (DRE) or FP32 moments, fused per quantization group: the
// CPU counterpart of kernels/adamw.py, computing what host.adamw_step (the twin, the oracle)
// computes.
//
// Bit for bit the reference's: the AdamW arithmetic in its float32 operations and order
// (sqrt through MKL where torch uses it), so FP32 moments and their parameters; every
// per-group decision (range, k, centre, scale), with ATen's Vectorized<float> log2/exp2
// (SLEEF, as torch.log2/torch.exp2) batched over a few thousand elements; and decoding of
// FP8 moments (log2 of each magnitude from a table, then SLEEF's exp2). Not bit for bit, by
// design: encoding's per-element log2 and exp2 are our own polynomials (host_fp8.h), ~1 ulp
// from SLEEF's, so a code differs only where that ulp moves a value across a rounding
// midpoint (tests/test_host_kernel.py measures how often). SLEEF's per-element calls were
// ~45 % of the step before. Built with -ffp-contract=off: a fused multiply-add would round
// differently from the reference's separate ops (the polynomials call std::fma themselves).
//
// Plain C ABI, called through ctypes (which releases the GIL): Python passes raw pointers
// of contiguous tensors and a range of groups; each call writes only its own groups, so
// threads given disjoint ranges never write the same bytes. Scalars every group shares come
// in `hyper`; a per-group input (say, bias corrections for groups that skipped steps) is one
// more pointer read at `gi`, next to the centre and exponents.
#include <ATen/cpu/vec/vec.h>

#include "host_fp8.h"

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
// Groups are stepped in batches of about this many elements, so that the per-group scalar
// work (SLEEF and MKL calls on a few values) runs once per batch on arrays: called per group,
// it cost ~10 % of the step. Four FP32 arrays of a batch stay in L2.
constexpr int64_t kBatchElems = 4096;

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

void vsqrt(const float* x, float* out, int64_t n) {
  if (vmsSqrt != nullptr) {
    vmsSqrt(static_cast<int>(n), x, out, kVmlMode);
    return;
  }
  for (int64_t i = 0; i < n; ++i) out[i] = std::sqrt(x[i]);
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
  // (host._group_bias_corrections): lr / (1 - beta1^n), 1 / sqrt(1 - beta2^n) in float32.
  float lr, step, log2_beta1, log2_beta2;
  float m_bound;  // layout.adam_bound for a quantized first moment, else +inf (no clamp)
  int32_t* skips;  // per group, or null: no group skipped before and none is counted
  int dre, k_min, k_max, k_one;
};

// One FP8 moment's per-group values for a batch: log2 of the stored centres (decoding), then
// the new range, k, centre, log2 centre and scale exponent (encoding).
struct GroupVals {
  std::vector<float> lc_in, amax, amin, lmax, lmin, sq, kf, center, lc, ymax;
  std::vector<int32_t> sexp;
  explicit GroupVals(int64_t b)
      : lc_in(b), amax(b), amin(b), lmax(b), lmin(b), sq(2 * b), kf(b), center(b), lc(b), ymax(b), sexp(b) {}
};

// A batch's scratch, reused across the batches of one call: group j's elements at j * G.
struct Scratch {
  std::vector<float> g, m, v, d;
  std::vector<uint8_t> ok, quiet;  // quiet: the group's gradient is all zero
  GroupVals gm, gv;
  Scratch(int64_t b, int64_t G) : g(b * G), m(b * G), v(b * G), d(b * G), ok(b), quiet(b), gm(b), gv(b) {}
};

// group_codec.dequantize_grouped on one group; lc = log2(its centre).
template <int FMT> void dequantize(const Moment& mo, int64_t gi, int64_t off, int64_t n, float lc,
                                   float* __restrict out) {
  const uint8_t* __restrict codes = static_cast<const uint8_t*>(mo.data) + off;
  const Row128 rows(log2_rows<FMT>() + (static_cast<int32_t>(mo.sexp[gi]) + 128) * 128);
  const Vec inv_k(static_cast<float>(16) / static_cast<float>(mo.kcode[gi]));
  const Vec center(mo.center[gi]), vlc(lc), zero(0.0f), fmax(kFloatMax);
  for (int64_t i = 0; i < n; i += Vec::size()) {
    const int64_t cnt = std::min<int64_t>(Vec::size(), n - i);
    const Vec t = rows.lookup(codes + i, cnt) * inv_k;
    // t == 0 (magnitude 1 after scaling) is the centre exactly; code 0 gives t = -inf, 0.
    at::vec::minimum(Vec::blendv((t + vlc).exp2(), center, t == zero), fmax).store(out + i, cnt);
  }
  for (int64_t i = 0; i < n; ++i) out[i] = codes[i] > 0x80 ? -out[i] : out[i];  // code 0x80 (-0) gives +0
}

// group_codec.quantize_grouped's per-group decisions for groups [0, nb) of a batch from their
// amax / amin (0 / inf for a group of zeros), in its float32 operations.
template <int FMT> void decide(const Moment& mo, const Step& s, int64_t nb, GroupVals& w) {
  std::copy_n(w.amax.data(), nb, w.lmax.data());
  vlog2(w.lmax.data(), nb);
  if (s.dre) {
    std::copy_n(w.amin.data(), nb, w.lmin.data());
    vlog2(w.lmin.data(), nb);
    std::copy_n(w.amax.data(), nb, w.sq.data());
    std::copy_n(w.amin.data(), nb, w.sq.data() + nb);
    vsqrt(w.sq.data(), w.sq.data(), 2 * nb);
  }
  for (int64_t j = 0; j < nb; ++j) {
    const float amax = w.amax[j], amin = w.amin[j];
    float kf, center;
    if (s.dre) {
      const float log2r = w.lmax[j] - w.lmin[j];
      kf = log2r > 0.0f ? std::floor(mo.dre_num / log2r) : static_cast<float>(s.k_max);
      kf = std::min(std::max(kf, static_cast<float>(s.k_min)), static_cast<float>(s.k_max));
      center = amax == amin ? amax : w.sq[j] * w.sq[nb + j];
    } else {
      kf = static_cast<float>(s.k_one);
      center = amax;
    }
    if (!(amax > 0.0f)) {
      kf = static_cast<float>(s.k_one);
      center = 1.0f;
    }
    w.kf[j] = kf;
    w.center[j] = center;
  }
  std::copy_n(w.center.data(), nb, w.lc.data());
  vlog2(w.lc.data(), nb);
  for (int64_t j = 0; j < nb; ++j) w.ymax[j] = (w.kf[j] / static_cast<float>(s.k_one)) * (w.lmax[j] - w.lc[j]);
  vexp2(w.ymax.data(), nb);
  for (int64_t j = 0; j < nb; ++j) {
    const bool nonzero = w.amax[j] > 0.0f;
    w.sexp[j] = nonzero ? scale_exponent<FMT>(w.ymax[j]) : 0;
  }
}

// group_codec.quantize_grouped's elementwise part on group j of a batch (finite x[0..n)).
template <int FMT> void quantize(const Moment& mo, const Step& s, const GroupVals& w, int64_t j, int64_t gi,
                                 int64_t off, int64_t n, const float* __restrict x) {
  using F = Fp8<FMT>;
  uint8_t* __restrict out = static_cast<uint8_t*>(mo.data) + off;
  const float k = w.kf[j] / static_cast<float>(s.k_one), lc = w.lc[j];
  const int32_t neg_sexp = -w.sexp[j];
  // Below the format's range (a group wider than range / k): the smallest code, not 0.
  const float floor_q = s.dre && w.amax[j] > 0.0f ? F::min_sub : 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    // Computed for every element and selected after (zeros give finite junk): a conditional
    // op would keep the loop from vectorizing.
    const float v = x[i], a = std::fabs(v);
    const float q = std::max(std::min(exp2_scaled(k * (log2_poly(a) - lc), neg_sexp), F::max), floor_q);
    out[i] = static_cast<uint8_t>(encode_mag<FMT>(a > 0.0f ? q : 0.0f) | (v < 0.0f ? 0x80u : 0u));
  }
  mo.center[gi] = w.center[j];
  mo.kcode[gi] = static_cast<uint8_t>(w.kf[j]);
  mo.sexp[gi] = static_cast<int8_t>(w.sexp[j]);
}

void moment_in(const Moment& mo, int64_t gi, int64_t off, int64_t n, float lc, float* out) {
  if (mo.fmt == 0) return dequantize<0>(mo, gi, off, n, lc, out);
  if (mo.fmt == 1) return dequantize<1>(mo, gi, off, n, lc, out);
  std::memcpy(out, static_cast<const float*>(mo.data) + off, n * sizeof(float));
}

void moment_out(const Moment& mo, const Step& s, const Scratch& w, GroupVals& gv, const float* x, int64_t g0,
                int64_t nb, const int64_t* off, const int64_t* len, float beta) {
  const int64_t G = s.group_size;
  if (mo.fmt < 0) {
    for (int64_t j = 0; j < nb; ++j) {
      if (w.ok[j]) std::memcpy(static_cast<float*>(mo.data) + off[j], x + j * G, len[j] * sizeof(float));
    }
    return;
  }
  if (mo.fmt == 0) decide<0>(mo, s, nb, gv); else decide<1>(mo, s, nb, gv);
  for (int64_t j = 0; j < nb; ++j) {
    if (!w.ok[j]) continue;
    // A group without gradient keeps its codes and decays its centre (host._moment_out).
    const float decayed = mo.center[g0 + j] * beta;
    if (w.quiet[j] && decayed >= std::numeric_limits<float>::min()) {
      mo.center[g0 + j] = decayed;
      continue;
    }
    if (mo.fmt == 0) quantize<0>(mo, s, gv, j, g0 + j, off[j], len[j], x + j * G);
    else quantize<1>(mo, s, gv, j, g0 + j, off[j], len[j], x + j * G);
  }
}

// log2 of the stored centres of groups [g0, g0 + nb) of an FP8 moment (SLEEF, as the reference).
void centre_logs(const Moment& mo, int64_t g0, int64_t nb, GroupVals& gv) {
  if (mo.fmt < 0) return;
  std::copy_n(mo.center + g0, nb, gv.lc_in.data());
  vlog2(gv.lc_in.data(), nb);
}

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) { return float_of(static_cast<uint32_t>(p[i]) << 16); }
inline void store(float* p, int64_t i, float x) { p[i] = x; }
inline void store(uint16_t* p, int64_t i, float x) {
  // c10::BFloat16's rounding: to nearest even, NaN to the canonical quiet NaN.
  uint32_t b = bits_of(x);
  p[i] = std::isnan(x) ? 0x7FC0 : static_cast<uint16_t>((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
}

// A BF16 parameter with the low part of its FP32 master (kernels/master.py): the step reads
// the master as (hi << 16) + remainder, or ((hi << 8) + remainder) << 8, and writes it back
// split the same way, so the FP32 result is stepped and stored as the reference does.
template <typename R> struct Master {
  uint16_t* hi;
  R* lo;
};

inline float load(const Master<int16_t>& p, int64_t i) {
  return float_of((static_cast<uint32_t>(p.hi[i]) << 16) + static_cast<uint32_t>(static_cast<int32_t>(p.lo[i])));
}
inline float load(const Master<int8_t>& p, int64_t i) {
  return float_of(((static_cast<uint32_t>(p.hi[i]) << 8) + static_cast<uint32_t>(static_cast<int32_t>(p.lo[i])))
                  << 8);
}
inline void store(const Master<int16_t>& p, int64_t i, float x) {
  const uint32_t b = bits_of(x);
  const bool nan = std::isnan(x);
  p.hi[i] = nan ? 0x7FC0 : static_cast<uint16_t>((b + 0x8000u) >> 16);
  p.lo[i] = nan ? 0 : static_cast<int16_t>(static_cast<uint16_t>(b & 0xFFFFu));
}
inline void store(const Master<int8_t>& p, int64_t i, float x) {
  constexpr uint32_t kExp24 = 0xFFu << 15;
  const uint32_t b = bits_of(x);
  uint32_t c = (b + 0x80u) >> 8;
  if ((c & kExp24) == kExp24 && ((b >> 8) & kExp24) != kExp24) c = b >> 8;  // no carry into inf
  const uint32_t hi = (c + 0x80u) >> 8;
  const bool nan = std::isnan(x);
  p.hi[i] = nan ? 0x7FC0 : static_cast<uint16_t>(hi);
  p.lo[i] = nan ? 0 : static_cast<int8_t>(static_cast<int32_t>(c) - static_cast<int32_t>(hi << 8));
}

// Magnitude bits of a float: for finite values ordered as the magnitudes are, so a group's
// range and finiteness are integer reductions, which vectorize (float max/min do not
// without fast-math).
constexpr uint32_t kAbsMask = 0x7FFFFFFFu, kExpMask = 0x7F800000u;

template <typename PT, typename GT>
int64_t run(PT param, const GT* grad, const Moment& mm, const Moment& mv, const Step& s, int64_t g0, int64_t g1) {
  const int64_t G = s.group_size, B = std::max<int64_t>(1, kBatchElems / G);
  Scratch w(B, G);
  std::vector<int64_t> off(B), len(B);
  int64_t skipped = 0;
  for (int64_t b0 = g0; b0 < g1; b0 += B) {
    const int64_t nb = std::min(B, g1 - b0);
    centre_logs(mm, b0, nb, w.gm);
    centre_logs(mv, b0, nb, w.gv);
    for (int64_t j = 0; j < nb; ++j) {
      const int64_t gi = b0 + j, r = gi / s.groups_per_row, c = gi % s.groups_per_row;
      off[j] = r * s.cols + c * G;
      len[j] = std::min(G, s.cols - c * G);
      const int64_t o = off[j], n = len[j];
      float *Gr = w.g.data() + j * G, *M = w.m.data() + j * G, *V = w.v.data() + j * G;
      for (int64_t i = 0; i < n; ++i) Gr[i] = load(grad, o + i);
      moment_in(mm, gi, o, n, w.gm.lc_in[j], M);
      moment_in(mv, gi, o, n, w.gv.lc_in[j], V);
      // Also the largest magnitude of each (as bits: a non-finite value's are >= the exponent
      // mask) and each moment's smallest nonzero magnitude, less one (0 wraps to ~0u: none).
      uint32_t gmax = 0, mmax = 0, mmin = ~0u, vmax = 0, vmin = ~0u;
      const float b1 = s.beta1, c1 = s.one_minus_beta1, b2 = s.beta2, c2 = s.one_minus_beta2;
      float *__restrict Mr = M, *__restrict Vr = V;
      const float* __restrict Gc = Gr;
      for (int64_t i = 0; i < n; ++i) {
        const float g = Gc[i];
        const float vi = b2 * Vr[i] + c2 * (g * g);
        const float lim = s.m_bound * std::sqrt(vi);  // NaN (inf * 0) or inf: no clamp
        const float mi = std::min(std::max(b1 * Mr[i] + c1 * g, -lim), lim);
        Mr[i] = mi;
        Vr[i] = vi;
        const uint32_t gb = bits_of(g) & kAbsMask, mb = bits_of(mi) & kAbsMask, vb = bits_of(vi) & kAbsMask;
        gmax = std::max(gmax, gb);
        mmax = std::max(mmax, mb);
        vmax = std::max(vmax, vb);
        mmin = std::min(mmin, mb - 1u);
        vmin = std::min(vmin, vb - 1u);
      }
      // No nonzero element: amin = inf, as the reference's min over a > 0 gives.
      w.gm.amax[j] = float_of(mmax);
      w.gm.amin[j] = mmin == ~0u ? std::numeric_limits<float>::infinity() : float_of(mmin + 1u);
      w.gv.amax[j] = float_of(vmax);
      w.gv.amin[j] = vmin == ~0u ? std::numeric_limits<float>::infinity() : float_of(vmin + 1u);
      w.ok[j] = std::max(gmax, std::max(mmax, vmax)) < kExpMask;
      w.quiet[j] = gmax == 0;
      if (!w.ok[j]) {
        ++skipped;  // the group keeps its parameter and both moments
        if (s.skips != nullptr) ++s.skips[gi];
      }
    }
    // One MKL call for the batch; groups shorter than G leave stale (ignored) floats behind.
    vsqrt(w.v.data(), w.d.data(), nb * G);
    for (int64_t j = 0; j < nb; ++j) {
      if (!w.ok[j]) continue;
      const int64_t gi = b0 + j, o = off[j], n = len[j];
      float step_size = s.step_size, inv_bc2_sqrt = s.inv_bc2_sqrt;
      if (s.skips != nullptr && s.skips[gi] > 0) {
        const float n_steps = s.step - static_cast<float>(s.skips[gi]);
        float pw[2] = {n_steps * s.log2_beta1, n_steps * s.log2_beta2};
        vexp2(pw, 2);
        step_size = s.lr / (1.0f - pw[0]);
        inv_bc2_sqrt = 1.0f / std::sqrt(1.0f - pw[1]);
      }
      const float *M = w.m.data() + j * G, *D = w.d.data() + j * G;
      for (int64_t i = 0; i < n; ++i) {
        const float denom = D[i] * inv_bc2_sqrt + s.eps;
        store(param, o + i, load(param, o + i) * s.decay - step_size * (M[i] / denom));
      }
    }
    moment_out(mm, s, w, w.gm, w.m.data(), b0, nb, off.data(), len.data(), s.beta1);
    moment_out(mv, s, w, w.gv, w.v.data(), b0, nb, off.data(), len.data(), s.beta2);
  }
  return skipped;
}

template <typename GT>
int64_t run_param(void* param, int p_bf16, void* rem, int rem_bits, const GT* grad, const Moment& mm,
                  const Moment& mv, const Step& s, int64_t g0, int64_t g1) {
  uint16_t* hi = static_cast<uint16_t*>(param);
  if (rem_bits == 16) return run(Master<int16_t>{hi, static_cast<int16_t*>(rem)}, grad, mm, mv, s, g0, g1);
  if (rem_bits == 8) return run(Master<int8_t>{hi, static_cast<int8_t*>(rem)}, grad, mm, mv, s, g0, g1);
  if (p_bf16) return run(hi, grad, mm, mv, s, g0, g1);
  return run(static_cast<float*>(param), grad, mm, mv, s, g0, g1);
}

}  // namespace

extern "C" {

// One AdamW step over groups [g0, g1) of a contiguous (rows, cols) tensor; returns how many
// of them were skipped for non-finite values. p_bf16 / g_bf16: BF16 instead of FP32.
// rem / rem_bits: the int16 (16) or int8 (8) remainder of a BF16 parameter's FP32 master, or
// null / 0.
// m_fmt / v_fmt: -1 FP32 moment (center, kcode, sexp unused), 0 E4M3, 1 E5M2.
// hyper: lr * weight decay complement (1 - lr * wd), beta1, beta2, eps, step_size,
// 1 / bias_correction2_sqrt, 1 - beta1, 1 - beta2, lr, step, log2(beta1), log2(beta2), the bound
// of a quantized first moment (+inf: none), as
// float64 (cast to float32 here, as torch casts a Python scalar). skips: int32 per group
// (rows x groups per row) or null. fmt_dre: K_ONE * dre_log2_range of m's and v's formats.
// kcodes: K_ONE, K_MIN_CODE, K_MAX_CODE.
int64_t coat_host_adamw_step(void* param, int p_bf16, void* rem, int rem_bits, const void* grad, int g_bf16, void* m, float* m_center,
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
  s.m_bound = m_fmt >= 0 ? static_cast<float>(hyper[12]) : std::numeric_limits<float>::infinity();
  s.skips = skips;
  s.dre = dre;
  s.k_one = static_cast<int>(kcodes[0]);
  s.k_min = static_cast<int>(kcodes[1]);
  s.k_max = static_cast<int>(kcodes[2]);
  Moment mm{m, m_center, m_kcode, m_sexp, m_fmt, static_cast<float>(fmt_dre[0])};
  Moment mv{v, v_center, v_kcode, v_sexp, v_fmt, static_cast<float>(fmt_dre[1])};
  int mkl_threads = MKL_Set_Num_Threads_Local != nullptr ? MKL_Set_Num_Threads_Local(1) : 0;
  const int64_t skipped = g_bf16 ? run_param(param, p_bf16, rem, rem_bits, static_cast<const uint16_t*>(grad), mm, mv, s, g0, g1)
                   : run_param(param, p_bf16, rem, rem_bits, static_cast<const float*>(grad), mm, mv, s, g0, g1);
  if (MKL_Set_Num_Threads_Local != nullptr) MKL_Set_Num_Threads_Local(mkl_threads);  // 0: the global setting again
  return skipped;
}

}  // extern "C"
