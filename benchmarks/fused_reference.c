/* Plain fused C reference for the softmin primitive (docs/DESIGN.md, Kernel primitive), float32, benchmarks only.
 *
 *   out_i = -eps * log sum_j exp(h_j - C(x_i, y_j) / eps),  C = |x - y| (p = 1) or |x - y|^2 / 2 (p = 2)
 *
 * The straightforward loop a C programmer writes first: one OpenMP thread per row range, per row a
 * buffer of M logits (O(M) memory per thread, never N x M), its max, then the sum of exp. y is given
 * transposed (yt: D x M) so the j loops vectorise; exp comes from the compiler's vector math library
 * under -O3 -march=native -ffast-math -fopenmp. It is the yardstick the compiled cpu kernel is measured
 * against in benchmarks/bench_primitives.py; it is not used by the package.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

void fused_softmin_f32(const float *x, const float *yt, const float *h, int64_t n, int64_t m, int64_t d, int p,
                       float eps, float *out) {
  const float inv_eps = 1.0f / eps;
#pragma omp parallel
  {
    float *l = (float *)malloc(sizeof(float) * (size_t)m);
    float *s = (float *)malloc(sizeof(float) * (size_t)m);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const float *xi = x + i * d;
      for (int64_t j = 0; j < m; ++j) s[j] = 0.0f;
      for (int64_t k = 0; k < d; ++k) {
        const float xk = xi[k];
        const float *yk = yt + k * m;
        for (int64_t j = 0; j < m; ++j) {
          const float diff = xk - yk[j];
          s[j] += diff * diff;
        }
      }
      float mx = -INFINITY;
      if (p == 1) {
        for (int64_t j = 0; j < m; ++j) {
          l[j] = h[j] - sqrtf(s[j]) * inv_eps;
          mx = l[j] > mx ? l[j] : mx;
        }
      } else {
        for (int64_t j = 0; j < m; ++j) {
          l[j] = h[j] - 0.5f * s[j] * inv_eps;
          mx = l[j] > mx ? l[j] : mx;
        }
      }
      float sum = 0.0f;
      for (int64_t j = 0; j < m; ++j) {
        const float t = l[j] - mx;
        sum += expf(t < -87.0f ? -87.0f : t); /* clamp: keep out of the slow underflow path */
      }
      out[i] = -eps * (mx + logf(sum));
    }
    free(l);
    free(s);
  }
}
