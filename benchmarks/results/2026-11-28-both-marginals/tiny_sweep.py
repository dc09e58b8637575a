"""Tiny clouds with uneven weights: the default (accelerated) solve against plain float64 Sinkhorn.

    python tiny_sweep.py [--eps 0.003] [--cases 200] [--backend tensorized] [--float32] [--plain]

Case k: generator seed k, N, M uniform in 3-29, x, y ~ N(0, I) in 2-D, a, b uniform(0, 1) normalised (float64).
Reference: ``sinkhorn(..., accelerate=False, tol=1e-10, max_iter=200000)``. The solve under test runs with its
defaults but ``max_iter=3000``. Prints how many did not converge, how many reported convergence with a value
more than 1e-3 (relative) off the reference, and the updates in all. The references take a few minutes.
"""
import argparse
import time
import warnings

import torch

from srot_fast import sinkhorn


def case(seed):
    g = torch.Generator().manual_seed(seed)
    n, m = (int(torch.randint(3, 30, (1,), generator=g)) for _ in range(2))
    x, y = torch.randn(n, 2, generator=g, dtype=torch.float64), torch.randn(m, 2, generator=g, dtype=torch.float64)
    a, b = torch.rand(n, generator=g, dtype=torch.float64), torch.rand(m, generator=g, dtype=torch.float64)
    return x, y, a / a.sum(), b / b.sum()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--eps", type=float, default=0.003)
    ap.add_argument("--cases", type=int, default=200)
    ap.add_argument("--backend", default="tensorized")
    ap.add_argument("--float32", action="store_true")
    ap.add_argument("--plain", action="store_true", help="accelerate=False for the solve under test")
    args = ap.parse_args()
    dtype = torch.float32 if args.float32 else torch.float64
    unconverged = wrong = updates = 0
    start = time.time()
    warnings.simplefilter("ignore")
    for seed in range(args.cases):
        x, y, a, b = case(seed)
        ref = float(sinkhorn(x, y, a, b, eps=args.eps, accelerate=False, tol=1e-10, max_iter=200000).value)
        try:
            res = sinkhorn(*(t.to(dtype) for t in (x, y, a, b)), eps=args.eps, backend=args.backend, max_iter=3000,
                           accelerate=not args.plain)
            value, converged, n_iter = float(res.value), bool(res.converged), int(res.n_iter)
        except FloatingPointError:
            value, converged, n_iter = float("nan"), False, 3000
        updates += n_iter
        unconverged += not converged
        if converged and not abs(value - ref) <= 1e-3 * abs(ref):
            wrong += 1
            print("converged but wrong:", seed, value, ref, n_iter)
    print(f"eps={args.eps} {args.backend} {dtype} plain={args.plain}: unconverged {unconverged}/{args.cases}, "
          f"converged but wrong {wrong}, updates {updates}, {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
