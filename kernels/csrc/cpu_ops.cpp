// Streaming CPU kernels for the SROT primitives (SPEC §4), loaded by kernels/cpu_ops.py via ctypes.
//
// Each thread owns a super-block of G * R rows and streams the columns in tiles of TJ; for each tile,
// each group of R rows gets its squared distances in the exact difference form (register-blocked over
// the R rows, SIMD over the tile), then one online log-sum-exp update (running max m, running sum s
// rescaled by exp(m_old - m_new)). The G groups reuse the y tile (TJ * d values) from L2 instead of
// re-reading all of y per R rows (2-3x at d = 64 once y outgrows L2). Memory: O(G R (TJ + d)) per
// thread, never N x M. Arguments of exp below -80 are flushed to 0 (exact
// enough: e^-80 ~ 1.8e-35 relative to the row maximum) to stay out of the slow denormal path.
//
// Layout: x (n, d) row-major, yt (d, ld) = y transposed with ld = m rounded up to a multiple of W (zero
// padding), h (m,); all contiguous.
// Plain C ABI (no torch headers) so the build takes a second; OpenMP for the rows.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int R = 8;     // rows per block (register blocking)
constexpr int TJ = 256;  // columns per tile (a multiple of W)
constexpr int W = 16;    // columns per register block (the y transpose is padded to a multiple of W)
constexpr int G = 8;     // groups of R rows per super-block (share each y tile while it sits in L2)
constexpr int RB = G * R;

template <typename T> struct Bits;
template <> struct Bits<float> { using I = int32_t; };
template <> struct Bits<double> { using I = int64_t; };

template <typename To, typename From> inline To bit_cast(From v) {
  To r;
  std::memcpy(&r, &v, sizeof(To));
  return r;
}

// exp(x) for x <= 0 (clamped at -80), 0 below -80; polynomial on [-ln2/2, ln2/2] times 2^n.
// Branch-free and inlinable so that `#pragma omp simd` loops vectorise it.
inline float exp_neg(float x) {
  const float xc = std::max(x, -80.0f);
  const float shifter = 12582912.0f;  // 1.5 * 2^23: rounds to nearest integer in the low mantissa bits
  const float k = xc * 1.44269504088896341f + shifter;
  const float n = k - shifter;
  float r = xc - n * 0.693145751953125f;
  r = r - n * 1.42860682030941723212e-6f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t ni = bit_cast<int32_t>(k) - bit_cast<int32_t>(shifter);
  const float scale = bit_cast<float>((ni + 127) << 23);
  return x < -80.0f ? 0.0f : p * scale;
}

inline double exp_neg(double x) {
  const double xc = std::max(x, -80.0);
  const double shifter = 6755399441055744.0;  // 1.5 * 2^52
  const double k = xc * 1.4426950408889634074 + shifter;
  const double n = k - shifter;
  double r = xc - n * 0.6931471803691238164902;
  r = r - n * 1.9082149292705877000e-10;
  double p = 1.0 / 479001600.0;  // Taylor to degree 12: |error| < 2e-16 on |r| <= ln2/2
  p = p * r + 1.0 / 39916800.0;
  p = p * r + 1.0 / 3628800.0;
  p = p * r + 1.0 / 362880.0;
  p = p * r + 1.0 / 40320.0;
  p = p * r + 1.0 / 5040.0;
  p = p * r + 1.0 / 720.0;
  p = p * r + 1.0 / 120.0;
  p = p * r + 1.0 / 24.0;
  p = p * r + 1.0 / 6.0;
  p = p * r + 0.5;
  p = p * r + 1.0;
  p = p * r + 1.0;
  const int64_t ni = bit_cast<int64_t>(k) - bit_cast<int64_t>(shifter);
  const double scale = bit_cast<double>((ni + 1023) << 52);
  return x < -80.0 ? 0.0 : p * scale;
}

