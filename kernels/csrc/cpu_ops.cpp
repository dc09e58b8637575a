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
// The same driver streams the block-sparse passes of kernels/blocksparse.py: there a task sees only the column
// ranges that the block pruning (srot_bs_prune, at the end of this file) kept for its row block.
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
// Branch-free and inlinable so that `#pragma omp simd` loops vectorise it. float: a degree-6 polynomial fitted
// to the relative error on that interval (max 9.9e-8 in float32 Horner form, 7.5e-8 with fused multiply-adds;
// the degree-7 Taylor polynomial: 8.9e-8 and 6.5e-8, one multiply-add more); double: Taylor to degree 12.
inline float exp_neg(float x) {
  const float xc = std::max(x, -80.0f);
  const float shifter = 12582912.0f;  // 1.5 * 2^23: rounds to nearest integer in the low mantissa bits
  const float k = xc * 1.44269504088896341f + shifter;
  const float n = k - shifter;
  float r = xc - n * 0.693145751953125f;
  r = r - n * 1.42860682030941723212e-6f;
  float p = 1.3836845755577087e-3f;
  p = p * r + 8.374815806746483e-3f;
  p = p * r + 4.166822507977486e-2f;
  p = p * r + 1.6666419804096222e-1f;
  p = p * r + 4.9999991059303284e-1f;
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
  T mx = -std::numeric_limits<T>::infinity();
  if (p == 1) {
#pragma omp simd reduction(max : mx)
    for (int j = 0; j < jn; ++j) {
      const T l = h[j] - std::sqrt(s[j]) * inv_eps;
      s[j] = l;
      mx = mx > l ? mx : l;
    }
  } else {
    const T c = T(0.5) * inv_eps;
#pragma omp simd reduction(max : mx)
    for (int j = 0; j < jn; ++j) {
      const T l = h[j] - s[j] * c;
      s[j] = l;
      mx = mx > l ? mx : l;
    }
  }
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

// Column sources of drive: every task of the dense pass sees all the columns [0, m); a task of a block-sparse
// pass (kernels/blocksparse.py) sees the column ranges [rng[2k], rng[2k+1]) for k in [offs[t], offs[t+1]).
struct AllCols {
  int64_t m;
  int64_t first(int64_t) const { return 0; }
  int64_t last(int64_t) const { return 1; }
  int64_t lo(int64_t) const { return 0; }
  int64_t hi(int64_t) const { return m; }
};
struct RangeCols {
  const int64_t* offs;
  const int64_t* rng;
  int64_t first(int64_t t) const { return offs[t]; }
  int64_t last(int64_t t) const { return offs[t + 1]; }
  int64_t lo(int64_t k) const { return rng[2 * k]; }
  int64_t hi(int64_t k) const { return rng[2 * k + 1]; }
};

// The loop shared by the four primitives. A task is (problem b, super-block of rb rows starting at i0), with
// rb = Prim::kGroups * R for the dense pass and RB for a block-sparse one; OpenMP hands out tasks dynamically,
// Prim::kChunk at a time. For each column tile of each column range of the task, every group of R rows gets
// its squared distances s (R x jn) from sq_dist_tile and hands them to prim.tile; prim.begin / prim.end open
// and close a task, prim.merge runs once per thread at the end. Prim is copied per thread (its members are the
// per-thread state). ld is the row stride of yt (>= every column range end rounded up to W).
template <typename T, typename Prim, typename Cols>
void drive(const Batch<T>& bt, int64_t ld, int rb, const Cols& cols, const Prim& proto, int nthreads) {
  const int64_t nblocks = (bt.n + rb - 1) / rb;
  const int64_t ntasks = bt.nbatch * nblocks;
  const int64_t d = bt.d;
  const int groups = rb / R;
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
      const int ng = (int)std::min<int64_t>(groups, (bt.n - i0 + R - 1) / R);  // groups with real rows
      load_rows(bt.x + b * bt.sx, bt.n, d, i0, xb.data(), ng * R);
      prim.begin();
      for (int64_t k = cols.first(t); k < cols.last(t); ++k) {
        const int64_t jend = cols.hi(k);
        for (int64_t j0 = cols.lo(k); j0 < jend; j0 += TJ) {
          const int jn = (int)std::min<int64_t>(TJ, jend - j0);
          for (int gi = 0; gi < ng; ++gi) {
            const T* xg = xb.data() + gi * R * d;
            sq_dist_tile<T>(xg, yt, ld, d, j0, jn, s);
            prim.tile(gi * R, s, xg, yt + j0, ld, d, h ? h + j0 : nullptr, j0, jn);
          }
        }
      }
      prim.end(b, i0, (int)std::min<int64_t>(rb, bt.n - i0));
    }
    prim.merge();
  }
}

