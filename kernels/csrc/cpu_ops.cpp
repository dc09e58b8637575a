// Streaming CPU kernels for the SROT primitives (docs/DESIGN.md, Kernel primitive), loaded by
// kernels/cpu_ops.py via ctypes.
//
// A task is one super-block of G * R rows of one problem of the batch; OpenMP hands out the tasks of the
// whole batch. A task streams the columns in tiles of TJ; for each tile, each group of R rows gets its
// squared distances in the exact difference form (register-blocked over the R rows, SIMD over the tile),
// then the primitive's update (for softmin: one online log-sum-exp step, running max m, running sum s
// rescaled by exp(m_old - m_new)). The G groups reuse the y tile (TJ * d values) from L2 instead of
// re-reading all of y per R rows (matters at large d once y outgrows L2). One driver (drive) runs this
// loop for the four primitives, each a struct with begin / tile / end callbacks. Memory: O(G R (TJ + d))
// per thread, never N x M. Arguments of exp below -80 are flushed to 0 (exact enough: e^-80 ~ 1.8e-35
// relative to the row maximum) to stay out of the slow denormal path.
//
// Layout of problem b: x + b * sx (n, d) row-major, yt + b * syt (d, ld) = y transposed with ld = m
// rounded up to a multiple of W (zero padding), h + b * sh (m,).
// Plain C ABI (no torch headers) so the build is quick.
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

template <typename T> inline void load_rows(const T* x, int64_t n, int64_t d, int64_t i0, T* xb, int rows) {
  for (int r = 0; r < rows; ++r) {
    const int64_t i = std::min<int64_t>(i0 + r, n - 1);  // pad the last block with a copy of row n-1
    std::memcpy(xb + r * d, x + i * d, sizeof(T) * d);
  }
}

// A batch of problems: problem b has x + b * sx (n, d), yt + b * syt (d, ld), h + b * sh (m,).
template <typename T> struct Batch {
  const T* x;
  const T* yt;
  const T* h;  // nullptr for max_sq
  int64_t nbatch, n, m, d, sx, syt, sh;
};

// The loop shared by the four primitives. A task is (problem b, super-block of Prim::kGroups * R rows
// starting at i0); OpenMP hands out tasks dynamically, Prim::kChunk at a time. For each column tile of
// the task, every group of R rows gets its squared distances s (R x jn) from sq_dist_tile and hands them
// to prim.tile; prim.begin / prim.end open and close a task, prim.merge runs once per thread at the end.
// Prim is copied per thread (its members are the per-thread state).
template <typename T, typename Prim> void drive(const Batch<T>& bt, const Prim& proto, int nthreads) {
  constexpr int rb = Prim::kGroups * R;
  const int64_t nblocks = (bt.n + rb - 1) / rb;
  const int64_t ntasks = bt.nbatch * nblocks;
  const int64_t ld = (bt.m + W - 1) / W * W;  // row stride of yt
  const int64_t d = bt.d;
  if (ntasks == 0) return;
#pragma omp parallel num_threads(nthreads)
  {
    Prim prim(proto);
    prim.setup(d);
    std::vector<T> xb(rb * d);
    alignas(64) T s[R][TJ];
#pragma omp for schedule(dynamic, Prim::kChunk)
    for (int64_t t = 0; t < ntasks; ++t) {
      const int64_t b = t / nblocks;
      const int64_t i0 = (t - b * nblocks) * rb;
      const T* yt = bt.yt + b * bt.syt;
      const T* h = bt.h ? bt.h + b * bt.sh : nullptr;
      const int ng = (int)std::min<int64_t>(Prim::kGroups, (bt.n - i0 + R - 1) / R);  // groups with real rows
      load_rows(bt.x + b * bt.sx, bt.n, d, i0, xb.data(), ng * R);
      prim.begin();
      for (int64_t j0 = 0; j0 < bt.m; j0 += TJ) {
        const int jn = (int)std::min<int64_t>(TJ, bt.m - j0);
        for (int gi = 0; gi < ng; ++gi) {
          const T* xg = xb.data() + gi * R * d;
          sq_dist_tile<T>(xg, yt, ld, d, j0, jn, s);
          prim.tile(gi * R, s, xg, yt + j0, ld, d, h ? h + j0 : nullptr, j0, jn);
        }
      }
      prim.end(b, i0, (int)std::min<int64_t>(rb, bt.n - i0));
    }
    prim.merge();
  }
}

// Online log-sum-exp state of the rows of one task: running max m and sum s rescaled by exp(m_old - m_new).
template <typename T> struct LseRows {
  int p;
  T inv_eps;
  double mrow[G * R], srow[G * R];
  void reset() {
    for (int r = 0; r < G * R; ++r) {
      mrow[r] = -std::numeric_limits<double>::infinity();
      srow[r] = 0.0;
    }
  }
};