// s[r][j] = |x_r - y_{j0+j}|^2 for the R rows in xb (R, d) and the columns j0 .. j0 + jn - 1 (jn <= TJ).
// yt has a row stride ld >= j0 + round_up(jn, W) (columns padded to a multiple of W): register blocking
// R x W, every y value loaded once per R rows, every x value broadcast once per W columns.
template <typename T>
inline void sq_dist_tile(const T* __restrict xb, const T* __restrict yt, int64_t ld, int64_t d, int64_t j0,
                         int jn, T (*__restrict s)[TJ]) {
  for (int jj = 0; jj < jn; jj += W) {
    T a[R][W];
    for (int r = 0; r < R; ++r)
      for (int w = 0; w < W; ++w) a[r][w] = T(0);
    for (int64_t k = 0; k < d; ++k) {
      const T* __restrict yk = yt + k * ld + j0 + jj;
      for (int r = 0; r < R; ++r) {
        const T xv = xb[r * d + k];
#pragma omp simd
        for (int w = 0; w < W; ++w) {
          const T diff = xv - yk[w];
          a[r][w] += diff * diff;
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int w = 0; w < W; ++w) s[r][jj + w] = a[r][w];
  }
}

// logits l = h - C / eps in place, C = sqrt(s) (p = 1) or s / 2 (p = 2); returns the max.
template <typename T>
inline T logits_row(T* __restrict s, const T* __restrict h, int jn, int p, T inv_eps) {
  if (p == 1) {
#pragma omp simd
    for (int j = 0; j < jn; ++j) s[j] = h[j] - std::sqrt(s[j]) * inv_eps;
  } else {
    const T c = T(0.5) * inv_eps;
#pragma omp simd
    for (int j = 0; j < jn; ++j) s[j] = h[j] - s[j] * c;
  }
  T mx = -std::numeric_limits<T>::infinity();
#pragma omp simd reduction(max : mx)
  for (int j = 0; j < jn; ++j) mx = mx > s[j] ? mx : s[j];
  return mx;
}

template <typename T> inline void load_rows(const T* x, int64_t n, int64_t d, int64_t i0, T* xb, int rows = R) {
  for (int r = 0; r < rows; ++r) {
    const int64_t i = std::min<int64_t>(i0 + r, n - 1);  // pad the last block with a copy of row n-1
    std::memcpy(xb + r * d, x + i * d, sizeof(T) * d);
  }
}

// number of R-row groups of the super-block starting at i0 that hold real rows
inline int groups_in(int64_t n, int64_t i0) { return (int)std::min<int64_t>(G, (n - i0 + R - 1) / R); }

template <typename T>
void softmin_impl(const T* x, const T* yt, const T* h, int64_t n, int64_t m, int64_t d, int p, double eps,
                  T* out, int nthreads) {
  const int64_t nb = (n + RB - 1) / RB;
  const int64_t ld = (m + W - 1) / W * W;  // row stride of yt
  const T inv_eps = T(1.0 / eps);
#pragma omp parallel num_threads(nthreads)
  {
    std::vector<T> xb(RB * d);
    alignas(64) T s[R][TJ];
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t i0 = b * RB;
      const int ng = groups_in(n, i0);
      load_rows(x, n, d, i0, xb.data(), ng * R);
      double mrow[RB], srow[RB];
      for (int r = 0; r < RB; ++r) {
        mrow[r] = -std::numeric_limits<double>::infinity();
        srow[r] = 0.0;
      }
      for (int64_t j0 = 0; j0 < m; j0 += TJ) {
        const int jn = (int)std::min<int64_t>(TJ, m - j0);
        for (int gi = 0; gi < ng; ++gi) {
          sq_dist_tile<T>(xb.data() + gi * R * d, yt, ld, d, j0, jn, s);
          for (int r = 0; r < R; ++r) {
            const int rr = gi * R + r;
            const T bm = logits_row<T>(s[r], h + j0, jn, p, inv_eps);
            if (!(bm > -std::numeric_limits<T>::infinity())) continue;  // tile fully masked (or NaN)
            const T mnew = std::max<T>((T)mrow[rr], bm);
            T acc = T(0);
#pragma omp simd reduction(+ : acc)
            for (int j = 0; j < jn; ++j) acc += exp_neg(s[r][j] - mnew);
            srow[rr] = srow[rr] * std::exp(mrow[rr] - (double)mnew) + (double)acc;
            mrow[rr] = mnew;
          }
        }
      }
      for (int r = 0; r < RB && i0 + r < n; ++r) {
        out[i0 + r] = srow[r] > 0.0 ? (T)(-eps * (mrow[r] + std::log(srow[r])))
                                    : std::numeric_limits<T>::infinity();
      }
    }
  }
}

// phi = 0: out_i = sum_j w_ij y_j ; phi = 1: out_i = sum_j w_ij (x_i - y_j) / |x_i - y_j| (0 if equal).
template <typename T>
void wmean_impl(const T* x, const T* yt, const T* h, int64_t n, int64_t m, int64_t d, int p, double eps,
                int phi, T* out, int nthreads) {
  const int64_t nb = (n + RB - 1) / RB;
  const int64_t ld = (m + W - 1) / W * W;  // row stride of yt
  const T inv_eps = T(1.0 / eps);
#pragma omp parallel num_threads(nthreads)
  {
    std::vector<T> xb(RB * d);
    std::vector<double> acc(RB * d);
    alignas(64) T s[R][TJ];
    alignas(64) T invr[TJ];
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t i0 = b * RB;
      const int ng = groups_in(n, i0);
      load_rows(x, n, d, i0, xb.data(), ng * R);
      std::fill(acc.begin(), acc.end(), 0.0);
      double mrow[RB], srow[RB];
      for (int r = 0; r < RB; ++r) {
        mrow[r] = -std::numeric_limits<double>::infinity();
        srow[r] = 0.0;
      }
      for (int64_t j0 = 0; j0 < m; j0 += TJ) {
        const int jn = (int)std::min<int64_t>(TJ, m - j0);
        for (int gi = 0; gi < ng; ++gi) {
          sq_dist_tile<T>(xb.data() + gi * R * d, yt, ld, d, j0, jn, s);
          for (int r = 0; r < R; ++r) {
            const int rr = gi * R + r;
            T* sr = s[r];
            if (phi == 1) {
#pragma omp simd
              for (int j = 0; j < jn; ++j) invr[j] = sr[j] > T(0) ? T(1) / std::sqrt(sr[j]) : T(0);
            }
            const T bm = logits_row<T>(sr, h + j0, jn, p, inv_eps);
            if (!(bm > -std::numeric_limits<T>::infinity())) continue;
            const T mnew = std::max<T>((T)mrow[rr], bm);
            T tot = T(0);
#pragma omp simd reduction(+ : tot)
            for (int j = 0; j < jn; ++j) {
              sr[j] = exp_neg(sr[j] - mnew);  // weights
              tot += sr[j];
            }
            const double alpha = std::exp(mrow[rr] - (double)mnew);
            srow[rr] = srow[rr] * alpha + (double)tot;
            mrow[rr] = mnew;
            double* ar = acc.data() + rr * d;
            const T* xr = xb.data() + rr * d;
            if (phi == 1) {
#pragma omp simd
              for (int j = 0; j < jn; ++j) sr[j] *= invr[j];
            }
            for (int64_t k = 0; k < d; ++k) {
              const T* yk = yt + k * ld + j0;
              T t = T(0);
              if (phi == 0) {
#pragma omp simd reduction(+ : t)
                for (int j = 0; j < jn; ++j) t += sr[j] * yk[j];
              } else {
                const T xv = xr[k];
#pragma omp simd reduction(+ : t)
                for (int j = 0; j < jn; ++j) t += sr[j] * (xv - yk[j]);
              }
              ar[k] = ar[k] * alpha + (double)t;
            }
          }
        }
      }
      for (int r = 0; r < RB && i0 + r < n; ++r) {
        const double inv = 1.0 / srow[r];  // inf -> NaN output for a fully masked row, as the reference
        for (int64_t k = 0; k < d; ++k) out[(i0 + r) * d + k] = (T)(acc[r * d + k] * inv);
      }
    }
  }
}

