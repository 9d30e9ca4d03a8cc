// partita's CPU Adam/AdamW kernel for fp32 tensors: bitwise the update of torch's fused CPU
// kernel (torch.optim.AdamW(fused=True), ATen's FusedAdamKernel.cpp), with one division per
// element instead of two.
//
// Why: torch's fused kernel divides twice per element (the square root of the second moment by
// sqrt(bias_correction2), then the first moment by the denominator) next to one square root,
// and divisions and square roots share one unit. DeepSpeed's CPU Adam multiplies by a
// reciprocal instead and rounds differently. Here the division by the per-step constant
// b = sqrt(bias_correction2) is done with FMAs and is still correctly rounded (Markstein's
// theorem, Handbook of Floating-Point Arithmetic, chapter on division with an FMA): with
// y = RN(1/b) and q within one ulp of a/b, r = a - q*b is exact and RN(q + r*y) = RN(a/b).
// q0 = RN(a*y) can be 1.5 ulps off, so one correction step makes q1 (well within one ulp), and
// a second yields RN(a/b). Exhaustive checks (every significand of a against 380 values of b)
// found no difference from a real division even after one step; the second step is what the
// theorem covers. Infinite a (a moment that overflowed) would turn into NaN through r, so it is
// passed through as torch would. Measured on the project's Zen 4 host (one thread): 1.31x
// torch-like arithmetic on data in L1 (3.3 vs 2.5 G elements/s), equal from L2 on, where
// moving the 28 bytes per element bounds every implementation (benchmarks/bench_offload.py).
//
// Every other operation is the one torch performs, in the same order and with the same
// fused multiply-adds (its vector code, as compiled in torch's x86 wheels, contracts the
// second-moment update into fma(c2 * g, g, v * beta2) and Adam's weight decay into
// fma(p, weight_decay, g)); this file must be compiled with
// -ffp-contract=off so the compiler adds none; the AVX-512 and AVX2 bodies below must stay the
// same operations in the same order. The caller (partita/optim/adam_kernel.py)
// checks bitwise equality with torch's kernel on first use and falls back to it otherwise, and
// hands torch the last n % W elements of each tensor (W = torch's vector width), which torch
// computes in a scalar loop with different contractions.
//
// Interface: plain C, called through ctypes (which releases the GIL while it runs).

#include <immintrin.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

extern "C" {

// One update's hyper-parameters, as torch's fused kernel takes them (doubles).
struct PartitaAdamArgs {
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
  double step;        // 1-based update number for rows without a step counter
  int32_t decoupled;  // 1: AdamW; 0: Adam with the weight decay added to the gradient
};

}  // extern "C"

