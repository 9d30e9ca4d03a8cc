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
// Optionally each row also stores the updated parameters converted to bfloat16, float16 or
// float32 in the same pass (the weights an offloaded step must produce anyway: 2 more bytes
// written per element instead of a second pass reading 4 and writing 2), rounded as torch's
// vectorised conversions round (the caller checks this bitwise on first use too).
//
// Interface: plain C, called through ctypes (which releases the GIL while it runs).

#include <immintrin.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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

// Where a row's updated parameters are also written, converted (kinds: see partita_adam_step).
enum OutKind : int64_t { kNone = 0, kBF16 = 1, kFP16 = 2, kFP32 = 3 };

struct Out {
  void* ptr;
  int64_t kind;
};

inline int64_t out_size(int64_t kind) { return kind == kFP32 ? 4 : 2; }

// The last partial vector of a row: its elements are copied into zero-padded vectors, updated
// with the same operations as the full vectors (the update is elementwise), and copied back.
struct Remainder {
  alignas(64) float p[16], g[16], m[16], v[16];
  alignas(64) unsigned char out[64];
  Remainder(const float* p0, const float* g0, const float* m0, const float* v0, int64_t k) {
    std::fill(p, p + 16, 0.0f), std::fill(g, g + 16, 0.0f);
    std::fill(m, m + 16, 0.0f), std::fill(v, v + 16, 0.0f);
    std::copy(p0, p0 + k, p), std::copy(g0, g0 + k, g);
    std::copy(m0, m0 + k, m), std::copy(v0, v0 + k, v);
  }
  void store(float* p0, float* m0, float* v0, const Out& o, int64_t i, int64_t k) const {
    std::copy(p, p + k, p0), std::copy(m, m + k, m0), std::copy(v, v + k, v0);
    if (o.kind != kNone) {
      std::memcpy(static_cast<unsigned char*>(o.ptr) + i * out_size(o.kind), out,
                  k * out_size(o.kind));
    }
  }
};

// ---- AVX-512: 16 lanes.

__attribute__((target("avx512f"))) inline __m512 div_by_constant512(__m512 a, __m512 b, __m512 y) {
  __m512 q = _mm512_mul_ps(a, y);
  __m512 r = _mm512_fnmadd_ps(q, b, a);
  q = _mm512_fmadd_ps(r, y, q);
  r = _mm512_fnmadd_ps(q, b, a);
  q = _mm512_fmadd_ps(r, y, q);
  __mmask16 inf = _mm512_cmp_ps_mask(a, _mm512_set1_ps(INFINITY), _CMP_EQ_OQ);
  return _mm512_mask_mov_ps(q, inf, _mm512_set1_ps(INFINITY));
}

// bfloat16 as torch's vectorised conversion makes it: round to nearest even on the bits, NaN to
// 0xffff.
__attribute__((target("avx512f"))) inline __m256i to_bf16_512(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  __m512i r = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  r = _mm512_add_epi32(_mm512_add_epi32(r, _mm512_set1_epi32(0x7fff)), bits);
  r = _mm512_srli_epi32(r, 16);
  r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_ORD_Q), _mm512_set1_epi32(0xffff), r);
  return _mm512_cvtusepi32_epi16(r);
}