template <typename T>
void argmax_impl(const T* x, const T* yt, const T* h, int64_t n, int64_t m, int64_t d, int p, double eps,
                 int64_t* out, int nthreads) {
  const int64_t nb = (n + R - 1) / R;
  const int64_t ld = (m + W - 1) / W * W;  // row stride of yt
  const T inv_eps = T(1.0 / eps);
#pragma omp parallel num_threads(nthreads)
  {
    std::vector<T> xb(R * d);
    alignas(64) T s[R][TJ];
#pragma omp for schedule(dynamic, 4)
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t i0 = b * R;
      load_rows(x, n, d, i0, xb.data());
      T best[R];
      int64_t arg[R];
      for (int r = 0; r < R; ++r) {
        best[r] = -std::numeric_limits<T>::infinity();
        arg[r] = 0;
      }
      for (int64_t j0 = 0; j0 < m; j0 += TJ) {
        const int jn = (int)std::min<int64_t>(TJ, m - j0);
        sq_dist_tile<T>(xb.data(), yt, ld, d, j0, jn, s);
        for (int r = 0; r < R; ++r) {
          const T bm = logits_row<T>(s[r], h + j0, jn, p, inv_eps);
          if (bm > best[r]) {  // strict: the first maximal index wins, as torch.argmax
            int j = 0;
            while (s[r][j] != bm) ++j;
            best[r] = bm;
            arg[r] = j0 + j;
          }
        }
      }
      for (int r = 0; r < R && i0 + r < n; ++r) out[i0 + r] = arg[r];
    }
  }
}