namespace {

// A row's constants, each rounded from double to float as ATen's kernel rounds it.
struct Consts {
  float decay;           // AdamW: 1 - lr * weight_decay
  float weight_decay;    // Adam (coupled): added as weight_decay * param to the gradient
  float lerp_weight;     // 1 - beta1: exp_avg.lerp_(grad, lerp_weight)
  float beta2;
  float one_minus_beta2;
  float bias2_sqrt;      // sqrt(1 - beta2^step)
  float bias2_sqrt_inv;  // RN(1 / bias2_sqrt) in single precision
  float eps;
  float neg_step_size;   // -lr / (1 - beta1^step)
  bool coupled;
  bool has_decay;
};

Consts make_consts(const PartitaAdamArgs& a, double step) {
  // As ATen: bias corrections and the step size in double (std::pow, std::sqrt), then floats.
  const double bias1 = 1 - std::pow(a.beta1, step);
  const double bias2_sqrt = std::sqrt(1 - std::pow(a.beta2, step));
  Consts c;
  c.decay = float(1 - a.lr * a.weight_decay);
  c.weight_decay = float(a.weight_decay);
  c.lerp_weight = float(1 - a.beta1);
  c.beta2 = float(a.beta2);
  c.one_minus_beta2 = float(1 - a.beta2);
  c.bias2_sqrt = float(bias2_sqrt);
  // A float division, not a double one rounded to float (that could differ in the last bit).
  volatile float one = 1.0f;
  c.bias2_sqrt_inv = one / c.bias2_sqrt;
  c.eps = float(a.eps);
  c.neg_step_size = float(-(a.lr / bias1));
  c.coupled = a.decoupled == 0;
  c.has_decay = a.weight_decay != 0;
  return c;
}

// ---- AVX-512: 16 lanes (lengths are multiples of 16).

__attribute__((target("avx512f"))) inline __m512 div_by_constant512(__m512 a, __m512 b, __m512 y) {
  __m512 q = _mm512_mul_ps(a, y);
  __m512 r = _mm512_fnmadd_ps(q, b, a);
  q = _mm512_fmadd_ps(r, y, q);
  r = _mm512_fnmadd_ps(q, b, a);
  q = _mm512_fmadd_ps(r, y, q);
  __mmask16 inf = _mm512_cmp_ps_mask(a, _mm512_set1_ps(INFINITY), _CMP_EQ_OQ);
  return _mm512_mask_mov_ps(q, inf, _mm512_set1_ps(INFINITY));
}

__attribute__((target("avx512f"))) void step512(
    const Consts& a, float* p, float* g, float* m, float* v, int64_t n) {
  const __m512 decay = _mm512_set1_ps(a.decay), wd = _mm512_set1_ps(a.weight_decay);
  const __m512 lw = _mm512_set1_ps(a.lerp_weight);
  // torch's lerp: for a weight below 0.5, m + w * (g - m); else g - (g - m) * (1 - w),
  // written as fma(w - 1, g - m, g).
  const bool small = std::fabs(a.lerp_weight) < 0.5f;
  const __m512 coeff = small ? lw : _mm512_sub_ps(lw, _mm512_set1_ps(1.0f));
  const __m512 b2 = _mm512_set1_ps(a.beta2), c2 = _mm512_set1_ps(a.one_minus_beta2);
  const __m512 bs = _mm512_set1_ps(a.bias2_sqrt), bsi = _mm512_set1_ps(a.bias2_sqrt_inv);
  const __m512 eps = _mm512_set1_ps(a.eps), ns = _mm512_set1_ps(a.neg_step_size);
  for (int64_t i = 0; i < n; i += 16) {
    __m512 pv = _mm512_loadu_ps(p + i), gv = _mm512_loadu_ps(g + i);
    __m512 mv = _mm512_loadu_ps(m + i), vv = _mm512_loadu_ps(v + i);
    if (a.has_decay) {
      if (a.coupled) {
        gv = _mm512_fmadd_ps(pv, wd, gv);
      } else {
        pv = _mm512_mul_ps(pv, decay);
      }
    }
    mv = _mm512_fmadd_ps(coeff, _mm512_sub_ps(gv, mv), small ? mv : gv);
    vv = _mm512_fmadd_ps(_mm512_mul_ps(c2, gv), gv, _mm512_mul_ps(vv, b2));
    const __m512 den = _mm512_add_ps(div_by_constant512(_mm512_sqrt_ps(vv), bs, bsi), eps);
    pv = _mm512_add_ps(pv, _mm512_div_ps(_mm512_mul_ps(ns, mv), den));
    _mm512_storeu_ps(m + i, mv);
    _mm512_storeu_ps(v + i, vv);
    _mm512_storeu_ps(p + i, pv);
  }
}

// ---- AVX2 + FMA: 8 lanes (lengths are multiples of 8).

__attribute__((target("avx2,fma"))) inline __m256 div_by_constant256(__m256 a, __m256 b, __m256 y) {
  __m256 q = _mm256_mul_ps(a, y);
  __m256 r = _mm256_fnmadd_ps(q, b, a);
  q = _mm256_fmadd_ps(r, y, q);
  r = _mm256_fnmadd_ps(q, b, a);
  q = _mm256_fmadd_ps(r, y, q);
  const __m256 inf = _mm256_set1_ps(INFINITY);
  return _mm256_blendv_ps(q, inf, _mm256_cmp_ps(a, inf, _CMP_EQ_OQ));
}

__attribute__((target("avx2,fma"))) void step256(
    const Consts& a, float* p, float* g, float* m, float* v, int64_t n) {
  const __m256 decay = _mm256_set1_ps(a.decay), wd = _mm256_set1_ps(a.weight_decay);
  const __m256 lw = _mm256_set1_ps(a.lerp_weight);
  const bool small = std::fabs(a.lerp_weight) < 0.5f;
  const __m256 coeff = small ? lw : _mm256_sub_ps(lw, _mm256_set1_ps(1.0f));
  const __m256 b2 = _mm256_set1_ps(a.beta2), c2 = _mm256_set1_ps(a.one_minus_beta2);
  const __m256 bs = _mm256_set1_ps(a.bias2_sqrt), bsi = _mm256_set1_ps(a.bias2_sqrt_inv);
  const __m256 eps = _mm256_set1_ps(a.eps), ns = _mm256_set1_ps(a.neg_step_size);
  for (int64_t i = 0; i < n; i += 8) {
    __m256 pv = _mm256_loadu_ps(p + i), gv = _mm256_loadu_ps(g + i);
    __m256 mv = _mm256_loadu_ps(m + i), vv = _mm256_loadu_ps(v + i);
    if (a.has_decay) {
      if (a.coupled) {
        gv = _mm256_fmadd_ps(pv, wd, gv);
      } else {
        pv = _mm256_mul_ps(pv, decay);
      }
    }
    mv = _mm256_fmadd_ps(coeff, _mm256_sub_ps(gv, mv), small ? mv : gv);
    vv = _mm256_fmadd_ps(_mm256_mul_ps(c2, gv), gv, _mm256_mul_ps(vv, b2));
    const __m256 den = _mm256_add_ps(div_by_constant256(_mm256_sqrt_ps(vv), bs, bsi), eps);
    pv = _mm256_add_ps(pv, _mm256_div_ps(_mm256_mul_ps(ns, mv), den));
    _mm256_storeu_ps(m + i, mv);
    _mm256_storeu_ps(v + i, vv);
    _mm256_storeu_ps(p + i, pv);
  }
}

}  // namespace