__attribute__((target("avx512f"))) inline void store_out512(__m512 x, void* dst, int64_t kind) {
  if (kind == kBF16) {
    _mm256_storeu_si256(static_cast<__m256i*>(dst), to_bf16_512(x));
  } else if (kind == kFP16) {
    _mm256_storeu_si256(static_cast<__m256i*>(dst),
                        _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else if (kind == kFP32) {
    _mm512_storeu_ps(static_cast<float*>(dst), x);
  }
}

__attribute__((target("avx512f"))) void step512(
    const Consts& a, float* p, float* g, float* m, float* v, const Out& out, int64_t n) {
  const __m512 decay = _mm512_set1_ps(a.decay), wd = _mm512_set1_ps(a.weight_decay);
  const __m512 lw = _mm512_set1_ps(a.lerp_weight);
  // torch's lerp: for a weight below 0.5, m + w * (g - m); else g - (g - m) * (1 - w),
  // written as fma(w - 1, g - m, g).
  const bool small = std::fabs(a.lerp_weight) < 0.5f;
  const __m512 coeff = small ? lw : _mm512_sub_ps(lw, _mm512_set1_ps(1.0f));
  const __m512 b2 = _mm512_set1_ps(a.beta2), c2 = _mm512_set1_ps(a.one_minus_beta2);
  const __m512 bs = _mm512_set1_ps(a.bias2_sqrt), bsi = _mm512_set1_ps(a.bias2_sqrt_inv);
  const __m512 eps = _mm512_set1_ps(a.eps), ns = _mm512_set1_ps(a.neg_step_size);
  // One vector: 16 elements at pp..vp, converted parameters to dst.
  auto update = [&](float* pp, float* gp, float* mp, float* vp, void* dst)
                    __attribute__((target("avx512f"))) {
    __m512 pv = _mm512_loadu_ps(pp), gv = _mm512_loadu_ps(gp);
    __m512 mv = _mm512_loadu_ps(mp), vv = _mm512_loadu_ps(vp);
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
    _mm512_storeu_ps(mp, mv);
    _mm512_storeu_ps(vp, vv);
    _mm512_storeu_ps(pp, pv);
    store_out512(pv, dst, out.kind);
  };
  unsigned char* o = static_cast<unsigned char*>(out.ptr);
  const int64_t size = out_size(out.kind);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    update(p + i, g + i, m + i, v + i, o == nullptr ? nullptr : o + i * size);
  }
  if (i < n) {
    Remainder r(p + i, g + i, m + i, v + i, n - i);
    update(r.p, r.g, r.m, r.v, r.out);
    r.store(p + i, m + i, v + i, out, i, n - i);
  }
}

// ---- AVX2 + FMA (+ F16C): 8 lanes.

__attribute__((target("avx2,fma"))) inline __m256 div_by_constant256(__m256 a, __m256 b, __m256 y) {
  __m256 q = _mm256_mul_ps(a, y);
  __m256 r = _mm256_fnmadd_ps(q, b, a);
  q = _mm256_fmadd_ps(r, y, q);
  r = _mm256_fnmadd_ps(q, b, a);
  q = _mm256_fmadd_ps(r, y, q);
  const __m256 inf = _mm256_set1_ps(INFINITY);
  return _mm256_blendv_ps(q, inf, _mm256_cmp_ps(a, inf, _CMP_EQ_OQ));
}

__attribute__((target("avx2,fma"))) inline __m128i to_bf16_256(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  __m256i r = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  r = _mm256_add_epi32(_mm256_add_epi32(r, _mm256_set1_epi32(0x7fff)), bits);
  r = _mm256_srli_epi32(r, 16);
  const __m256i ordered = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_ORD_Q));
  r = _mm256_blendv_epi8(_mm256_set1_epi32(0xffff), r, ordered);
  // Values are at most 0xffff, so the unsigned saturating pack keeps them; it packs within
  // 128-bit lanes, so the two 64-bit halves are put back in order.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  return _mm256_castsi256_si128(packed);
}

