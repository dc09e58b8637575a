"""Block-sparse Triton passes against the dense Triton backend on a CUDA device (2-D and 3-D, small blur).

    python benchmarks/gpu_blocksparse.py [--sizes 100000 1000000] [--d 2 3] [--p 1 2] [--iters 20]
                                         [--cold-sizes 100000 1000000] [--cold-d 2] [--budget S] [--out F.json]
    python benchmarks/gpu_blocksparse.py --dry-run      # CPU, TRITON_INTERPRET=1, tiny sizes: checks the script

Problem: x uniform in the unit cube [0, 1]^d, y uniform in [0.1, 1.1] x [0, 1]^(d-1), float32, uniform weights,
blur = 0.01 x bounding-box diagonal, eps = blur**p, balanced OT. For each case: a loss + gradient (w.r.t. x) of
``sinkhorn(..., tol=1e-300, max_iter=iters)`` on ``backend='triton'`` and on ``backend='blocksparse'`` (equal updates,
eps-scaling included, the coarse-to-fine start off; each (d, p) compiled and autotuned first on a 2-update solve of
at most 100k points, outside the timings), their times, the value difference and the largest gradient
difference; then one soft-min pass at the solved potentials on each backend, with the fraction of pairs the
block-sparse pass kept: the block-sparse pass timed once pruning (``sparse_pass_s``) and once reusing the stored
pruning (``sparse_pass_reused_s``), and the pruning alone (``pruning_s``). Then, for each ``--cold-sizes`` n and
d (p = 2), a cold loss + gradient to
``tol=1e-3, value_tol=1e-4`` on both backends (the block-sparse one with its coarse-to-fine start), with
updates, passes, times and the value difference (both stop at tol 1e-3: ~1e-5 agreement expected). Writes
``blocksparse.json`` to ``--out`` (default ``$OUT`` or the current folder), rewritten after every case; once
``--budget`` seconds have passed, the remaining cases are recorded as skipped.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
import warnings


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--d", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--p", type=int, nargs="+", default=[2, 1])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--cold-sizes", type=int, nargs="*", default=[100_000])
    ap.add_argument("--cold-d", type=int, nargs="+", default=None, help="dimensions of the cold solves (--d)")
    ap.add_argument("--budget", type=float, default=float("inf"), help="seconds after which no new case starts")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.sizes, args.d, args.iters, args.cold_sizes = [256], [2], 2, [256]
    import torch
    from srot_fast.kernels import blocksparse as bs
    from srot_fast.kernels.triton import blocksparse as tbs
    from srot_fast.kernels.triton import launchers

    from srot_fast import _multiscale as ms
    from srot_fast import sinkhorn
    from srot_fast.geometry import bbox_diameter

    dev = "cpu" if args.dry_run else "cuda"
    if args.dry_run:
        bs.MIN_PAIRS, bs.DENSE_FRACTION = 0, 2.0  # prune even tiny problems
        bs._on_gpu = lambda t: tbs  # CPU tensors through the CUDA path's kernels
    elif not torch.cuda.is_available():
        print("needs a CUDA device (or --dry-run)", file=sys.stderr)
        return 2
    coarse_min_pairs = 0 if args.dry_run else ms.MIN_PAIRS

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    out = args.out or os.path.join(os.environ.get("OUT", "."), "blocksparse.json")
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=torch.cuda.get_device_name() if dev == "cuda" else "cpu (TRITON_INTERPRET=1)",
                torch=torch.__version__, argv=sys.argv[1:])
    rows = []

    def clouds(n, d, p):
        gen = torch.Generator(device=dev).manual_seed(0)
        x = torch.rand(n, d, device=dev, generator=gen)
        y = torch.rand(n, d, device=dev, generator=gen)
        y[:, 0] += 0.1
        return x, y, (0.01 * bbox_diameter(x, y)) ** p

    def timed(fn, *a):
        sync()
        t0 = time.perf_counter()
        fn(*a)
        sync()
        return time.perf_counter() - t0

    def save(row):
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(out, "w") as fh:
            json.dump(dict(meta=meta, rows=rows), fh, indent=1)

    start = time.perf_counter()

    def over_budget(kind, **case):
        if time.perf_counter() - start <= args.budget:
            return False
        save(dict(kind=kind, skipped=f"budget of {args.budget} s spent", **case))
        return True

    ms.MIN_PAIRS = 1 << 62  # equal updates: the ordinary schedule on both backends
    warm = set()
    for n in args.sizes:
        for d in args.d:
            for p in args.p:
                if over_budget("equal_updates", n=n, d=d, p=p):
                    continue
                x, y, eps = clouds(n, d, p)
                row = dict(kind="equal_updates", n=n, d=d, p=p, eps=eps, iters=args.iters)
                res = {}
                if (d, p) not in warm:  # compile and autotune outside the timings
                    warm.add((d, p))
                    for backend in ("triton", "blocksparse"):
                        xs, ys, _ = clouds(min(n, 100_000), d, p)
                        xs.requires_grad_()
                        with warnings.catch_warnings():
                            warnings.simplefilter("ignore")
                            r = sinkhorn(xs, ys, p=p, eps=eps, tol=1e-300, max_iter=2, backend=backend)
                        torch.autograd.grad(r.value, xs)
                for backend in ("triton", "blocksparse"):
                    xg = x.clone().requires_grad_()
                    sync()
                    t0 = time.perf_counter()
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        r = sinkhorn(xg, y, p=p, eps=eps, tol=1e-300, max_iter=args.iters, backend=backend)
                    (grad,) = torch.autograd.grad(r.value, xg)
                    sync()
                    row[f"{backend}_s"] = time.perf_counter() - t0
                    row[f"{backend}_passes"] = int(r.passes)
                    res[backend] = (r, grad)
                (r0, g0), (r1, g1) = res["triton"], res["blocksparse"]
                v0, v1 = float(r0.value.detach()), float(r1.value.detach())
                row["value_rel_diff"] = abs(v1 - v0) / abs(v0)
                row["grad_max_diff"] = float((g1 - g0).abs().max()) / max(float(g0.abs().max()), 1e-30)
                h = (-math.log(n) + r1.g.detach() / eps).to(x.dtype)  # solved column log-weights
                ox, oy = tbs._order(x[None]), tbs._order(y[None])
                hs = h[None].gather(1, oy.perm)
                launchers.softmin(x, y, h, eps, p)  # compile, autotune
                row["dense_pass_s"] = timed(launchers.softmin, x, y, h, eps, p)
                ox.pruned = None  # the pass prunes (the stored pruning is forgotten) ...
                row["sparse_pass_s"] = timed(tbs.softmin, x, y, h, eps, p)
                row["sparse_pass_reused_s"] = timed(tbs.softmin, x, y, h, eps, p)  # ... then reuses it
                row["pruning_s"] = timed(tbs.block_pairs, ox, oy, hs, eps, p)
                row["kept_fraction"] = bs.last_kept_fraction()
                row["pass_speedup"] = row["dense_pass_s"] / row["sparse_pass_s"]
                row["reused_pass_speedup"] = row["dense_pass_s"] / row["sparse_pass_reused_s"]
                row["solve_speedup"] = row["triton_s"] / row["blocksparse_s"]
                save(row)
    ms.MIN_PAIRS = coarse_min_pairs  # cold solves: the block-sparse one takes the coarse-to-fine start
    for n in args.cold_sizes:
        for d in args.cold_d or args.d:
            if over_budget("cold", n=n, d=d, p=2):
                continue
            x, y, eps = clouds(n, d, 2)
            row = dict(kind="cold", n=n, d=d, p=2, eps=eps, tol=1e-3, value_tol=1e-4)
            values = {}
            for backend in ("triton", "blocksparse"):
                xg = x.clone().requires_grad_()
                sync()
                t0 = time.perf_counter()
                r = sinkhorn(xg, y, p=2, eps=eps, tol=1e-3, value_tol=1e-4, backend=backend)
                torch.autograd.grad(r.value, xg)
                sync()
                row[f"{backend}_s"] = time.perf_counter() - t0
                row[f"{backend}_updates"], row[f"{backend}_passes"] = int(r.n_iter), int(r.passes)
                row[f"{backend}_converged"] = bool(r.converged)
                values[backend] = float(r.value.detach())
            row["value_rel_diff"] = abs(values["blocksparse"] - values["triton"]) / abs(values["triton"])
            row["solve_speedup"] = row["triton_s"] / row["blocksparse_s"]
            save(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