template <typename T, typename Prim> void drive_dense(const Batch<T>& bt, const Prim& proto, int nthreads) {
  drive<T>(bt, (bt.m + W - 1) / W * W, Prim::kGroups * R, AllCols{bt.m}, proto, nthreads);
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

// out_i = argmax_j (h_j - C_ij / eps), the first maximal index (as torch.argmax); `none` (0 for the dense pass)
// if h is all -inf or the row has no column.
template <typename T> struct Argmax {
  static constexpr int kGroups = 1, kChunk = 4;
  int p;
  T inv_eps;
  int64_t* out;
  int64_t sout;
  int64_t none = 0;
  T best[G * R];
  int64_t arg[G * R];
  void setup(int64_t) {}
  void begin() {
    for (int r = 0; r < G * R; ++r) {
      best[r] = -std::numeric_limits<T>::infinity();
      arg[r] = none;
    }
  }
  void tile(int r0, T (*__restrict s)[TJ], const T*, const T*, int64_t, int64_t, const T* __restrict h,
            int64_t j0, int jn) {
    for (int r = 0; r < R; ++r) {
      const T bm = logits_row<T>(s[r], h, jn, p, inv_eps);
      if (bm > best[r0 + r]) {  // strict: the first maximal index wins
        int j = 0;
        while (s[r][j] != bm) ++j;
        best[r0 + r] = bm;
        arg[r0 + r] = j0 + j;
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

// ------------------------------------------------------------------------------------- block pruning
// Blocks of a block-sparse pass (kernels/blocksparse.py): the points of each problem are sorted along a
// space-filling curve and cut into blocks of RB consecutive points with bounding boxes lo, hi (nblk, d);
// KS consecutive blocks form a super-block. For a pair of boxes, gap2 / far2 are the smallest / largest
// squared distance between a point of one box and a point of the other.
constexpr int KS = 16;

inline void box_pair(const double* alo, const double* ahi, const double* blo, const double* bhi, int64_t d,
                     double& gap2, double& far2) {
  double g = 0.0, f = 0.0;
  for (int64_t k = 0; k < d; ++k) {
    const double gk = std::max(0.0, std::max(blo[k] - ahi[k], alo[k] - bhi[k]));
    const double fk = std::max(bhi[k] - alo[k], ahi[k] - blo[k]);
    g += gk * gk;
    f += fk * fk;
  }
  gap2 = g;
  far2 = f;
}

// Bounds of one pair of boxes A (rows), B (columns of block j). LSE mode: every row x in A has
//   LSE_{j in B}[h_j - C(x, y_j) / eps] >= lo = lse_j - C(far) / eps   and   <= up = lse_j - C(gap) / eps,
// and, at p = 2 with a linear trend (top, beta) of h on B (LSE_{j in B} [h_j - beta_j . (y_j - c)] <= top_j, c the
// centre of B), also <= top_j + max_{x in A, y in B} [beta_j . (y - c) - |x - y|^2 / (2 eps)], which is separable per
// coordinate and much tighter when h varies across the block (h = log b + g / eps with a potential g: the
// trend of g and that of the cost cancel near the transport target). Max-cost mode (lse == nullptr): the
// pair's largest squared distance lies in [lo, up] = [gap2, far2].
struct PairBounds {
  const double* lse;   // nullptr: max-cost mode
  const double* top;   // nullptr: no trend bound
  const double* beta;  // (nblk, d)
  int p;
  double eps;
  void operator()(const double* alo, const double* ahi, const double* blo, const double* bhi, int64_t d,
                  int64_t j, double& lo, double& up) const {
    double gap2, far2;
    box_pair(alo, ahi, blo, bhi, d, gap2, far2);
    if (lse == nullptr) {
      lo = gap2;
      up = far2;
      return;
    }
    const double cg = p == 1 ? std::sqrt(gap2) : 0.5 * gap2, cf = p == 1 ? std::sqrt(far2) : 0.5 * far2;
    lo = lse[j] - cf / eps;
    up = lse[j] - cg / eps;
    if (top == nullptr || p != 2 || !(up > -std::numeric_limits<double>::infinity())) return;
    double t = top[j];
    for (int64_t k = 0; k < d; ++k) {
      const double bk = beta[j * d + k], c = 0.5 * (blo[k] + bhi[k]);
      if (bk == 0.0) {  // max of -dist(y, [alo, ahi])^2 / (2 eps) over [blo, bhi]: the squared gap
        const double gk = std::max(0.0, std::max(blo[k] - ahi[k], alo[k] - bhi[k]));
        t -= 0.5 * gk * gk / eps;
        continue;
      }
      // concave in y: the unconstrained maximiser (ahi + eps bk, or alo + eps bk), clamped to [blo, bhi]
      const double yk = std::min(bhi[k], std::max(blo[k], (bk > 0.0 ? ahi[k] : alo[k]) + eps * bk));
      const double dk = std::max(0.0, std::max(yk - ahi[k], alo[k] - yk));
      t += bk * (yk - c) - 0.5 * dk * dk / eps;
    }
    up = std::min(up, t);
  }
};

// The kept column blocks of every row block, in two levels. Level 1, per row super-block S: the bound
// L_S = max(max_T lo(S, T), min_{I in S} max_J lo(I, J)) over the column super-blocks T and the blocks J of the
// four T of largest up(S, T) (the second term matters when S is wide against eps); T is kept if
// up(S, T) >= L_S + slack1. Level 2, per row block I of S: L_I = max(L_S, max_J lo(I, J)) over the blocks J of
// the kept T; J is kept if up(I, J) >= L_I + slack2. Runs of consecutive kept J become one column range. In
// LSE mode L_I is a lower bound of every row's LSE, and slack_k = log(thr / 2) - log(#candidates of level k),
// so the dropped terms of a row sum to at most thr times the row's sum; in max-cost mode the slacks are 0 and
// L_S is a lower bound of the problem's largest squared distance, so no dropped pair holds it.
struct Pruned {
  std::vector<int64_t> count;  // ranges per row block of the super-block
  std::vector<int64_t> rng;    // (start, end) column pairs
  double kept = 0.0;           // row-column pairs kept
};

// Boxes of one level of one problem: lo, hi (nblk, d).
struct Boxes {
  const double* lo;
  const double* hi;
  const double* l(int64_t i, int64_t d) const { return lo + i * d; }
  const double* h(int64_t i, int64_t d) const { return hi + i * d; }
};

// max over x in [alo, ahi], y in [blo, bhi] of b (y - cb) - a (x - ca) - (x - y)^2 / (2 eps): for fixed x the best
// y is x + eps b clamped to [blo, bhi]; the resulting function of x is concave, so its maximum is at an end of
// [alo, ahi] or at a breakpoint or stationary point of one of its three pieces (x = blo, bhi - eps b; blo, bhi -
// eps a), clamped.
inline double pair_max(double alo, double ahi, double ca, double a, double blo, double bhi, double cb, double b,
                       double eps) {
  const double cand[6] = {alo, ahi, blo - eps * b, bhi - eps * b, blo - eps * a, bhi - eps * a};
  double best = -std::numeric_limits<double>::infinity();
  for (double x : cand) {
    x = std::min(ahi, std::max(alo, x));
    const double y = std::min(bhi, std::max(blo, x + eps * b)), dd = x - y;
    best = std::max(best, b * (y - cb) - a * (x - ca) - 0.5 * dd * dd / eps);
  }
  return best;
}

// Row bounds (kernels/blocksparse.py, optional, LSE mode): lrow (nrb,) a lower bound of every row's LSE per row
// block (the smallest over its rows of the exact LSE over a subset of the columns); at p = 2 also a linear one,
// LSE_i >= lrow0_I + alpha_I . (x_i - c_I) (c_I the box centre), which follows the rows' own trend across a block
// that is wide against eps; a column block J is then also dropped for I when
// min(top_J + max_{x in I, y in J}[beta_J . (y - c_J) - alpha_I . (x - c_I) - |x - y|^2 / (2 eps)],
//     lse_J + the same with beta = 0) < lrow0_I + slack. best (nrb, NBEST), optional output: per row block the
// NBEST candidate column blocks of largest up (-1 where fewer), the subset worth taking for lrow.
constexpr int NBEST = 4;
struct RowBounds {
  const double* lrow = nullptr;
  const double* lrow0 = nullptr;
  const double* alpha = nullptr;  // (nrb, d)
  int64_t* best = nullptr;
};

void prune_task(int64_t s, Boxes rb, Boxes rs, int64_t nrb, Boxes cb, Boxes cs, int64_t ncb, int64_t nct,
                int64_t n, int64_t m, int64_t d, const PairBounds& bnd, const PairBounds& sbnd, double slack1,
                double slack2, const RowBounds& rows, Pruned& out) {
  const double* lrow = rows.lrow;
  int64_t* best = rows.best;
  const bool row_trend = rows.alpha != nullptr && bnd.top != nullptr && bnd.p == 2;
  const double ninf = -std::numeric_limits<double>::infinity();
  const bool lse_mode = bnd.lse != nullptr;
  const int64_t i_end = std::min(nrb, (s + 1) * KS);
  std::vector<int64_t> keep_t;
  std::vector<double> lo_t(nct), up_t(nct);
  double ls = ninf;
  std::vector<int64_t> order(nct);
  for (int64_t t = 0; t < nct; ++t) {
    sbnd(rs.l(s, d), rs.h(s, d), cs.l(t, d), cs.h(t, d), d, t, lo_t[t], up_t[t]);
    ls = std::max(ls, lo_t[t]);
    order[t] = t;
  }
  if (lse_mode) {  // a tighter bound for every row of S: min over its blocks I of max lo(I, J), J in the best T
    const int64_t nbest = std::min<int64_t>(4, nct);
    std::partial_sort(order.begin(), order.begin() + nbest, order.end(),
                      [&](int64_t a, int64_t b) { return up_t[a] > up_t[b]; });
    double lmin = std::numeric_limits<double>::infinity();
    for (int64_t i = s * KS; i < i_end; ++i) {
      double li = lrow != nullptr ? lrow[i] : ninf;
      for (int64_t q = 0; q < nbest; ++q)
        for (int64_t j = order[q] * KS; j < std::min(ncb, (order[q] + 1) * KS); ++j) {
          double lo, up;
          bnd(rb.l(i, d), rb.h(i, d), cb.l(j, d), cb.h(j, d), d, j, lo, up);
          li = std::max(li, lo);
        }
      lmin = std::min(lmin, li);
    }
    ls = std::max(ls, lmin);
  }
  for (int64_t t = 0; t < nct; ++t)
    if (up_t[t] > ninf && up_t[t] >= ls + slack1) keep_t.push_back(t);
  std::vector<int64_t> cand;
  std::vector<double> up_j;
  for (int64_t i = s * KS; i < i_end; ++i) {
    cand.clear();
    up_j.clear();
    double li = lrow != nullptr ? std::max(ls, lrow[i]) : ls;
    for (int64_t t : keep_t) {
      const int64_t j_end = std::min(ncb, (t + 1) * KS);
      for (int64_t j = t * KS; j < j_end; ++j) {
        double lo, up;
        bnd(rb.l(i, d), rb.h(i, d), cb.l(j, d), cb.h(j, d), d, j, lo, up);
        li = std::max(li, lo);
        if (up > ninf) {
          cand.push_back(j);
          up_j.push_back(up);
        }
      }
    }
    int64_t nr = 0, last = -2, cols = 0;
    if (best != nullptr) {
      std::vector<size_t> idx(cand.size());
      for (size_t c = 0; c < idx.size(); ++c) idx[c] = c;
      const size_t nb = std::min<size_t>(NBEST, idx.size());
      std::partial_sort(idx.begin(), idx.begin() + nb, idx.end(),
                        [&](size_t a, size_t b) { return up_j[a] > up_j[b]; });
      for (size_t q = 0; q < (size_t)NBEST; ++q) best[i * NBEST + q] = q < nb ? cand[idx[q]] : -1;
    }
    if (!lse_mode || li > ninf) {
      for (size_t c = 0; c < cand.size(); ++c) {
        if (up_j[c] < li + slack2) continue;
        const int64_t j = cand[c], a = j * RB, e = std::min(m, (j + 1) * RB);
        if (row_trend && rows.lrow0[i] > ninf) {
          const double *alo = rb.l(i, d), *ahi = rb.h(i, d), *blo = cb.l(j, d), *bhi = cb.h(j, d);
          double t1 = bnd.top[j], t0 = bnd.lse[j];
          for (int64_t k = 0; k < d; ++k) {
            const double ca = 0.5 * (alo[k] + ahi[k]), cbk = 0.5 * (blo[k] + bhi[k]), ak = rows.alpha[i * d + k];
            t1 += pair_max(alo[k], ahi[k], ca, ak, blo[k], bhi[k], cbk, bnd.beta[j * d + k], bnd.eps);
            t0 += pair_max(alo[k], ahi[k], ca, ak, blo[k], bhi[k], cbk, 0.0, bnd.eps);
          }
          if (std::min(t0, t1) < rows.lrow0[i] + slack2) continue;
        }
        if (j == last + 1) {
          out.rng.back() = e;
        } else {
          out.rng.push_back(a);
          out.rng.push_back(e);
          ++nr;
        }
        cols += e - a;
        last = j;
      }
    }
    out.count.push_back(nr);
    out.kept += (double)cols * (double)(std::min(n, (i + 1) * RB) - i * RB);
  }
}

}  // namespace

extern "C" {

// Version of the entry points below; the loader refuses a library whose version differs from its own.
int srot_abi_version() { return 11; }

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
    drive_dense<T>(Batch<T>{x, yt, h, nbatch, n, m, d, sx, syt, sh}, prim, nthreads);                           \
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
    drive_dense<T>(Batch<T>{x, yt, h, nbatch, n, m, d, sx, syt, sh}, prim, nthreads);                           \
  }                                                                                                        \
  void srot_argmax_##SUF(const T* x, const T* yt, const T* h, int64_t nbatch, int64_t n, int64_t m,        \
                         int64_t d, int64_t sx, int64_t syt, int64_t sh, int p, double eps, int64_t* out,  \
                         int64_t sout, int nthreads) {                                                     \
    Argmax<T> prim;                                                                                        \
    prim.p = p;                                                                                            \
    prim.inv_eps = T(1.0 / eps);                                                                           \
    prim.out = out;                                                                                        \
    prim.sout = sout;                                                                                      \
    drive_dense<T>(Batch<T>{x, yt, h, nbatch, n, m, d, sx, syt, sh}, prim, nthreads);                           \
  }                                                                                                        \
  void srot_max_sq_##SUF(const T* x, const T* yt, int64_t nbatch, int64_t n, int64_t m, int64_t d,         \
                         int64_t sx, int64_t syt, double* out, int nthreads) {                             \
    MaxSq<T> prim;                                                                                         \
    prim.out = out;                                                                                        \
    prim.nbatch = nbatch;                                                                                  \
    drive_dense<T>(Batch<T>{x, yt, nullptr, nbatch, n, m, d, sx, syt, 0}, prim, nthreads);                      \
  }

SROT_DEFINE(float, f32)
SROT_DEFINE(double, f64)

// Block pruning of a batch of nbatch problems (n rows, m columns, dimension d). Row block I of problem b has
// the box rlo, rhi + (b * nrb + I) * d and covers the sorted rows [I RB, min(n, (I + 1) RB)); row super-block S
// (blocks [S KS, (S + 1) KS)) has rslo, rshi + (b * nst + S) * d; the same for the columns (ncb blocks, nct
// super-blocks). Column statistics per block / super-block (LSE mode): lse = LSE of h, and, optionally (top,
// beta may be null), the linear trend of h (PairBounds); lse == nullptr selects the max-cost mode. Writes offs
// (nbatch * nrb + 1) and, when the total number of column ranges fits in cap, rng (2 per range);
// kept[0] = row-column pairs kept. Returns the number of ranges.
int64_t srot_bs_prune(const double* rlo, const double* rhi, const double* rslo, const double* rshi, int64_t nrb,
                      const double* clo, const double* chi, const double* cslo, const double* cshi, int64_t ncb,
                      const double* lse, const double* top, const double* beta, const double* slse,
                      const double* stop, const double* sbeta, const double* lrow, const double* lrow0,
                      const double* alpha, int64_t* best, int64_t nbatch,
                      int64_t n, int64_t m, int64_t d, int p, double eps, double log_thr, int64_t* offs, int64_t* rng,
                      int64_t cap, double* kept, int nthreads) {
  const int64_t nst = (nrb + KS - 1) / KS, nct = (ncb + KS - 1) / KS;
  const bool lse_mode = lse != nullptr, trend = top != nullptr && stop != nullptr;
  const double slack1 = lse_mode ? log_thr - std::log(2.0) - std::log((double)nct) : 0.0;
  const double slack2 = lse_mode ? log_thr - std::log(2.0) - std::log((double)ncb) : 0.0;
  std::vector<Pruned> res(nbatch * nst);
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
  for (int64_t task = 0; task < nbatch * nst; ++task) {
    const int64_t b = task / nst, s = task - b * nst;
    const PairBounds bnd{lse_mode ? lse + b * ncb : nullptr, trend ? top + b * ncb : nullptr,
                         trend ? beta + b * ncb * d : nullptr, p, eps};
    const PairBounds sbnd{lse_mode ? slse + b * nct : nullptr, trend ? stop + b * nct : nullptr,
                          trend ? sbeta + b * nct * d : nullptr, p, eps};
    prune_task(s, Boxes{rlo + b * nrb * d, rhi + b * nrb * d}, Boxes{rslo + b * nst * d, rshi + b * nst * d}, nrb,
               Boxes{clo + b * ncb * d, chi + b * ncb * d}, Boxes{cslo + b * nct * d, cshi + b * nct * d}, ncb, nct,
               n, m, d, bnd, sbnd, slack1, slack2,
               RowBounds{lrow != nullptr ? lrow + b * nrb : nullptr, lrow0 != nullptr ? lrow0 + b * nrb : nullptr,
                         alpha != nullptr ? alpha + b * nrb * d : nullptr,
                         best != nullptr ? best + b * nrb * NBEST : nullptr},
               res[task]);
  }
  int64_t total = 0, row = 0;
  double k = 0.0;
  offs[0] = 0;
  for (const Pruned& r : res) {
    for (int64_t c : r.count) {
      offs[row + 1] = offs[row] + c;
      ++row;
    }
    if (total + (int64_t)r.rng.size() / 2 <= cap) std::copy(r.rng.begin(), r.rng.end(), rng + 2 * total);
    total += (int64_t)r.rng.size() / 2;
    k += r.kept;
  }
  kept[0] = k;
  return total;
}


// Column statistics of groups of `size` consecutive sorted columns (kernels/blocksparse.py), per problem b and
// group g with box centre c (lo, hi (ng, d)): lse = LSE_j h_j; with top != nullptr also the least-squares
// linear trend beta of h about c over the finite h_j (ridge-regularised normal equations; any beta gives a
// valid bound) and top = max_j (h_j - beta . (y_j - c)) + log(number of finite h_j), so that
// LSE_j [h_j - beta . (y_j - c)] <= top. -inf where every h_j of the group is -inf.
void srot_bs_col_stats(const double* h, const double* y, const double* lo, const double* hi, int64_t nbatch,
                       int64_t m, int64_t d, int64_t size, double* lse, double* top, double* beta, int nthreads) {
  const int64_t ng = (m + size - 1) / size;
  const double ninf = -std::numeric_limits<double>::infinity();
#pragma omp parallel for schedule(static) num_threads(nthreads)
  for (int64_t task = 0; task < nbatch * ng; ++task) {
    const int64_t b = task / ng, g = task - b * ng;
    const double* hb = h + b * m;
    const double* yb = y + b * m * d;
    const int64_t j0 = g * size, j1 = std::min(m, j0 + size);
    double mx = ninf;
    for (int64_t j = j0; j < j1; ++j) mx = std::max(mx, hb[j]);
    double acc = 0.0;
    if (mx > ninf)
      for (int64_t j = j0; j < j1; ++j) acc += std::exp(hb[j] - mx);
    lse[task] = mx > ninf ? mx + std::log(acc) : ninf;
    if (top == nullptr) continue;
    double c[3] = {0, 0, 0}, bt[3] = {0, 0, 0};
    for (int64_t k = 0; k < d; ++k) c[k] = 0.5 * (lo[task * d + k] + hi[task * d + k]);
    if (mx > ninf) {
      // weighted sums over the finite h_j of dy = y_j - c and t = h_j - mx
      double cnt = 0, sy[3] = {0, 0, 0}, st = 0, syy[3][3] = {{0}}, syt[3] = {0, 0, 0};
      for (int64_t j = j0; j < j1; ++j) {
        if (!(hb[j] > ninf)) continue;
        const double t = hb[j] - mx;
        double dy[3];
        for (int64_t k = 0; k < d; ++k) dy[k] = yb[j * d + k] - c[k];
        cnt += 1;
        st += t;
        for (int64_t k = 0; k < d; ++k) {
          sy[k] += dy[k];
          syt[k] += dy[k] * t;
          for (int64_t l = 0; l < d; ++l) syy[k][l] += dy[k] * dy[l];
        }
      }
      // centred normal equations  Cov(dy) beta = Cov(dy, t),  plus a tiny ridge; Gaussian elimination (SPD)
      double a[3][4], tr = 0;
      for (int64_t k = 0; k < d; ++k) {
        for (int64_t l = 0; l < d; ++l) a[k][l] = syy[k][l] - sy[k] * sy[l] / cnt;
        a[k][d] = syt[k] - sy[k] * st / cnt;
        tr += a[k][k];
      }
      const double ridge = 1e-12 * tr + 1e-300;
      for (int64_t k = 0; k < d; ++k) a[k][k] += ridge;
      for (int64_t k = 0; k < d; ++k)
        for (int64_t r = k + 1; r < d; ++r) {
          const double f = a[r][k] / a[k][k];
          for (int64_t l = k; l <= d; ++l) a[r][l] -= f * a[k][l];
        }
      for (int64_t k = d - 1; k >= 0; --k) {
        double v = a[k][d];
        for (int64_t l = k + 1; l < d; ++l) v -= a[k][l] * bt[l];
        bt[k] = v / a[k][k];
        if (!std::isfinite(bt[k])) bt[k] = 0.0;
      }
    }
    double tp = ninf, count = 0;
    for (int64_t j = j0; j < j1; ++j) {
      if (!(hb[j] > ninf)) continue;
      double v = hb[j];
      for (int64_t k = 0; k < d; ++k) v -= bt[k] * (yb[j * d + k] - c[k]);
      tp = std::max(tp, v);
      count += 1;
    }
    // a bound on the group's log-sum-exp, not on one term: + log(number of finite h_j)
    top[task] = count > 0 ? tp + std::log(count) : ninf;
    for (int64_t k = 0; k < d; ++k) beta[task * d + k] = bt[k];
  }
}

// Block-sparse passes: as the dense entry points, on sorted points, with ld the row stride of yt
// (>= round_up(m, W) + W) and the column ranges offs, rng of srot_bs_prune; one task per row block of RB rows.
// Argmax writes -1 for a row without any column.
#define SROT_DEFINE_SPARSE(T, SUF)                                                                          \
  void srot_bs_softmin_##SUF(const T* x, const T* yt, const T* h, int64_t nbatch, int64_t n, int64_t m,    \
                             int64_t d, int64_t sx, int64_t syt, int64_t sh, int64_t ld, const int64_t* offs, \
                             const int64_t* rng, int p, double eps, T* out, int64_t sout, int nthreads) {   \
    Softmin<T> prim;                                                                                       \
    prim.p = p;                                                                                            \
    prim.inv_eps = T(1.0 / eps);                                                                           \
    prim.eps = eps;                                                                                        \
    prim.out = out;                                                                                        \
    prim.sout = sout;                                                                                      \
    drive<T>(Batch<T>{x, yt, h, nbatch, n, m, d, sx, syt, sh}, ld, RB, RangeCols{offs, rng}, prim, nthreads); \
  }                                                                                                        \
  void srot_bs_wmean_##SUF(const T* x, const T* yt, const T* h, int64_t nbatch, int64_t n, int64_t m,      \
                           int64_t d, int64_t sx, int64_t syt, int64_t sh, int64_t ld, const int64_t* offs, \
                           const int64_t* rng, int p, double eps, int phi, T* out, int64_t sout,           \
                           int nthreads) {                                                                 \
    WMean<T> prim;                                                                                         \
    prim.p = p;                                                                                            \
    prim.inv_eps = T(1.0 / eps);                                                                           \
    prim.phi = phi;                                                                                        \
    prim.out = out;                                                                                        \
    prim.sout = sout;                                                                                      \
    drive<T>(Batch<T>{x, yt, h, nbatch, n, m, d, sx, syt, sh}, ld, RB, RangeCols{offs, rng}, prim, nthreads); \
  }                                                                                                        \
  void srot_bs_argmax_##SUF(const T* x, const T* yt, const T* h, int64_t nbatch, int64_t n, int64_t m,     \
                            int64_t d, int64_t sx, int64_t syt, int64_t sh, int64_t ld, const int64_t* offs, \
                            const int64_t* rng, int p, double eps, int64_t* out, int64_t sout,             \
                            int nthreads) {                                                                \
    Argmax<T> prim;                                                                                        \
    prim.p = p;                                                                                            \
    prim.inv_eps = T(1.0 / eps);                                                                           \
    prim.out = out;                                                                                        \
    prim.sout = sout;                                                                                      \
    prim.none = -1;                                                                                        \
    drive<T>(Batch<T>{x, yt, h, nbatch, n, m, d, sx, syt, sh}, ld, RB, RangeCols{offs, rng}, prim, nthreads); \
  }                                                                                                        \
  void srot_bs_max_sq_##SUF(const T* x, const T* yt, int64_t nbatch, int64_t n, int64_t m, int64_t d,      \
                            int64_t sx, int64_t syt, int64_t ld, const int64_t* offs, const int64_t* rng,   \
                            double* out, int nthreads) {                                                   \
    MaxSq<T> prim;                                                                                         \
    prim.out = out;                                                                                        \
    prim.nbatch = nbatch;                                                                                  \
    drive<T>(Batch<T>{x, yt, nullptr, nbatch, n, m, d, sx, syt, 0}, ld, RB, RangeCols{offs, rng}, prim,     \
             nthreads);                                                                                    \
  }

