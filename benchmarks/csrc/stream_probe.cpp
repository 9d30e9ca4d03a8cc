// Memory-bandwidth probe for bench_offload.py part (b): the data movement of one Adam step on
// flat fp32 tensors (read param, grad, exp_avg and exp_avg_sq; write param, exp_avg and
// exp_avg_sq) with next to no arithmetic, on `threads` OpenMP threads (torch's runtime, as the
// kernels it is compared with). No Adam step can move this data faster, so it is the ceiling
// for the step's throughput on data that does not fit in cache.
#include <cstdint>

extern "C" void partita_stream_probe(float* p, const float* g, float* m, float* v, int64_t n,
                                     int32_t threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float x = g[i];
    p[i] += x;
    m[i] += x;
    v[i] += x;
  }
}
