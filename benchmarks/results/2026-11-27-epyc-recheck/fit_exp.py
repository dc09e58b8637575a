"""The float exp polynomial of kernels/csrc/cpu_ops.cpp: a degree-6 polynomial fitted to exp(r) on |r| <= ln2 / 2 by
Lawson-weighted least squares on the relative error (float64), rounded to float32 coefficients, then evaluated
in float32 Horner form on every 4th float32 r with 2^-7 <= |r| <= ln2 / 2, with a separate multiply and add and
with fused multiply-adds (the build's -march=native lets GCC fuse them), against the degree-7 Taylor polynomial
it replaced. Run: python fit_exp.py"""
import numpy as np

A = np.log(2) / 2


def fit(deg: int, iters: int = 200) -> np.ndarray:
    xs = np.cos(np.linspace(0, np.pi, 4000)) * A
    f = np.exp(xs)
    V = np.vander(xs, deg + 1, increasing=True)
    w = np.ones_like(xs)
    for _ in range(iters):
        sw = np.sqrt(w)
        c = np.linalg.lstsq(V * (sw / f)[:, None], sw, rcond=None)[0]
        err = np.abs(V @ c / f - 1)
        w = w * err
        w /= w.sum()
    return c.astype(np.float32)


def floats() -> np.ndarray:
    lo, hi = np.float32(2.0**-7).view(np.int32), np.float32(A).view(np.int32)
    pos = np.arange(lo, hi + 1, 4, dtype=np.int32).view(np.float32)
    return np.concatenate([pos, -pos])


def horner(c: np.ndarray, r: np.ndarray, fma: bool) -> np.ndarray:
    p = np.full_like(r, c[-1])
    for k in range(len(c) - 2, -1, -1):
        if fma:  # one rounding: the float64 product of two float32 is exact
            p = (p.astype(np.float64) * r.astype(np.float64) + np.float64(c[k])).astype(np.float32)
        else:
            p = (p * r).astype(np.float32) + c[k]
    return p


def max_rel(c: np.ndarray, r: np.ndarray, fma: bool) -> float:
    return float(np.max(np.abs(horner(c, r, fma).astype(np.float64) / np.exp(r.astype(np.float64)) - 1)))


if __name__ == "__main__":
    new = fit(6)
    taylor = np.array([1, 1, 1 / 2, 1 / 6, 1 / 24, 1 / 120, 1 / 720, 1 / 5040], dtype=np.float32)
    r = floats()
    print("degree-6 fit, float32 coefficients (c0 .. c6):", [float(v) for v in new])
    for name, c in (("degree-6 fit", new), ("degree-7 Taylor", taylor)):
        print(f"{name}: max relative error {max_rel(c, r, False):.3e} (multiply, add), "
              f"{max_rel(c, r, True):.3e} (fused)")