SROT_DEFINE_SPARSE(float, f32)
SROT_DEFINE_SPARSE(double, f64)

}  // extern "C"

// ---------------------------------------------------------------------------------------------------------------
// Soft-min over stored squared distances: problem b's s + b * ss (n, m) row-major holds |x_i - y_j|^2 (what the
// streaming kernel computes per tile, here read instead: O(n m) reads per pass, whatever d). The same online
// log-sum-exp as Softmin, one task per row.
namespace {

template <typename T>
void softmin_stored(const T* s, const T* h, int64_t nbatch, int64_t n, int64_t m, int64_t ss, int64_t sh, int p,
                    double eps, T* out, int64_t sout, int nthreads) {
  const T inv_eps = T(1.0 / eps);
  const T neg_inf = -std::numeric_limits<T>::infinity();
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t t = 0; t < nbatch * n; ++t) {
    const int64_t b = t / n, i = t % n;
    const T* row = s + b * ss + i * m;
    const T* hb = h + b * sh;
    alignas(64) T buf[TJ];
    double mrow = -std::numeric_limits<double>::infinity(), srow = 0.0;
    for (int64_t j0 = 0; j0 < m; j0 += TJ) {
      const int jn = int(std::min<int64_t>(TJ, m - j0));
      std::memcpy(buf, row + j0, sizeof(T) * jn);
      const T bm = logits_row<T>(buf, hb + j0, jn, p, inv_eps);
      if (!(bm > neg_inf)) continue;  // tile fully masked (or NaN)
      const T mnew = std::max<T>(T(mrow), bm);
      T acc = T(0);
#pragma omp simd reduction(+ : acc)
      for (int j = 0; j < jn; ++j) acc += exp_neg(buf[j] - mnew);
      srow = srow * std::exp(mrow - double(mnew)) + double(acc);
      mrow = mnew;
    }
    out[b * sout + i] = srow > 0.0 ? T(-eps * (mrow + std::log(srow))) : std::numeric_limits<T>::infinity();
  }
}