__attribute__((target("avx2,fma,f16c"))) inline void store_out256(__m256 x, void* dst,
                                                                   int64_t kind) {
  if (kind == kBF16) {
    _mm_storeu_si128(static_cast<__m128i*>(dst), to_bf16_256(x));
  } else if (kind == kFP16) {
    _mm_storeu_si128(static_cast<__m128i*>(dst),
                     _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else if (kind == kFP32) {
    _mm256_storeu_ps(static_cast<float*>(dst), x);
  }
}

__attribute__((target("avx2,fma,f16c"))) void step256(
    const Consts& a, float* p, float* g, float* m, float* v, const Out& out, int64_t n) {
  const __m256 decay = _mm256_set1_ps(a.decay), wd = _mm256_set1_ps(a.weight_decay);
  const __m256 lw = _mm256_set1_ps(a.lerp_weight);
  const bool small = std::fabs(a.lerp_weight) < 0.5f;
  const __m256 coeff = small ? lw : _mm256_sub_ps(lw, _mm256_set1_ps(1.0f));
  const __m256 b2 = _mm256_set1_ps(a.beta2), c2 = _mm256_set1_ps(a.one_minus_beta2);
  const __m256 bs = _mm256_set1_ps(a.bias2_sqrt), bsi = _mm256_set1_ps(a.bias2_sqrt_inv);
  const __m256 eps = _mm256_set1_ps(a.eps), ns = _mm256_set1_ps(a.neg_step_size);
  auto update = [&](float* pp, float* gp, float* mp, float* vp, void* dst)
                    __attribute__((target("avx2,fma,f16c"))) {
    __m256 pv = _mm256_loadu_ps(pp), gv = _mm256_loadu_ps(gp);
    __m256 mv = _mm256_loadu_ps(mp), vv = _mm256_loadu_ps(vp);
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
    _mm256_storeu_ps(mp, mv);
    _mm256_storeu_ps(vp, vv);
    _mm256_storeu_ps(pp, pv);
    store_out256(pv, dst, out.kind);
  };
  unsigned char* o = static_cast<unsigned char*>(out.ptr);
  const int64_t size = out_size(out.kind);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    update(p + i, g + i, m + i, v + i, o == nullptr ? nullptr : o + i * size);
  }
  if (i < n) {
    Remainder r(p + i, g + i, m + i, v + i, n - i);
    update(r.p, r.g, r.m, r.v, r.out);
    r.store(p + i, m + i, v + i, out, i, n - i);
  }
}

// Elements [lo, hi) of the concatenation of all rows.
void step_range(const Consts* consts, int32_t isa, const int64_t (*table)[8], int64_t count,
                int64_t lo, int64_t hi) {
  int64_t start = 0;
  for (int64_t j = 0; j < count && start < hi; start += table[j][5], ++j) {
    const int64_t from = std::max(lo, start) - start;
    const int64_t to = std::min(hi, start + table[j][5]) - start;
    if (from >= to) continue;
    float* p = reinterpret_cast<float*>(table[j][0]) + from;
    float* g = reinterpret_cast<float*>(table[j][1]) + from;
    float* m = reinterpret_cast<float*>(table[j][2]) + from;
    float* v = reinterpret_cast<float*>(table[j][3]) + from;
    const int64_t kind = table[j][6] == 0 ? kNone : table[j][7];
    const Out out{kind == kNone ? nullptr
                                : reinterpret_cast<unsigned char*>(table[j][6]) +
                                      from * out_size(kind),
                  kind};
    if (isa >= 2) {
      step512(consts[j], p, g, m, v, out, to - from);
    } else {
      step256(consts[j], p, g, m, v, out, to - from);
    }
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

// One update of `count` rows. Row j of `table` holds the addresses of a param, grad, exp_avg and
// exp_avg_sq, of its step counter (a float32 scalar, or 0), the number of floats to update (any;
// the caller hands torch the last n % W elements of each whole tensor, W = torch's vector width,
// which torch computes in a scalar loop), and where to also write the updated parameters (0: no
// copy) in which type (1: bfloat16, 2: float16, 3: float32; converted as torch's vectorised
// conversions do). A row with a counter adds one to it first and uses its new value as the step
// (what torch.optim's fused Adam does); a row without one uses args->step. `isa`: 2 AVX-512,
// 1 AVX2. The elements of all rows are split into `threads` equal ranges (OpenMP: the runtime
// torch ships and loads, so these are torch's intra-op threads, already spinning after its
// last op).
void partita_adam_step(const PartitaAdamArgs* args, int32_t isa, int32_t threads,
                       const int64_t (*table)[8], int64_t count) {
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
  if (team == 1) {  // no parallel region at all: entering one costs even when it is serial
    step_range(consts.data(), isa, table, count, 0, total);
    return;
  }
  // The calling thread's MXCSR (denormal flushing, as torch.set_flush_denormal left it).
  const uint32_t mxcsr = _mm_getcsr();
#pragma omp parallel num_threads(team)
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
    step_range(consts.data(), isa, table, count, lo, hi);
    _mm_setcsr(saved);
  }
}


}  // extern "C"
