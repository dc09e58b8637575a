"""Tiny clouds with uneven weights (``../2026-11-28-both-marginals/tiny_sweep.py``'s generator): the default
(accelerated) solve and plain Sinkhorn, each to tol 1e-4 in at most 3000 updates, against a float64 plain
reference (tol 1e-10).

    PYTHONPATH=TREE python tiny_vs_plain.py [--eps 0.003] [--cases 200] [--backend tensorized]

Prints, for the accelerated solve: unconverged, converged but more than 1e-3 (relative) off the reference,
unconverged where plain converged, more than 3x plain's updates (both converged), updates in all; and the
same totals for plain Sinkhorn.
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


def solve(x, y, a, b, eps, backend, accelerate):
    try:
        res = sinkhorn(x, y, a, b, eps=eps, backend=backend, max_iter=3000, accelerate=accelerate)
        return float(res.value), bool(res.converged), int(res.n_iter)
    except FloatingPointError:
        return float("nan"), False, 3000


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--eps", type=float, default=0.003)
    ap.add_argument("--cases", type=int, default=200)
    ap.add_argument("--backend", default="tensorized")
    args = ap.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    start = time.time()
    stats = dict(unconverged=0, wrong=0, fails_where_plain_converges=0, over_3x_plain=0, updates=0)
    plain_stats = dict(unconverged=0, updates=0)
    for seed in range(args.cases):
        x, y, a, b = case(seed)
        ref = float(sinkhorn(x, y, a, b, eps=args.eps, accelerate=False, tol=1e-10, max_iter=200000).value)
        value, conv, it = solve(x, y, a, b, args.eps, args.backend, True)
        _, pconv, pit = solve(x, y, a, b, args.eps, args.backend, False)
        stats["updates"] += it
        stats["unconverged"] += not conv
        stats["wrong"] += conv and not abs(value - ref) <= 1e-3 * abs(ref)
        stats["fails_where_plain_converges"] += pconv and not conv
        stats["over_3x_plain"] += conv and pconv and it > 3 * pit
        plain_stats["updates"] += pit
        plain_stats["unconverged"] += not pconv
        if (pconv and not conv) or (conv and pconv and it > 3 * pit):
            print("seed", seed, "accelerated", it, conv, "plain", pit, flush=True)
    print(f"eps={args.eps} {args.backend}, {args.cases} cases: accelerated {stats}; plain {plain_stats}; "
          f"{time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