// The squared distances themselves, out + b * n * m (n, m) row-major, from the tiles of sq_dist_tile: the values
// the streaming kernel computes, so a pass over them gives the streaming pass's result exactly.
template <typename T>
void sq_dist_store(const T* x, const T* yt, int64_t nbatch, int64_t n, int64_t m, int64_t d, int64_t sx,
                   int64_t syt, T* out, int nthreads) {
  const int64_t ld = (m + W - 1) / W * W;
  const int64_t nblocks = (n + R - 1) / R;
#pragma omp parallel num_threads(nthreads)
  {
    std::vector<T> xb(R * d);
    alignas(64) T tile[R][TJ];
#pragma omp for schedule(dynamic, 4)
    for (int64_t t = 0; t < nbatch * nblocks; ++t) {
      const int64_t b = t / nblocks, i0 = (t - b * nblocks) * R;
      const int rows = int(std::min<int64_t>(R, n - i0));
      load_rows(x + b * sx, n, d, i0, xb.data(), R);
      for (int64_t j0 = 0; j0 < m; j0 += TJ) {
        const int jn = int(std::min<int64_t>(TJ, m - j0));
        sq_dist_tile<T>(xb.data(), yt + b * syt, ld, d, j0, jn, tile);
        for (int r = 0; r < rows; ++r) std::memcpy(out + (b * n + i0 + r) * m + j0, tile[r], sizeof(T) * jn);
      }
    }
  }
}

}  // namespace

extern "C" {

#define SROT_DEFINE_STORED(T, SUF)                                                                          \
  void srot_softmin_sq_##SUF(const T* s, const T* h, int64_t nbatch, int64_t n, int64_t m, int64_t ss,     \
                             int64_t sh, int p, double eps, T* out, int64_t sout, int nthreads) {          \
    softmin_stored<T>(s, h, nbatch, n, m, ss, sh, p, eps, out, sout, nthreads);                            \
  }                                                                                                        \
  void srot_sq_dist_##SUF(const T* x, const T* yt, int64_t nbatch, int64_t n, int64_t m, int64_t d,        \
                          int64_t sx, int64_t syt, T* out, int nthreads) {                                 \
    sq_dist_store<T>(x, yt, nbatch, n, m, d, sx, syt, out, nthreads);                                      \
  }

SROT_DEFINE_STORED(float, f32)
SROT_DEFINE_STORED(double, f64)

}  // extern "C"

// ---------------------------------------------------------------------------------------------------------------
// One step of the safeguarded Anderson acceleration, srot_fast/_anderson.py (Anderson.step, its torch reference,
// which documents the method): the same arithmetic for a batch of nb problems on CPU tensors, in one call instead
// of some fifty small tensor operations (the step's cost at small sizes). State, updated in place: images, resid
// (nb, k1, m) float64 ring buffers, inner (nb, k1, k1), valid (nb, k1), best, top (nb,), since (nb,); w is the
// slot written now. Inputs: g, ghat (nb, m), err (nb,) float64, value (nb,) float64 or null (by_value off), done
// (nb,), mask (nb, m) float64. Writes out (nb, m).
namespace {

template <typename T>
void anderson_step(const T* g, const T* ghat, const double* err, const double* value, const uint8_t* done,
                   const double* mask, double* images, double* resid, double* inner, uint8_t* valid, double* best,
                   double* top, int64_t* since, int64_t nb, int64_t k1, int64_t m, int64_t w, int64_t gap, T* out) {
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<double> gram(k1 * k1), gamma(k1);
  for (int64_t b = 0; b < nb; ++b) {
    const T* gb = g + b * m;
    const T* hb = ghat + b * m;
    T* ob = out + b * m;
    double* img = images + b * k1 * m;
    double* res = resid + b * k1 * m;
    double* in = inner + b * k1 * k1;
    uint8_t* val = valid + b * k1;
    // the safeguard: a step is bad where the error rose above twice its best (or is NaN) ...
    const double e = err[b];
    bool bad = !(e <= 2 * best[b]);
    if (value != nullptr) {  // ... unless the dual objective is at its best so far
      const bool rising = value[b] >= top[b];
      bad = std::isnan(e) || (bad && !rising);
      // as torch's nan_to_num(-inf): NaN -> -inf, +-inf -> +-largest double
      const double dmax = std::numeric_limits<double>::max();
      const double v = std::isnan(value[b]) ? -inf : std::max(-dmax, std::min(dmax, value[b]));
      top[b] = std::max(top[b], v);
    }
    const double e_inf = std::isnan(e) ? inf : (e == inf ? std::numeric_limits<double>::max() : e);
    bool restart = bad;
    if (gap > 0) {
      restart = bad && since[b] > gap;
      since[b] = restart ? 0 : since[b] + 1;
    }
    best[b] = restart ? e_inf : std::min(best[b], e_inf);
    // the new entry: T(g_w) and its masked residual, then its inner products with every slot
    double* iw = img + w * m;
    double* rw = res + w * m;
    const double* mb = mask + b * m;
    for (int64_t j = 0; j < m; ++j) {
      iw[j] = double(hb[j]);
      rw[j] = (iw[j] - double(gb[j])) * mb[j];
    }
    for (int64_t i = 0; i < k1; ++i) {
      const double* ri = res + i * m;
      double acc = 0;
      for (int64_t j = 0; j < m; ++j) acc += ri[j] * rw[j];
      in[w * k1 + i] = acc;
      in[i * k1 + w] = acc;
    }
    for (int64_t i = 0; i < k1; ++i) val[i] = val[i] && !restart;
    val[w] = 1;
    // normal equations in the differences r_w - r_i over the kept slots (slot w and the others: a zero row),
    // with the relative ridge on the diagonal
    const double* row = in + w * k1;
    double diag = 0;
    for (int64_t i = 0; i < k1; ++i) {
      for (int64_t j = 0; j < k1; ++j) {
        const bool keep = val[i] && val[j];
        gram[i * k1 + j] = keep ? in[i * k1 + j] - row[i] + (row[w] - row[j]) : 0.0;
      }
      gamma[i] = val[i] ? row[w] - row[i] : 0.0;
      diag += gram[i * k1 + i];
    }
    const double ridge = 1e-10 * (diag / double(k1)) + 1e-300;
    for (int64_t i = 0; i < k1; ++i) gram[i * k1 + i] += ridge;
    // Gaussian elimination with partial pivoting (a zero pivot leaves a non-finite gamma: caught below)
    for (int64_t c = 0; c < k1; ++c) {
      int64_t piv = c;
      for (int64_t r = c + 1; r < k1; ++r)
        if (std::fabs(gram[r * k1 + c]) > std::fabs(gram[piv * k1 + c])) piv = r;
      if (piv != c) {
        for (int64_t j = 0; j < k1; ++j) std::swap(gram[c * k1 + j], gram[piv * k1 + j]);
        std::swap(gamma[c], gamma[piv]);
      }
      for (int64_t r = c + 1; r < k1; ++r) {
        const double f = gram[r * k1 + c] / gram[c * k1 + c];
        for (int64_t j = c; j < k1; ++j) gram[r * k1 + j] -= f * gram[c * k1 + j];
        gamma[r] -= f * gamma[c];
      }
    }
    for (int64_t c = k1 - 1; c >= 0; --c) {
      double acc = gamma[c];
      for (int64_t j = c + 1; j < k1; ++j) acc -= gram[c * k1 + j] * gamma[j];
      gamma[c] = acc / gram[c * k1 + c];
    }
    double sum = 0;
    for (int64_t i = 0; i < k1; ++i) sum += gamma[i];
    gamma[w] += 1 - sum;
    // the combination sum_i gamma_i T(g_i), taken unless it is bad or not finite (in the output dtype)
    bool finite = true;
    for (int64_t j = 0; j < m; ++j) {
      double acc = 0;
      for (int64_t i = 0; i < k1; ++i) acc += gamma[i] * img[i * m + j];
      const T v = T(acc);
      finite = finite && std::isfinite(v);
      ob[j] = v;
    }
    const bool ok = finite && !bad;
    for (int64_t j = 0; j < m; ++j) ob[j] = done[b] ? gb[j] : (ok ? ob[j] : hb[j]);
  }
}

}  // namespace

extern "C" {

#define SROT_DEFINE_ANDERSON(T, SUF)                                                                        \
  void srot_anderson_##SUF(const T* g, const T* ghat, const double* err, const double* value,              \
                           const uint8_t* done, const double* mask, double* images, double* resid,          \
                           double* inner, uint8_t* valid, double* best, double* top, int64_t* since,        \
                           int64_t nb, int64_t k1, int64_t m, int64_t w, int64_t gap, T* out) {             \
    anderson_step<T>(g, ghat, err, value, done, mask, images, resid, inner, valid, best, top, since, nb, k1, \
                     m, w, gap, out);                                                                       \
  }

SROT_DEFINE_ANDERSON(float, f32)
SROT_DEFINE_ANDERSON(double, f64)

}  // extern "C"

// ---------------------------------------------------------------------------------------------------------------
// The solver's per-update bookkeeping, srot_fast/_loop.py and srot_fast/_anderson.py (their torch references,
// which document them): the same arithmetic on CPU tensors in one call each instead of some ten small tensor
// operations (an update's cost on small problems).
namespace {

// marginal_error (srot_fast/_loop.py): out[b] = sum_i a_i |exp((f_i - s_i)/eps) - exp((fhat_i - s_i)/eps)|, a_i =
// exp(la_i), in float64 (the differences f - s in the potentials' dtype, as the reference); fhat null: the
// balanced case, exp((fhat_i - s_i)/eps) = 1. A NaN term counts 0, an infinite one the largest double (torch's
// nan_to_num). la, f, s, fhat (nb, n) contiguous.
template <typename T>
void marginal_error(const T* la, const T* f, const T* s, const T* fhat, int64_t nb, int64_t n, double eps,
                    double* out) {
  const double dmax = std::numeric_limits<double>::max();
  for (int64_t b = 0; b < nb; ++b) {
    double acc = 0;
    for (int64_t i = b * n; i < (b + 1) * n; ++i) {
      const double l = double(la[i]);
      const double e1 = std::exp(l + double(T(f[i] - s[i])) / eps);
      const double e2 = fhat == nullptr ? std::exp(l) : std::exp(l + double(T(fhat[i] - s[i])) / eps);
      const double v = std::fabs(e1 - e2);
      acc += std::isnan(v) ? 0.0 : std::min(v, dmax);
    }
    out[b] = acc;
  }
}

// torch's nan_to_num(nan=0.0): NaN -> 0, +-inf -> +-largest double
inline double nan_to_num(double v) {
  const double dmax = std::numeric_limits<double>::max();
  return std::isnan(v) ? 0.0 : std::max(-dmax, std::min(dmax, v));
}

// Penalty.phi (srot_fast/penalties.py) of kind 0 balanced (f), 1 KL (tau (1 - exp(-f/tau))), 2 TV (min(f, tau));
// NaN stays NaN
inline double phi(int kind, double tau, double f) {
  if (kind == 1) return -tau * std::expm1(-f / tau);
  if (kind == 2) return f > tau ? tau : f;
  return f;
}

// dual_value (srot_fast/_loop.py): out[b] = <a, phi_a(fhat)> + <b, phi_b(g)> - eps (<pi, 1> - |a| |b|), <pi, 1> =
// sum_i a_i exp((fhat_i - s_i)/eps), a = exp(la), b = exp(lb), all in float64, NaN terms 0 (as the reference's
// nan_to_num). la, fhat, s (nb, n); lb, g (nb, m); contiguous.
template <typename T>
void dual_value(const T* la, const T* lb, const T* fhat, const T* g, const T* s, int64_t nb, int64_t n, int64_t m,
                int kind_a, double tau_a, int kind_b, double tau_b, double eps, double* out) {
  for (int64_t b = 0; b < nb; ++b) {
    double plan = 0, side_a = 0, mass_a = 0, side_b = 0, mass_b = 0;
    for (int64_t i = b * n; i < (b + 1) * n; ++i) {
      const double a = std::exp(double(la[i])), fd = double(fhat[i]);
      plan += nan_to_num(a * std::exp((fd - double(s[i])) / eps));
      side_a += nan_to_num(a * phi(kind_a, tau_a, fd));
      mass_a += a;
    }
    for (int64_t j = b * m; j < (b + 1) * m; ++j) {
      const double w = std::exp(double(lb[j]));
      side_b += nan_to_num(w * phi(kind_b, tau_b, double(g[j])));
      mass_b += w;
    }
    out[b] = side_a + side_b - eps * (plan - mass_a * mass_b);
  }
}

// One side of kl_translation (srot_fast/_loop.py): log <w, exp(-pot rate)> (rate 0: log |w|), centred at the
// weighted mean potential; zero weights count for nothing.
template <typename T> double log_mass(const T* lw, const T* pot, int64_t len, double rate) {
  double sw = 0, swp = 0;
  for (int64_t i = 0; i < len; ++i) {
    const double w = std::exp(double(lw[i]));
    sw += w;
    swp += w * (w > 0 ? double(pot[i]) : 0.0);
  }
  if (rate == 0) return std::log(sw);
  const double mean = swp / sw;
  double acc = 0;
  for (int64_t i = 0; i < len; ++i) {
    const double w = std::exp(double(lw[i]));
    acc += w * std::exp(-((w > 0 ? double(pot[i]) : 0.0) - mean) * rate);
  }
  return std::log(acc) - mean * rate;
}

// kl_translation: out[b] = (log A - log B) / (rate_a + rate_b), 0 where that is not finite. la, f (nb, n); lb, g
// (nb, m); contiguous; rate 0 on a balanced side.
template <typename T>
void kl_translation(const T* la, const T* f, const T* lb, const T* g, int64_t nb, int64_t n, int64_t m,
                    double rate_a, double rate_b, double* out) {
  for (int64_t b = 0; b < nb; ++b) {
    const double c = (log_mass(la + b * n, f + b * n, n, rate_a) - log_mass(lb + b * m, g + b * m, m, rate_b)) /
                     (rate_a + rate_b);
    out[b] = std::isfinite(c) ? c : 0.0;
  }
}

}  // namespace