// out_i = -eps * LSE_j (h_j - C_ij / eps), +inf for a row whose h is all -inf.
template <typename T> struct Softmin : LseRows<T> {
  static constexpr int kGroups = G, kChunk = 1;
  double eps;
  T* out;
  int64_t sout;
  void setup(int64_t) {}
  void begin() { this->reset(); }
  void tile(int r0, T (*__restrict s)[TJ], const T*, const T*, int64_t, int64_t, const T* __restrict h, int64_t,
            int jn) {
    for (int r = 0; r < R; ++r) {
      const int rr = r0 + r;
      const T bm = logits_row<T>(s[r], h, jn, this->p, this->inv_eps);
      if (!(bm > -std::numeric_limits<T>::infinity())) continue;  // tile fully masked (or NaN)
      const T mnew = std::max<T>((T)this->mrow[rr], bm);
      T acc = T(0);
#pragma omp simd reduction(+ : acc)
      for (int j = 0; j < jn; ++j) acc += exp_neg(s[r][j] - mnew);
      this->srow[rr] = this->srow[rr] * std::exp(this->mrow[rr] - (double)mnew) + (double)acc;
      this->mrow[rr] = mnew;
    }
  }
  void end(int64_t b, int64_t i0, int rows) {
    T* o = out + b * sout + i0;
    for (int r = 0; r < rows; ++r)
      o[r] = this->srow[r] > 0.0 ? (T)(-eps * (this->mrow[r] + std::log(this->srow[r])))
                                 : std::numeric_limits<T>::infinity();
  }
  void merge() {}
};