template <typename T>
double max_sq_impl(const T* x, const T* yt, int64_t n, int64_t m, int64_t d, int nthreads) {
  const int64_t nb = (n + R - 1) / R;
  const int64_t ld = (m + W - 1) / W * W;  // row stride of yt
  double result = 0.0;
#pragma omp parallel num_threads(nthreads) reduction(max : result)
  {
    std::vector<T> xb(R * d);
    alignas(64) T s[R][TJ];
#pragma omp for schedule(dynamic, 4)
    for (int64_t b = 0; b < nb; ++b) {
      load_rows(x, n, d, b * R, xb.data());
      for (int64_t j0 = 0; j0 < m; j0 += TJ) {
        const int jn = (int)std::min<int64_t>(TJ, m - j0);
        sq_dist_tile<T>(xb.data(), yt, ld, d, j0, jn, s);
        for (int r = 0; r < R; ++r) {
          T mx = T(0);
#pragma omp simd reduction(max : mx)
          for (int j = 0; j < jn; ++j) mx = std::max(mx, s[r][j]);
          result = std::max(result, (double)mx);
        }
      }
    }
  }
  return result;
}

}  // namespace

extern "C" {

int srot_abi_version() { return 1; }

#define SROT_DEFINE(T, SUF)                                                                                 \
  void srot_softmin_##SUF(const T* x, const T* yt, const T* h, int64_t n, int64_t m, int64_t d, int p,    \
                          double eps, T* out, int nthreads) {                                              \
    softmin_impl<T>(x, yt, h, n, m, d, p, eps, out, nthreads);                                             \
  }                                                                                                        \
  void srot_wmean_##SUF(const T* x, const T* yt, const T* h, int64_t n, int64_t m, int64_t d, int p,      \
                        double eps, int phi, T* out, int nthreads) {                                       \
    wmean_impl<T>(x, yt, h, n, m, d, p, eps, phi, out, nthreads);                                          \
  }                                                                                                        \
  void srot_argmax_##SUF(const T* x, const T* yt, const T* h, int64_t n, int64_t m, int64_t d, int p,     \
                         double eps, int64_t* out, int nthreads) {                                         \
    argmax_impl<T>(x, yt, h, n, m, d, p, eps, out, nthreads);                                              \
  }                                                                                                        \
  double srot_max_sq_##SUF(const T* x, const T* yt, int64_t n, int64_t m, int64_t d, int nthreads) {      \
    return max_sq_impl<T>(x, yt, n, m, d, nthreads);                                                       \
  }

SROT_DEFINE(float, f32)
SROT_DEFINE(double, f64)

}  // extern "C"