extern "C" {

#define SROT_DEFINE_DUAL(T, SUF)                                                                            \
  void srot_dual_value_##SUF(const T* la, const T* lb, const T* fhat, const T* g, const T* s, int64_t nb,  \
                             int64_t n, int64_t m, int kind_a, double tau_a, int kind_b, double tau_b,     \
                             double eps, double* out) {                                                    \
    dual_value<T>(la, lb, fhat, g, s, nb, n, m, kind_a, tau_a, kind_b, tau_b, eps, out);                  \
  }                                                                                                        \
  void srot_kl_translation_##SUF(const T* la, const T* f, const T* lb, const T* g, int64_t nb, int64_t n,  \
                                 int64_t m, double rate_a, double rate_b, double* out) {                   \
    kl_translation<T>(la, f, lb, g, nb, n, m, rate_a, rate_b, out);                                        \
  }

SROT_DEFINE_DUAL(float, f32)
SROT_DEFINE_DUAL(double, f64)

#define SROT_DEFINE_MARGINAL(T, SUF)                                                                        \
  void srot_marginal_error_##SUF(const T* la, const T* f, const T* s, const T* fhat, int64_t nb,     \
                                 int64_t n, double eps, double* out) {                                     \
    marginal_error<T>(la, f, s, fhat, nb, n, eps, out);                                                    \
  }

SROT_DEFINE_MARGINAL(float, f32)
SROT_DEFINE_MARGINAL(double, f64)

// Anderson.track (stall watch): state low (nb,) float64, flat, rest, stalls (nb,) int64, updated in place from the
// (nb,) float64 stopping error err and done; rest is written only with watch, stalls only with quit.
void srot_track(const double* err, const uint8_t* done, double* low, int64_t* flat, int64_t* rest,
                int64_t* stalls, int64_t nb, int watch, int quit, int64_t stall, int64_t plain_run) {
  for (int64_t b = 0; b < nb; ++b) {
    const bool better = err[b] <= 0.5 * low[b];  // false for a NaN error
    if (better) low[b] = err[b];
    const bool stalled = !done[b] && !better && flat[b] + 1 >= stall;
    flat[b] = (better || done[b] || stalled) ? 0 : flat[b] + 1;
    if (quit) stalls[b] = better ? 0 : stalls[b] + int64_t(stalled);
    if (watch) rest[b] = stalled ? plain_run : std::max<int64_t>(rest[b] - 1, 0);
  }
}

// Anderson.replaced: out[b] for the problems not done whose proposal the loop replaces by T(g). Far ones
// (Anderson.too_far, unless by_value): column error col[b] (float64) NaN or above max(2 best[b], far_limit); their
// valid slots (nb, k1) keep only slot ``newest``. Resting ones (Anderson.resting): rest[b] > 0, or with quit > 0
// stalls[b] >= quit.
void srot_replaced(const double* col, const uint8_t* done, const double* best, uint8_t* valid, const int64_t* rest,
                   const int64_t* stalls, int64_t nb, int64_t k1, int64_t newest, double far_limit, int by_value,
                   int64_t quit, uint8_t* out) {
  for (int64_t b = 0; b < nb; ++b) {
    const bool far = !by_value && !done[b] && !(col[b] <= std::max(2 * best[b], far_limit));
    if (far)
      for (int64_t i = 0; i < k1; ++i) valid[b * k1 + i] = valid[b * k1 + i] && i == newest;
    out[b] = !done[b] && (far || rest[b] > 0 || (quit > 0 && stalls[b] >= quit));
  }
}

}  // extern "C"

// ---------------------------------------------------------------------------------------------------------------
// Partial OT's dummy points, srot_fast/geometry.py (PartialGeometry._augment and rebalance, their torch references,
// which document them): the augmented soft-min from the real one, and the exact step along the real / dummy
// direction, in float64 arithmetic rounded to the potentials' dtype.
namespace {

// log(exp(a) + exp(b)), -inf where both are
inline double log_add_exp(double a, double b) {
  if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<double>::quiet_NaN();
  const double hi = std::max(a, b), lo = std::min(a, b);
  if (hi == -std::numeric_limits<double>::infinity() || hi == std::numeric_limits<double>::infinity()) return hi;
  return hi + std::log1p(std::exp(lo - hi));
}

// log sum_i exp(t_i) over len values (-inf for none or all -inf, +inf if one is, NaN if one is NaN)
template <typename T> double log_sum_exp(const T* t, int64_t len) {
  double hi = -std::numeric_limits<double>::infinity();
  for (int64_t i = 0; i < len; ++i) {
    if (std::isnan(double(t[i]))) return std::numeric_limits<double>::quiet_NaN();
    hi = std::max(hi, double(t[i]));
  }
  if (std::isinf(hi)) return hi;
  double acc = 0;
  for (int64_t i = 0; i < len; ++i) acc += std::exp(double(t[i]) - hi);
  return hi + std::log(acc);
}

// out (nb, n + 1): out_i = -eps log(exp(-real_i / eps) + exp(h_m)) for i < n (the dummy column at cost 0) and
// out_n = -eps LSE_{j < m} h_j (the dummy row); real (nb, n), h (nb, m + 1)
template <typename T> void partial_augment(const T* real, const T* h, int64_t nb, int64_t n, int64_t m, double eps,
                                           T* out) {
  for (int64_t b = 0; b < nb; ++b) {
    const T* hb = h + b * (m + 1);
    T* ob = out + b * (n + 1);
    const double hd = double(hb[m]);
    for (int64_t i = 0; i < n; ++i) ob[i] = T(-eps * log_add_exp(-double(real[b * n + i]) / eps, hd));
    ob[n] = T(-eps * log_sum_exp(hb, m));
  }
}

// rebalance (dummies off): c = eps/2 (log mass - LSE_{i<n} (la_i + (f_i - last_i)/eps)), 0 where not finite;
// f' = f + (c, .., c, -c), g' = g + (c, .., c, -c), last' = last - c, s = the augmented soft-min of last' for the
// log-weights lb + g'/eps. f, la (nb, n + 1); g, lb (nb, m + 1); last (nb, n); outputs of the same shapes.
template <typename T>
void partial_rebalance(const T* f, const T* g, const T* last, const T* la, const T* lb, int64_t nb, int64_t n,
                       int64_t m, double eps, double log_mass, T* fo, T* go, T* lo, T* so) {
  std::vector<double> t(std::max(n, m));
  for (int64_t b = 0; b < nb; ++b) {
    const T *fb = f + b * (n + 1), *gb = g + b * (m + 1), *lab = la + b * (n + 1), *lbb = lb + b * (m + 1);
    const T* rb = last + b * n;
    for (int64_t i = 0; i < n; ++i) t[i] = double(lab[i]) + double(T(fb[i] - rb[i])) / eps;
    const T c = T(0.5 * eps * (log_mass - log_sum_exp(t.data(), n)));
    const T ct = std::isfinite(c) ? c : T(0);  // tested in the dtype, as the reference's nan_to_num
    T *fob = fo + b * (n + 1), *gob = go + b * (m + 1), *lob = lo + b * n, *sob = so + b * (n + 1);
    for (int64_t i = 0; i < n; ++i) fob[i] = fb[i] + ct;
    fob[n] = fb[n] - ct;
    for (int64_t j = 0; j < m; ++j) gob[j] = gb[j] + ct;
    gob[m] = gb[m] - ct;
    for (int64_t i = 0; i < n; ++i) lob[i] = rb[i] - ct;
    for (int64_t j = 0; j < m; ++j) t[j] = double(lbb[j]) + double(gob[j]) / eps;
    const double hd = double(lbb[m]) + double(gob[m]) / eps;
    for (int64_t i = 0; i < n; ++i) sob[i] = T(-eps * log_add_exp(-double(lob[i]) / eps, hd));
    sob[n] = T(-eps * log_sum_exp(t.data(), m));
  }
}

// rebalance's dummy updates (dummies on): fo = f but fo_n = -eps LSE_{j<m} (lb_j + g_j / eps), go = g but go_m =
// -eps LSE_{i<n} (la_i + f_i / eps) (the terms in the dtype, the sums in float64); f, la, fo (nb, n + 1), g, lb,
// go (nb, m + 1); fo, go may be f, g
template <typename T>
void partial_dummies(const T* f, const T* g, const T* la, const T* lb, int64_t nb, int64_t n, int64_t m, double eps,
                     T* fo, T* go) {
  const T e = T(eps);
  std::vector<T> h(std::max(n, m));
  for (int64_t b = 0; b < nb; ++b) {
    const T *fb = f + b * (n + 1), *gb = g + b * (m + 1), *lab = la + b * (n + 1), *lbb = lb + b * (m + 1);
    for (int64_t j = 0; j < m; ++j) h[j] = lbb[j] + gb[j] / e;
    const T fd = T(-eps * log_sum_exp(h.data(), m));
    for (int64_t i = 0; i < n; ++i) h[i] = lab[i] + fb[i] / e;
    const T gd = T(-eps * log_sum_exp(h.data(), n));
    T *fob = fo + b * (n + 1), *gob = go + b * (m + 1);
    if (fob != fb) std::memcpy(fob, fb, sizeof(T) * n);
    if (gob != gb) std::memcpy(gob, gb, sizeof(T) * m);
    fob[n] = fd;
    gob[m] = gd;
  }
}

}  // namespace