extern "C" {

// 2: AVX-512F, 1: AVX2 + FMA, 0: neither (the caller then uses torch's kernel).
int partita_adam_isa(void) {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return 2;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
  return 0;
}

// One update of `count` tensors. Row j of `table` holds the addresses of tensor j's param,
// grad, exp_avg and exp_avg_sq, of its step counter (a float32 scalar, or 0), and the length to
// update in floats (a multiple of 16 for isa 2, of 8 for isa 1: torch's vector width, so the
// split between vector body and scalar tail is torch's). A row with a counter adds one to it
// first and uses its new value as the step (what torch.optim's fused Adam does); a row without
// one uses args->step. `isa`: 2 AVX-512, 1 AVX2. The elements of all rows are split into
// `threads` equal ranges (OpenMP: the runtime torch ships and loads, so these are torch's
// intra-op threads, already spinning after its last op).
void partita_adam_step(const PartitaAdamArgs* args, int32_t isa, int32_t threads,
                       const int64_t (*table)[6], int64_t count) {
  std::vector<Consts> consts(count);
  int64_t total = 0;
  for (int64_t j = 0; j < count; ++j) {
    double step = args->step;
    if (table[j][4] != 0) {
      float* counter = reinterpret_cast<float*>(table[j][4]);
      *counter += 1.0f;
      step = *counter;
    }
    consts[j] = make_consts(*args, step);
    total += table[j][5];
  }
  // Below this a fork/join costs about what the work does.
  const int32_t team = total >= (int64_t(1) << 15) ? threads : 1;
  // The calling thread's MXCSR (denormal flushing, as torch.set_flush_denormal left it).
  const uint32_t mxcsr = _mm_getcsr();
#pragma omp parallel num_threads(team) if (team > 1)
  {
#ifdef _OPENMP
    const int64_t rank = omp_get_thread_num(), ranks = omp_get_num_threads();
#else
    const int64_t rank = 0, ranks = 1;
#endif
    const int64_t share = ((total + ranks - 1) / ranks + 15) / 16 * 16;
    const int64_t lo = std::min(total, rank * share), hi = std::min(total, lo + share);
    // Worker threads carry their own MXCSR; torch's denormal setting is the caller's.
    const uint32_t saved = _mm_getcsr();
    _mm_setcsr(mxcsr);
    int64_t start = 0;
    for (int64_t j = 0; j < count && start < hi; start += table[j][5], ++j) {
      const int64_t from = std::max(lo, start) - start;
      const int64_t to = std::min(hi, start + table[j][5]) - start;
      if (from >= to) continue;
      float* p = reinterpret_cast<float*>(table[j][0]) + from;
      float* g = reinterpret_cast<float*>(table[j][1]) + from;
      float* m = reinterpret_cast<float*>(table[j][2]) + from;
      float* v = reinterpret_cast<float*>(table[j][3]) + from;
      if (isa >= 2) {
        step512(consts[j], p, g, m, v, to - from);
      } else {
        step256(consts[j], p, g, m, v, to - from);
      }
    }
    _mm_setcsr(saved);
  }
}


}  // extern "C"