// phi = 0: out_i = sum_j w_ij y_j ; phi = 1: out_i = sum_j w_ij (x_i - y_j) / |x_i - y_j| (0 if equal),
// w_ij = softmax_j (h_j - C_ij / eps); NaN for a row whose h is all -inf.
template <typename T> struct WMean : LseRows<T> {
  static constexpr int kGroups = G, kChunk = 1;
  int phi;
  T* out;
  int64_t sout, d = 0;
  std::vector<double> acc;  // (G R, d) running weighted sums
  alignas(64) T invr[TJ];
  void setup(int64_t dd) {
    d = dd;
    acc.assign(G * R * d, 0.0);
  }
  void begin() {
    this->reset();
    std::fill(acc.begin(), acc.end(), 0.0);
  }
  void tile(int r0, T (*__restrict s)[TJ], const T* __restrict xg, const T* __restrict ytj, int64_t ld, int64_t,
            const T* __restrict h, int64_t, int jn) {
    for (int r = 0; r < R; ++r) {
      const int rr = r0 + r;
      T* sr = s[r];
      if (phi == 1) {
#pragma omp simd
        for (int j = 0; j < jn; ++j) invr[j] = sr[j] > T(0) ? T(1) / std::sqrt(sr[j]) : T(0);
      }
      const T bm = logits_row<T>(sr, h, jn, this->p, this->inv_eps);
      if (!(bm > -std::numeric_limits<T>::infinity())) continue;
      const T mnew = std::max<T>((T)this->mrow[rr], bm);
      T tot = T(0);
#pragma omp simd reduction(+ : tot)
      for (int j = 0; j < jn; ++j) {
        sr[j] = exp_neg(sr[j] - mnew);  // weights
        tot += sr[j];
      }
      const double alpha = std::exp(this->mrow[rr] - (double)mnew);
      this->srow[rr] = this->srow[rr] * alpha + (double)tot;
      this->mrow[rr] = mnew;
      double* ar = acc.data() + rr * d;
      const T* xr = xg + r * d;
      if (phi == 1) {
#pragma omp simd
        for (int j = 0; j < jn; ++j) sr[j] *= invr[j];
      }
      for (int64_t k = 0; k < d; ++k) {
        const T* yk = ytj + k * ld;
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
  void end(int64_t b, int64_t i0, int rows) {
    T* o = out + b * sout + i0 * d;
    for (int r = 0; r < rows; ++r) {
      const double inv = 1.0 / this->srow[r];  // inf -> NaN output for a fully masked row, as the reference
      for (int64_t k = 0; k < d; ++k) o[r * d + k] = (T)(acc[r * d + k] * inv);
    }
  }
  void merge() {}
};

// out_i = argmax_j (h_j - C_ij / eps), the first maximal index (as torch.argmax); 0 if h is all -inf.
template <typename T> struct Argmax {
  static constexpr int kGroups = 1, kChunk = 4;
  int p;
  T inv_eps;
  int64_t* out;
  int64_t sout;
  T best[R];
  int64_t arg[R];
  void setup(int64_t) {}
  void begin() {
    for (int r = 0; r < R; ++r) {
      best[r] = -std::numeric_limits<T>::infinity();
      arg[r] = 0;
    }
  }
  void tile(int, T (*__restrict s)[TJ], const T*, const T*, int64_t, int64_t, const T* __restrict h, int64_t j0,
            int jn) {
    for (int r = 0; r < R; ++r) {
      const T bm = logits_row<T>(s[r], h, jn, p, inv_eps);
      if (bm > best[r]) {  // strict: the first maximal index wins
        int j = 0;
        while (s[r][j] != bm) ++j;
        best[r] = bm;
        arg[r] = j0 + j;
      }
    }
  }
  void end(int64_t b, int64_t i0, int rows) {
    for (int r = 0; r < rows; ++r) out[b * sout + i0 + r] = arg[r];
  }
  void merge() {}
};

// out[b] = max_ij |x_i - y_j|^2 of problem b (out zeroed by the caller); per-thread maxima merged at the end.
template <typename T> struct MaxSq {
  static constexpr int kGroups = 1, kChunk = 4;
  double* out;
  int64_t nbatch;
  std::vector<double> local;
  double cur = 0.0;
  void setup(int64_t) { local.assign(nbatch, 0.0); }
  void begin() { cur = 0.0; }
  void tile(int, T (*__restrict s)[TJ], const T*, const T*, int64_t, int64_t, const T*, int64_t, int jn) {
    for (int r = 0; r < R; ++r) {
      T mx = T(0);
#pragma omp simd reduction(max : mx)
      for (int j = 0; j < jn; ++j) mx = std::max(mx, s[r][j]);
      cur = std::max(cur, (double)mx);
    }
  }
  void end(int64_t b, int64_t, int) { local[b] = std::max(local[b], cur); }
  void merge() {
#pragma omp critical(srot_max_sq)
    for (int64_t b = 0; b < nbatch; ++b) out[b] = std::max(out[b], local[b]);
  }
};

}  // namespace

extern "C" {

// Version of the entry points below; the loader refuses a library whose version differs from its own.
int srot_abi_version() { return 2; }

// Every entry point takes a batch of nbatch problems of the same sizes (n, m, d): problem b reads
// x + b * sx (n, d) row-major, yt + b * syt (d, ld) = y transposed with ld = m rounded up to a multiple of
// W (zero padding), h + b * sh (m,), and writes out + b * sout. Strides are in elements.
#define SROT_DEFINE(T, SUF)                                                                                 \
  void srot_softmin_##SUF(const T* x, const T* yt, const T* h, int64_t nbatch, int64_t n, int64_t m,       \
                          int64_t d, int64_t sx, int64_t syt, int64_t sh, int p, double eps, T* out,       \
                          int64_t sout, int nthreads) {                                                    \
    Softmin<T> prim;                                                                                       \
    prim.p = p;                                                                                            \
    prim.inv_eps = T(1.0 / eps);                                                                           \
    prim.eps = eps;                                                                                        \
    prim.out = out;                                                                                        \
    prim.sout = sout;                                                                                      \
    drive<T>(Batch<T>{x, yt, h, nbatch, n, m, d, sx, syt, sh}, prim, nthreads);                           \
  }                                                                                                        \
  void srot_wmean_##SUF(const T* x, const T* yt, const T* h, int64_t nbatch, int64_t n, int64_t m,         \
                        int64_t d, int64_t sx, int64_t syt, int64_t sh, int p, double eps, int phi, T* out, \
                        int64_t sout, int nthreads) {                                                      \
    WMean<T> prim;                                                                                         \
    prim.p = p;                                                                                            \
    prim.inv_eps = T(1.0 / eps);                                                                           \
    prim.phi = phi;                                                                                        \
    prim.out = out;                                                                                        \
    prim.sout = sout;                                                                                      \
    drive<T>(Batch<T>{x, yt, h, nbatch, n, m, d, sx, syt, sh}, prim, nthreads);                           \
  }                                                                                                        \
  void srot_argmax_##SUF(const T* x, const T* yt, const T* h, int64_t nbatch, int64_t n, int64_t m,        \
                         int64_t d, int64_t sx, int64_t syt, int64_t sh, int p, double eps, int64_t* out,  \
                         int64_t sout, int nthreads) {                                                     \
    Argmax<T> prim;                                                                                        \
    prim.p = p;                                                                                            \
    prim.inv_eps = T(1.0 / eps);                                                                           \
    prim.out = out;                                                                                        \
    prim.sout = sout;                                                                                      \
    drive<T>(Batch<T>{x, yt, h, nbatch, n, m, d, sx, syt, sh}, prim, nthreads);                           \
  }                                                                                                        \
  void srot_max_sq_##SUF(const T* x, const T* yt, int64_t nbatch, int64_t n, int64_t m, int64_t d,         \
                         int64_t sx, int64_t syt, double* out, int nthreads) {                             \
    MaxSq<T> prim;                                                                                         \
    prim.out = out;                                                                                        \
    prim.nbatch = nbatch;                                                                                  \
    drive<T>(Batch<T>{x, yt, nullptr, nbatch, n, m, d, sx, syt, 0}, prim, nthreads);                      \
  }

SROT_DEFINE(float, f32)
SROT_DEFINE(double, f64)

}  // extern "C"