extern "C" {

#define SROT_DEFINE_PARTIAL(T, SUF)                                                                         \
  void srot_partial_augment_##SUF(const T* real, const T* h, int64_t nb, int64_t n, int64_t m, double eps, \
                                  T* out) {                                                                \
    partial_augment<T>(real, h, nb, n, m, eps, out);                                                       \
  }                                                                                                        \
  void srot_partial_rebalance_##SUF(const T* f, const T* g, const T* last, const T* la, const T* lb,       \
                                    int64_t nb, int64_t n, int64_t m, double eps, double log_mass, T* fo,  \
                                    T* go, T* lo, T* so) {                                                 \
    partial_rebalance<T>(f, g, last, la, lb, nb, n, m, eps, log_mass, fo, go, lo, so);                     \
  }                                                                                                        \
  void srot_partial_dummies_##SUF(const T* f, const T* g, const T* la, const T* lb, int64_t nb, int64_t n, \
                                  int64_t m, double eps, T* fo, T* go) {                                   \
    partial_dummies<T>(f, g, la, lb, nb, n, m, eps, fo, go);                                               \
  }

SROT_DEFINE_PARTIAL(float, f32)
SROT_DEFINE_PARTIAL(double, f64)

}  // extern "C"

// ---------------------------------------------------------------------------------------------------------------
// The alternating loop at the target eps over stored squared distances, srot_fast/_loop.py (alternating, its torch
// reference, which documents it): for each problem of the batch, the looks and updates of that loop until the
// problem is done or the loop's update cap, composed of the functions above on the problem's own slices. The same
// arithmetic as the torch loop that calls those functions one at a time: a problem's updates never read another
// problem, and the ring buffer's slot advances with every update of the batch as with every update of the problem.
// A finished problem stops (the torch loop keeps it frozen). Partial OT: partial_problem below. Not for a loop
// that looks every k > 1 updates. A cold solve (solve below) runs eps-scaling and its loose solves first.
namespace {

struct LoopArgs {
  // operands: sq_x (nb, n, m) and sq_y (nb, m, n) stored squared distances; la (nb, n), lb (nb, m) log-weights;
  // u (nb, n), v (nb, m) cost offsets or null; mass_a, mass_b (nb,) float64 total weights; mask (nb, m) float64
  const void *sq_x, *sq_y, *la, *lb, *u, *v;
  const double *mass_a, *mass_b, *mask;
  // state, updated in place: f, s (nb, n), g, t (nb, m) in the dtype; col, err (nb,) float64; done (nb,);
  // n_iter (nb,) += the updates run, also written to updates (nb,)
  void *f, *g, *s, *t;
  double *col, *err;
  uint8_t* done;
  int64_t *n_iter, *updates;
  // Anderson's state (srot_fast/_anderson.py): images, resid (nb, k1, m), inner (nb, k1, k1), valid (nb, k1),
  // best, top, low (nb,) float64, since, flat, rest, stalls (nb,) int64
  double *images, *resid, *inner;
  uint8_t* valid;
  double *best, *top, *low;
  int64_t *since, *flat, *rest, *stalls;
  int64_t nb, n, m, p;
  int64_t kind_a, kind_b;          // penalty kinds (0 balanced, 1 KL, 2 TV) and strengths
  double tau_a, tau_b, eps;
  double tol, enter_tol;           // enter_tol < 0: none
  double value_tol, value_span;    // value_tol < 0: no value test
  int64_t window, steps;           // the value test reads every window updates at the target eps; steps so far
  int64_t it0, max_iter;           // the loop's update count at the start, and its cap
  int64_t accelerate, by_value, watch, translate;
  int64_t k1, slot, gap, stall, plain_run;
  double far_limit;
  int64_t nthreads;
  // partial OT (srot_fast/geometry.py, PartialGeometry): f, s, la (nb, n) and g, t, lb (nb, m) include the dummy
  // points, the stored distances and the offsets are those of the n - 1 and m - 1 real points; last (nb, n - 1)
  // the real part of the last row soft-min, updated in place; log_mass the log of the transported mass; quit: the
  // stall watch's plain steps to the end after this many stalls
  void* last;
  double log_mass;
  int64_t quit;
  // a cold solve (srot_loop_* and srot_symmetric_loop_* where eps_list is given): eps-scaling before the loop over
  // eps_list (n_eps values, the last one the target eps A.eps); the loose solves' relative marginal error, cap of
  // updates, error below which a problem takes none, and the factor of the target eps within which an easy solve
  // (at most one update at the eps before) skips them; need_t: the target loop's first look reads the columns too;
  // passes (1,): the soft-min passes run, written (alternating solves)
  const double* eps_list;
  int64_t n_eps;
  double scale_tol, scale_enter, scale_near;
  int64_t scale_cap, need_t;
  int64_t* passes;
  // partial OT: a proposal farther than wild (span + eps) (root mean square over the mask) from T(g) takes T(g)
  // (Anderson.wild); span < 0: none
  double span, wild;
};

// Penalty.aprox (srot_fast/penalties.py) in the dtype: s (balanced), s * tau / (tau + eps) (KL), clamp(s, -tau, tau)
// (TV); out may be s
template <typename T> void aprox(int64_t kind, double tau, double eps, const T* s, int64_t len, T* out) {
  if (kind == 1) {
    const T r = T(tau / (tau + eps));
    for (int64_t i = 0; i < len; ++i) out[i] = s[i] * r;
  } else if (kind == 2) {
    const T lo = T(-tau), hi = T(tau);
    for (int64_t i = 0; i < len; ++i) out[i] = std::isnan(s[i]) ? s[i] : std::min(std::max(s[i], lo), hi);
  } else if (out != s) {
    std::memcpy(out, s, sizeof(T) * len);
  }
}

// Geometry.softmin_x / softmin_y (srot_fast/geometry.py) for one problem: out = -eps LSE_j[lw_j + pot_j / eps -
// off_j / eps - sq_ij / eps] + row_i, the offsets off (of the columns) and row (of the rows) optional; h is scratch
template <typename T>
void pass(const T* sq, const T* lw, const T* pot, const T* off, const T* row, int64_t n, int64_t m, int p,
          double eps, T* h, T* out, int nthreads) {
  const T e = T(eps);
  for (int64_t j = 0; j < m; ++j) h[j] = lw[j] + pot[j] / e;
  if (off != nullptr)
    for (int64_t j = 0; j < m; ++j) h[j] = h[j] - off[j] / e;
  softmin_stored<T>(sq, h, 1, n, m, n * m, m, p, eps, out, n, nthreads);
  if (row != nullptr)
    for (int64_t i = 0; i < n; ++i) out[i] = out[i] + row[i];
}

// NaN-propagating max and clamp_min, as torch.maximum and clamp_min
inline double nan_max(double a, double b) { return (std::isnan(a) || std::isnan(b)) ? a + b : std::max(a, b); }
inline double clamp_min(double a, double lo) { return std::isnan(a) ? a : std::max(a, lo); }

// The value test of one problem (srot_fast/_loop.py, _ValueTest.passed): fed the dual objective at each reading,
// whether the estimated remaining rise is within tol |value| (never at the first 3 readings)
struct ValueTest {
  double prev = 0, rise = 0, ratio = 0;
  int64_t reads = 0;
  bool passed(double value, double tol) {
    bool out = false;
    if (reads >= 1) {
      const double d = value - prev;
      if (reads >= 2) {
        const double r = rise > 0 ? d / clamp_min(rise, 1e-300) : std::numeric_limits<double>::infinity();
        if (reads >= 3) {
          const double r_max = nan_max(r, ratio);
          const double tail = d * r_max / clamp_min(1 - r_max, 1e-300);
          out = d >= 0 && r_max < 1 && tail <= tol * std::fabs(value);
        }
        ratio = r;
      }
      rise = d;
    }
    prev = value;
    ++reads;
    return out;
  }
};

// Problem b's slices of the operands and the state: f, s, la of A.n values, g, t, lb of A.m; the stored distances
// (nr, mr) and the offsets of the nr, mr real points (all points but partial OT's dummies); null where absent
template <typename T> struct Slices {
  const T *sqx, *sqy, *la, *lb, *u, *v;
  T *f, *g, *s, *t;
};

template <typename T> Slices<T> slices(const LoopArgs& A, int64_t b, int64_t nr, int64_t mr) {
  auto in = [b](const void* p, int64_t len) { return p == nullptr ? nullptr : static_cast<const T*>(p) + b * len; };
  auto out = [b](void* p, int64_t len) { return p == nullptr ? nullptr : static_cast<T*>(p) + b * len; };
  return {in(A.sq_x, nr * mr), in(A.sq_y, nr * mr), in(A.la, A.n), in(A.lb, A.m), in(A.u, nr), in(A.v, mr),
          out(A.f, A.n), out(A.g, A.m), out(A.s, A.n), out(A.t, A.m)};
}

// One problem's outcome, written back: its column error (where the loop has one), stopping error, done flag and
// the k updates it ran
inline void finish(const LoopArgs& A, int64_t b, double col, double err, bool done, int64_t k) {
  if (A.col != nullptr) A.col[b] = col;
  A.err[b] = err;
  A.done[b] = done;
  A.n_iter[b] += k;
  A.updates[b] = k;
}

// fn(b, threads) for each problem b of the batch: one problem on all A.nthreads threads, or the problems spread over
// them (one thread each)
template <typename F> void each(const LoopArgs& A, F&& fn) {
  if (A.nb == 1) {
    fn(int64_t(0), int(A.nthreads));
    return;
  }
#pragma omp parallel for num_threads(A.nthreads) schedule(dynamic, 1)
  for (int64_t b = 0; b < A.nb; ++b) fn(b, 1);
}

// A fresh Anderson history for problem b (srot_fast/_anderson.py, Anderson.__init__ and allocate), as each solve
// that starts from new potentials has (the loose solves of eps-scaling, the loop at the target eps)
inline void anderson_reset(const LoopArgs& A, int64_t b) {
  if (!A.accelerate) return;
  const int64_t k1 = A.k1, m = A.m;
  const double inf = std::numeric_limits<double>::infinity();
  std::fill_n(A.images + b * k1 * m, k1 * m, 0.0);
  std::fill_n(A.resid + b * k1 * m, k1 * m, 0.0);
  std::fill_n(A.inner + b * k1 * k1, k1 * k1, 0.0);
  std::fill_n(A.valid + b * k1, k1, uint8_t(0));
  A.best[b] = inf;
  A.top[b] = -inf;
  A.low[b] = inf;
  A.since[b] = A.gap + 1;
  A.flat[b] = A.rest[b] = A.stalls[b] = 0;
}

// One look of the loop (srot_fast/_loop.py, alternating) at problem b's k-th update: the row error at (f, s), fhat =
// A_a(s) (s itself when balanced), plus the column error col; the value test every window updates; the stopping
// test; the stall watch. Writes row, err and the dual objective (NaN where not read); returns done, updated.
template <typename T>
bool look(const LoopArgs& A, int64_t b, int64_t k, const T* la, const T* lb, const T* f, const T* s, const T* fhat,
          const T* g, double col, bool done, ValueTest& vtest, double& row, double& err, double& value) {
  const int64_t it = A.it0 + k;
  marginal_error<T>(la, f, s, fhat == s ? nullptr : fhat, 1, A.n, A.eps, &row);
  row /= A.mass_a[b];
  err = row + col;
  const bool read = A.value_tol >= 0 && (A.steps + k) % A.window == 0;
  value = std::numeric_limits<double>::quiet_NaN();
  if (read || A.by_value)
    dual_value<T>(la, lb, fhat, g, s, 1, A.n, A.m, int(A.kind_a), A.tau_a, int(A.kind_b), A.tau_b, A.eps, &value);
  if (read) done = done || (vtest.passed(value, A.value_tol) && err <= A.value_span * A.tol);
  done = done || err <= ((A.enter_tol < 0 || it > A.it0) ? A.tol : std::max(A.tol, A.enter_tol));
  const uint8_t done_u8 = done;
  if (A.accelerate && (A.watch || A.quit))
    srot_track(&err, &done_u8, A.low + b, A.flat + b, A.rest + b, A.stalls + b, 1, int(A.watch), int(A.quit),
               A.stall, A.plain_run);
  return done;
}

template <typename T> void loop_problem(const LoopArgs& A, int64_t b, int nthreads) {
  const int64_t n = A.n, m = A.m, k1 = A.k1;
  const double eps = A.eps;
  const auto [sqx, sqy, la, lb, u, v, f, g, s, t] = slices<T>(A, b, n, m);
  std::vector<T> fhat_buf(n), ghat_buf(m), gnew(m), h(std::max(n, m));
  const T* fhat = A.kind_a == 0 ? s : fhat_buf.data();  // balanced: A(s) = s
  const T* ghat = A.kind_b == 0 ? t : ghat_buf.data();
  double col = A.col[b], err = A.err[b];
  const double rate_a = A.kind_a == 0 ? 0.0 : 1.0 / A.tau_a, rate_b = A.kind_b == 0 ? 0.0 : 1.0 / A.tau_b;
  const uint8_t not_done = 0;
  bool done = A.done[b] != 0;
  ValueTest vtest;
  int64_t k = 0;
  for (;;) {
    if (A.kind_a != 0) aprox<T>(A.kind_a, A.tau_a, eps, s, n, fhat_buf.data());
    double row, value;
    done = look<T>(A, b, k, la, lb, f, s, fhat, g, col, done, vtest, row, err, value);
    if (done || A.it0 + k >= A.max_iter) break;
    // the update: f = A_a(S_x(g)), t = S_y(f), g from T(g) = A_b(t)
    if (A.kind_a != 0) std::memcpy(f, fhat, sizeof(T) * n);
    else std::memcpy(f, s, sizeof(T) * n);
    pass<T>(sqy, la, f, u, v, m, n, int(A.p), eps, h.data(), t, nthreads);
    if (A.kind_b != 0) aprox<T>(A.kind_b, A.tau_b, eps, t, m, ghat_buf.data());
    if (A.accelerate) {
      const int64_t w = (A.slot + k) % k1;
      anderson_step<T>(g, ghat, &row, A.by_value ? &value : nullptr, &not_done, A.mask + b * m,
                       A.images + b * k1 * m, A.resid + b * k1 * m, A.inner + b * k1 * k1, A.valid + b * k1,
                       A.best + b, A.top + b, A.since + b, 1, k1, m, w, A.gap, gnew.data());
      const bool quitted = A.quit > 0 && A.stalls[b] >= A.quit;  // (Anderson.resting without a watch)
      std::memcpy(g, A.translate && quitted ? ghat : gnew.data(), sizeof(T) * m);
      if (!A.translate) {  // an accelerated g leaves the column marginal off: measured; too far or resting: T(g)
        marginal_error<T>(lb, g, t, A.kind_b == 0 ? nullptr : ghat, 1, m, eps, &col);
        col /= A.mass_b[b];
        uint8_t far = 0;
        srot_replaced(&col, &not_done, A.best + b, A.valid + b * k1, A.rest + b, A.stalls + b, 1, k1, w,
                      A.far_limit, int(A.by_value), A.quit, &far);
        if (far) {
          std::memcpy(g, ghat, sizeof(T) * m);
          col = 0.0;
        }
      }
    } else {  // plain: g = T(g), exact columns
      std::memcpy(g, ghat, sizeof(T) * m);
      col = 0.0;
    }
    pass<T>(sqx, lb, g, v, u, n, m, int(A.p), eps, h.data(), s, nthreads);
    if (A.translate) {  // KL: the exact step along (f + c, g - c); the soft-mins shift with the potentials
      double c64;
      kl_translation<T>(la, f, lb, g, 1, n, m, rate_a, rate_b, &c64);
      const T c = T(c64);
      for (int64_t i = 0; i < n; ++i) {
        f[i] = f[i] + c;
        s[i] = s[i] + c;
      }
      for (int64_t j = 0; j < m; ++j) {
        g[j] = g[j] - c;
        t[j] = t[j] - c;
      }
      if (A.kind_b != 0) aprox<T>(A.kind_b, A.tau_b, eps, t, m, ghat_buf.data());
      marginal_error<T>(lb, g, t, A.kind_b == 0 ? nullptr : ghat, 1, m, eps, &col);
      col /= A.mass_b[b];
    }
    ++k;
  }
  finish(A, b, col, err, done, k);
}

// recentre (srot_fast/_loop.py, its torch reference): k = ((max g + min g) - (max f + min f)) / 4 over the real
// points of positive weight (la > -inf; mask), then f, s (nr + 1), last (nr) += k and g, t, the nk images (m
// each) -= k; no shift where k is not finite
template <typename T>
void recentre(const T* la, const double* mask, int64_t nr, int64_t m, double* images, int64_t nk, T* f, T* g, T* s,
              T* t, T* last) {
  const double inf = std::numeric_limits<double>::infinity();
  double f_hi = -inf, f_lo = inf, g_hi = -inf, g_lo = inf;
  for (int64_t i = 0; i < nr; ++i)
    if (double(la[i]) > -inf) f_hi = nan_max(f_hi, double(f[i])), f_lo = -nan_max(-f_lo, -double(f[i]));
  for (int64_t j = 0; j < m; ++j)
    if (mask[j] > 0) g_hi = nan_max(g_hi, double(g[j])), g_lo = -nan_max(-g_lo, -double(g[j]));
  const double kd = 0.25 * ((g_hi + g_lo) - (f_hi + f_lo));
  if (!std::isfinite(kd)) return;
  const T k = T(kd);
  for (int64_t i = 0; i <= nr; ++i) f[i] += k, s[i] += k;
  for (int64_t i = 0; i < nr; ++i) last[i] += k;
  for (int64_t j = 0; j < m; ++j) g[j] -= k, t[j] -= k;
  for (int64_t j = 0; j < nk * m; ++j) images[j] -= double(k);
}

// The loop of partial OT over its dummy points (srot_fast/_loop.py, alternating with a PartialGeometry, its torch
// reference): as loop_problem with balanced penalties, but each soft-min is the real pass followed by the dummy
// points' closed forms (partial_augment), the row pass is followed by the rebalancing step (partial_rebalance,
// which gives the row soft-min), the stopping test reads the rows only, and a resting problem takes T(g).
template <typename T> void partial_problem(const LoopArgs& A, int64_t b, int nthreads) {
  const int64_t n = A.n, m = A.m, nr = n - 1, mr = m - 1, k1 = A.k1;
  const double eps = A.eps;
  const auto [sqx, sqy, la, lb, u, v, f, g, s, t] = slices<T>(A, b, nr, mr);
  T* last = static_cast<T*>(A.last) + b * nr;
  std::vector<T> gnew(m), hp(std::max(n, m)), hf(std::max(n, m)), real(mr);
  const T e = T(eps);
  const uint8_t not_done = 0;
  double col = A.col[b], err = A.err[b];
  bool done = A.done[b] != 0;
  ValueTest vtest;
  int64_t k = 0;
  for (;;) {
    double row, value;
    done = look<T>(A, b, k, la, lb, f, s, s, g, col, done, vtest, row, err, value);  // balanced: A(s) = s
    if (done || A.it0 + k >= A.max_iter) break;
    std::memcpy(f, s, sizeof(T) * n);  // f = A(s) = s
    for (int64_t i = 0; i < n; ++i) hf[i] = la[i] + f[i] / e;
    pass<T>(sqy, la, f, u, v, mr, nr, int(A.p), eps, hp.data(), real.data(), nthreads);
    partial_augment<T>(real.data(), hf.data(), 1, mr, nr, eps, t);
    if (A.accelerate) {
      const int64_t w = (A.slot + k) % k1;
      anderson_step<T>(g, t, &row, A.by_value ? &value : nullptr, &not_done, A.mask + b * m, A.images + b * k1 * m,
                       A.resid + b * k1 * m, A.inner + b * k1 * k1, A.valid + b * k1, A.best + b, A.top + b,
                       A.since + b, 1, k1, m, w, A.gap, gnew.data());
      const bool resting = A.rest[b] > 0 || (A.quit > 0 && A.stalls[b] >= A.quit);
      bool wild = false;
      if (A.span >= 0) {  // Anderson.wild: the same sums in float64
        const double* mask = A.mask + b * m;
        double sq = 0.0, count = 0.0, lim = A.wild * (A.span + eps);
        for (int64_t j = 0; j < m; ++j) {
          if (mask[j] == 0) continue;  // (the dummy's proposal may be +-inf)
          const double d = double(gnew[j]) - double(t[j]);
          sq += mask[j] * d * d;
          count += mask[j];
        }
        wild = !(sq <= count * lim * lim);  // an overflow or NaN is wild
      }
      std::memcpy(g, resting || wild ? t : gnew.data(), sizeof(T) * m);
    } else {
      std::memcpy(g, t, sizeof(T) * m);
    }
    col = 0.0;
    pass<T>(sqx, lb, g, v, u, nr, mr, int(A.p), eps, hp.data(), last, nthreads);
    partial_rebalance<T>(f, g, last, la, lb, 1, nr, mr, eps, A.log_mass, f, g, last, s);
    if (A.accelerate) recentre<T>(la, A.mask + b * m, nr, m, A.images + b * k1 * m, k1, f, g, s, t, last);
    ++k;
  }
  finish(A, b, col, err, done, k);
}

// A cold solve of the batch (srot_fast/_loop.py, alternating without init, its torch reference): the initial
// potentials at the first eps, at each eps of eps_list the averaged step and, accelerated and for all but the last
// eps, the loose solve (loop_problem or partial_problem to scale_tol), then the loop at the target eps. Each stage
// runs problem by problem; between stages the batch's largest update counts decide the loose solves' budgets and
// skips and the target loop's start, as in the reference. Partial OT (A.last given): each soft-min is the real
// pass followed by the dummy points' closed forms, and each loop starts with the dummy updates and the rebalancing
// step. Writes f, g, s, t (the column soft-min at the final f; where a problem took no update and need_t is off,
// zeros), col, err, done, n_iter (+= every update), updates (those of the target loop), last (partial OT) and
// passes (those of a batch).
template <typename T> void solve(const LoopArgs& A) {
  const bool partial = A.last != nullptr;
  const int64_t nb = A.nb, n = A.n, m = A.m, ne = A.n_eps, len = std::max(n, m);
  const int64_t nr = partial ? n - 1 : n, mr = partial ? m - 1 : m;  // the real points
  const int p = int(A.p);
  const double target = A.eps_list[ne - 1];
  const auto most = [nb](const int64_t* c) { return nb == 0 ? int64_t(0) : *std::max_element(c, c + nb); };
  // problem b's buffers: h, hf (len) scratch for the passes, real (len) the real part of a soft-min, x, y (len)
  // soft-mins; last: partial OT's real row soft-min (A.last), else scratch
  struct Work {
    std::vector<T> h, hf, real, x, y;
    T* last;
  };
  const auto work = [&](int64_t b) {
    Work w{std::vector<T>(len), std::vector<T>(len), std::vector<T>(len), std::vector<T>(len), std::vector<T>(len),
           nullptr};
    w.last = partial ? static_cast<T*>(A.last) + b * nr : w.real.data();
    return w;
  };
  // the row soft-min S_x(g) (n values, into out) and the column one S_y(f) (m values) at eps e, A_a / A_b not
  // applied; partial OT: the real pass (the rows' into w.last) then the dummy points' closed forms
  const auto rows = [&](const Slices<T>& sl, const T* g, double e, T* out, Work& w, int nt) {
    if (!partial) return pass<T>(sl.sqx, sl.lb, g, sl.v, sl.u, n, m, p, e, w.h.data(), out, nt);
    pass<T>(sl.sqx, sl.lb, g, sl.v, sl.u, nr, mr, p, e, w.h.data(), w.last, nt);
    const T E = T(e);
    for (int64_t j = 0; j < m; ++j) w.hf[j] = sl.lb[j] + g[j] / E;
    partial_augment<T>(w.last, w.hf.data(), 1, nr, mr, e, out);
  };
  const auto cols = [&](const Slices<T>& sl, const T* f, double e, T* out, Work& w, int nt) {
    if (!partial) return pass<T>(sl.sqy, sl.la, f, sl.u, sl.v, m, n, p, e, w.h.data(), out, nt);
    pass<T>(sl.sqy, sl.la, f, sl.u, sl.v, mr, nr, p, e, w.h.data(), w.real.data(), nt);
    const T E = T(e);
    for (int64_t i = 0; i < n; ++i) w.hf[i] = sl.la[i] + f[i] / E;
    partial_augment<T>(w.real.data(), w.hf.data(), 1, mr, nr, e, out);
  };
  // a loop's start at eps e (the reference's first look): the row soft-min s at g; partial OT: then the dummy
  // points' exact updates and the rebalancing step
  const auto start = [&](const Slices<T>& sl, double e, Work& w, int nt) {
    rows(sl, sl.g, e, sl.s, w, nt);
    if (!partial) return;
    partial_dummies<T>(sl.f, sl.g, sl.la, sl.lb, 1, nr, mr, e, sl.f, sl.g);
    partial_rebalance<T>(sl.f, sl.g, w.last, sl.la, sl.lb, 1, nr, mr, e, A.log_mass, sl.f, sl.g, w.last, sl.s);
  };
  const auto loop = partial ? partial_problem<T> : loop_problem<T>;
  const double e0 = A.eps_list[0];
  each(A, [&](int64_t b, int nt) {  // f = A_a(S_x(0)), g = A_b(S_y(0)) at the first eps
    const auto sl = slices<T>(A, b, nr, mr);
    Work w = work(b);
    std::vector<T> zero(len, T(0));
    rows(sl, zero.data(), e0, sl.f, w, nt);
    cols(sl, zero.data(), e0, sl.g, w, nt);
    aprox<T>(A.kind_a, A.tau_a, e0, sl.f, n, sl.f);
    aprox<T>(A.kind_b, A.tau_b, e0, sl.g, m, sl.g);
  });
  int64_t passes = 2, last = 0;  // last: updates of the last loose solve (the most of any problem)
  std::vector<int64_t> extra(nb, 0), sub_iter(nb), sub_updates(nb);  // updates of the loose solves
  std::vector<double> sub_col(nb), sub_err(nb);
  std::vector<uint8_t> sub_done(nb);
  for (int64_t k = 0; k < ne; ++k) {
    const double e = A.eps_list[k];
    each(A, [&](int64_t b, int nt) {  // the averaged step (stable while eps shrinks)
      const auto sl = slices<T>(A, b, nr, mr);
      Work w = work(b);
      rows(sl, sl.g, e, w.x.data(), w, nt);  // ft
      cols(sl, sl.f, e, w.y.data(), w, nt);  // gt
      aprox<T>(A.kind_a, A.tau_a, e, w.x.data(), n, w.x.data());
      aprox<T>(A.kind_b, A.tau_b, e, w.y.data(), m, w.y.data());
      const T half = T(0.5);
      for (int64_t i = 0; i < n; ++i) sl.f[i] = half * (sl.f[i] + w.x[i]);
      for (int64_t j = 0; j < m; ++j) sl.g[j] = half * (sl.g[j] + w.y[j]);
    });
    passes += 2;
    if (!A.accelerate || k == ne - 1) continue;
    const int64_t left = A.max_iter - ne - most(extra.data());
    if (left <= 0 || (e <= A.scale_near * target && last <= 1)) continue;  // no budget, or an easy problem
    LoopArgs L = A;  // the loose solve at e: its own counts, no value test, a fresh history
    L.eps = e;
    L.tol = A.scale_tol;
    L.enter_tol = A.scale_enter;
    L.value_tol = -1;
    L.steps = L.it0 = L.slot = 0;
    L.max_iter = std::min(A.scale_cap, left);
    L.col = sub_col.data();
    L.err = sub_err.data();
    L.done = sub_done.data();
    L.n_iter = sub_iter.data();
    L.updates = sub_updates.data();
    each(A, [&](int64_t b, int nt) {
      const auto sl = slices<T>(A, b, nr, mr);
      Work w = work(b);
      start(sl, e, w, nt);
      sub_col[b] = sub_err[b] = 0.0;
      sub_done[b] = 0;
      sub_iter[b] = 0;
      anderson_reset(A, b);
      loop(L, b, nt);
    });
    last = most(sub_updates.data());
    passes += 1 + 2 * last;
    for (int64_t b = 0; b < nb; ++b) extra[b] += sub_updates[b];
  }
  const double e = A.eps;  // the target
  const bool look_t = A.need_t;  // the first look reads the columns too
  each(A, [&](int64_t b, int nt) {
    const auto sl = slices<T>(A, b, nr, mr);
    Work w = work(b);
    start(sl, e, w, nt);
    if (look_t) {
      cols(sl, sl.f, e, sl.t, w, nt);
      if (A.kind_b != 0) aprox<T>(A.kind_b, A.tau_b, e, sl.t, m, w.x.data());
      marginal_error<T>(sl.lb, sl.g, sl.t, A.kind_b == 0 ? nullptr : w.x.data(), 1, m, e, A.col + b);
      A.col[b] /= A.mass_b[b];
    } else {
      std::fill_n(sl.t, m, T(0));
      A.col[b] = 0.0;
    }
    A.err[b] = 0.0;
    A.done[b] = 0;
    A.n_iter[b] += ne + extra[b];
    anderson_reset(A, b);
  });
  passes += look_t ? 2 : 1;
  LoopArgs F = A;
  F.it0 = most(A.n_iter);
  F.steps = F.slot = 0;
  each(A, [&](int64_t b, int nt) { loop(F, b, nt); });
  passes += 2 * most(A.updates);

  *A.passes = passes;
}

// The self-transport loop (srot_fast/_loop.py, symmetric, its torch reference) of one problem over the stored
// squared distances sq_x (n, n) of x with itself: averaged updates f <- (f + A(S(f))) / 2 (the offsets u of the
// rows, v of the columns: u = v). Reads sq_x, la, u, v, mass_a; updates f, s, err, done, n_iter, updates. Where
// eps_list is given, a cold solve: eps-scaling (f from the zero potential, averaged steps) first.
template <typename T> void symmetric_problem(const LoopArgs& A, int64_t b, int nthreads) {
  const int64_t n = A.n;
  const double eps = A.eps;
  const auto [sq, unused, la, lb, u, v, f, g, s, t] = slices<T>(A, b, n, n);  // (no columns of their own)
  std::vector<T> fhat_buf(n), h(n);
  const T* fhat = A.kind_a == 0 ? s : fhat_buf.data();
  if (A.eps_list != nullptr) {  // a cold solve: f = A(S(0)) at the first eps, averaged steps at all but the last
    const double e0 = A.eps_list[0];
    std::vector<T> zero(n, T(0));
    pass<T>(sq, la, zero.data(), v, u, n, n, int(A.p), e0, h.data(), f, nthreads);
    aprox<T>(A.kind_a, A.tau_a, e0, f, n, f);
    for (int64_t k = 0; k + 1 < A.n_eps; ++k) {
      const double e = A.eps_list[k];
      pass<T>(sq, la, f, v, u, n, n, int(A.p), e, h.data(), s, nthreads);
      aprox<T>(A.kind_a, A.tau_a, e, s, n, fhat_buf.data());
      const T half = T(0.5);
      for (int64_t i = 0; i < n; ++i) f[i] = half * (f[i] + fhat[i]);
    }
  }
  ValueTest vtest;
  double err = A.err[b];
  bool done = A.done[b] != 0;
  int64_t k = 0;
  for (;;) {
    pass<T>(sq, la, f, v, u, n, n, int(A.p), eps, h.data(), s, nthreads);
    if (A.kind_a != 0) aprox<T>(A.kind_a, A.tau_a, eps, s, n, fhat_buf.data());
    marginal_error<T>(la, f, s, A.kind_a == 0 ? nullptr : fhat, 1, n, eps, &err);
    err /= A.mass_a[b];
    if (A.value_tol >= 0 && (A.steps + k) % A.window == 0) {
      double value;
      dual_value<T>(la, la, fhat, f, s, 1, n, n, int(A.kind_a), A.tau_a, int(A.kind_a), A.tau_a, eps, &value);
      done = done || (vtest.passed(value, A.value_tol) && err <= A.value_span * A.tol);
    }
    done = done || err <= A.tol;
    if (done || A.it0 + k >= A.max_iter) break;
    const T half = T(0.5);
    for (int64_t i = 0; i < n; ++i) f[i] = f[i] + half * (fhat[i] - f[i]);
    ++k;
  }
  finish(A, b, 0.0, err, done, k);
}

}  // namespace

extern "C" {

#define SROT_DEFINE_LOOP(T, SUF)                                                                            \
  void srot_loop_##SUF(const LoopArgs* args) {                                                             \
    const LoopArgs& A = *args;                                                                             \
    if (A.eps_list != nullptr) {                                                                           \
      solve<T>(A);                                                                                         \
      return;                                                                                              \
    }                                                                                                      \
    auto one = A.last == nullptr ? loop_problem<T> : partial_problem<T>;                                   \
    each(A, [&](int64_t b, int nt) { one(A, b, nt); });                                                    \
  }                                                                                                        \
  void srot_symmetric_loop_##SUF(const LoopArgs* args) {                                                   \
    const LoopArgs& A = *args;                                                                             \
    each(A, [&](int64_t b, int nt) { symmetric_problem<T>(A, b, nt); });                                   \
  }

SROT_DEFINE_LOOP(float, f32)
SROT_DEFINE_LOOP(double, f64)

}  // extern "C"
