"""Updates to a relative marginal error of 1e-4 on bench_convergence.py's grid, with the ``srot_fast`` of a given
source tree (e.g. a ``git worktree`` of an older revision), so that revisions without ``accelerate=`` can be
compared with the current loop on the same problems.

    python grid_tree.py TREE OUT.json [--n 1000 4000] [--d 2 64] [--offsets both|no|yes] [--accelerate]

TREE goes first on ``sys.path``: its ``srot_fast`` and ``kernels`` are the ones imported. Problem, schedule and
settings are bench_convergence.py's (two float64 unit Gaussians one apart, blur = ratio x bounding-box diagonal,
eps = blur**p, scaling 0.5, backend 'cpu', tau 1, mass 0.5, offsets 0.1 diam**p U(0, 1), max_iter 20000).
``--accelerate`` passes ``accelerate=True`` (the current loop's default); without it no such argument is passed.
"""
import argparse
import itertools
import json
import math
import subprocess
import sys
import time
import warnings

import torch


def problem(n, d, p, offsets, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen, dtype=torch.float64)
    y = torch.randn(n, d, generator=gen, dtype=torch.float64)
    y[:, 0] += 1.0
    lo = torch.minimum(x.min(0).values, y.min(0).values)
    hi = torch.maximum(x.max(0).values, y.max(0).values)
    diam = float((hi - lo).norm())
    u = v = None
    if offsets:
        gamma = 0.1 * diam**p
        u = gamma * torch.rand(n, generator=gen, dtype=torch.float64)
        v = gamma * torch.rand(n, generator=gen, dtype=torch.float64)
    return x, y, u, v, diam


def penalty_kwargs(penalty):
    if penalty == "partial":
        return dict(penalty="balanced", mass=0.5)
    if penalty in ("kl", "tv"):
        return dict(penalty=penalty, tau=1.0)
    return dict(penalty="balanced")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tree")
    ap.add_argument("out")
    ap.add_argument("--n", type=int, nargs="+", default=[1000])
    ap.add_argument("--d", type=int, nargs="+", default=[2])
    ap.add_argument("--offsets", choices=["both", "no", "yes"], default="both")
    ap.add_argument("--accelerate", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, args.tree)
    from srot_fast.sinkhorn import sinkhorn
    extra = dict(accelerate=True) if args.accelerate else {}
    revision = subprocess.run(["git", "-C", args.tree, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip() or None
    offs = {"both": (False, True), "no": (False,), "yes": (True,)}[args.offsets]
    rows = []
    for p, pen, d, ratio, n, off in itertools.product((1, 2), ("balanced", "kl", "tv", "partial"), args.d,
                                                      (0.1, 0.02, 0.005), args.n, offs):
        x, y, u, v, diam = problem(n, d, p, off)
        eps = (ratio * diam) ** p
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                res = sinkhorn(x, y, p=p, eps=eps, u=u, v=v, scaling=0.5, diameter=diam, tol=1e-4,
                               max_iter=20000, backend="cpu", **extra, **penalty_kwargs(pen))
                it, err, val = int(res.n_iter), float(res.marginal_error), float(res.value)
            except FloatingPointError:
                it, err, val = None, None, None
        row = dict(p=p, penalty=pen, d=d, ratio=ratio, n=n, offsets=off, n_iter=it, marginal_error=err,
                   value=val, seconds=time.perf_counter() - t0)
        row["converged"] = val is not None and math.isfinite(val) and err <= 1e-4 and it < 20000
        rows.append(row)
        print(json.dumps(row), flush=True)
        json.dump(dict(revision=revision, accelerate=args.accelerate, rows=rows), open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
