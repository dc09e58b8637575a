"""Dense ``cpu`` backend against ``blocksparse`` on 2-D clouds at blur = 0.01 x diameter (CPU).

Data: x = a mixture of 4 Gaussians (std 0.08) in the unit square, y = a uniform square shifted by (0.1, 0)
with a Gaussian blob, float32, uniform weights; blur = 0.01 x the bounding-box diagonal (eps = blur^p).

Three measurements, each timing the dense and the block-sparse code in the same run, interleaved:

- ``pass``: seconds of one soft-min pass (x against y) at the target eps, per n, for p = 1 and p = 2, with
  column log-weights h = log b (zero potentials), or with ``--potentials`` h = log b + g / eps from a
  ``blocksparse`` solve at that n (fixed schedule, ``tol=None``): the potentials decide what can be dropped;
  plus the fraction of pairs the block-sparse pass evaluated.
- ``cold``: seconds of loss + gradient from scratch (``SROTLoss``, debias off, ``--tol``, default 1e-3, value_tol
  tol / 10) on the dense ``cpu`` backend and on ``blocksparse`` (coarse-to-fine start, srot_fast/_multiscale.py),
  at each ``--thresholds`` value for the block-sparse runs (``--no-dense``: block-sparse only).
- ``loss``: seconds of loss + gradient (``SROTLoss``, debias off; ``--tol``, default None: GeomLoss's fixed
  schedule, so both backends do the same updates; with ``--warm K``, a gradient-flow step instead: K updates
  at the target eps from given potentials, no eps-scaling) for soft SROT (p = 1, KL reach 0.3, offsets from
  synthetic scores, gamma = max C) and plain balanced OT at p = 2; relative difference of the values and of
  the gradients.

Run: ``python benchmarks/bench_blocksparse.py --pass-sizes 10000 20000 50000 100000 200000
--loss-sizes 20000 50000 --out results.json`` (threads: ``--threads``, default torch's).
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import time

import torch
from srot_fast.kernels import blocksparse, cpu_ops

from srot_fast import SROTLoss, sinkhorn


def clouds(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    centres = torch.tensor([[0.2, 0.2], [0.8, 0.3], [0.3, 0.8], [0.7, 0.7]])
    x = centres[torch.randint(4, (n,), generator=g)] + 0.08 * torch.randn(n, 2, generator=g)
    y = torch.rand(n, 2, generator=g) + torch.tensor([0.1, 0.0])
    k = n // 4
    y[:k] = torch.tensor([0.5, 0.5]) + 0.05 * torch.randn(k, 2, generator=g)
    both = torch.cat([x, y])
    diam = float((both.amax(0) - both.amin(0)).norm())
    return x, y, diam


def scores(x: torch.Tensor, y: torch.Tensor):
    """Synthetic detector outputs P(target) in (0, 1): smooth in the position, so a few points on each side
    look like the other side's."""
    return torch.sigmoid(4 * (x[:, 0] - 0.5)), torch.sigmoid(4 * (y[:, 0] - 0.4))


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def bench_pass(n: int, p: int, potentials: bool, dense: bool = True) -> dict:
    x, y, diam = clouds(n)
    eps = (0.01 * diam) ** p
    h = torch.full((n,), -math.log(n))
    if potentials:
        h = h + sinkhorn(x, y, p=p, eps=eps, tol=None, backend="blocksparse").g / eps
    blocksparse.softmin(x, y, h, eps, p)  # ordering cached, library loaded
    sparse, t_sparse = timed(lambda: blocksparse.softmin(x, y, h, eps, p))
    kept = blocksparse.last_kept_fraction()
    if not dense:
        return dict(kind="pass", n=n, p=p, eps=eps, potentials=potentials, sparse_s=t_sparse, kept=kept)
    dense, t_dense = timed(lambda: cpu_ops.softmin(x, y, h, eps, p))
    err = float(((sparse.double() - dense.double()).abs().max()) / eps)
    return dict(kind="pass", n=n, p=p, eps=eps, potentials=potentials, dense_s=t_dense, sparse_s=t_sparse,
                speedup=t_dense / t_sparse, kept=kept, max_abs_diff_over_eps=err)


def make_loss(blur: float, case: str, tol, backend: str, warm: int = 0) -> SROTLoss:
    kw = dict(blur=blur, debias=False, tol=tol, backend=backend, warm_start=warm > 0)
    if case == "soft_p1":
        return SROTLoss(p=1, reach=0.3, strategy="soft", **kw)
    return SROTLoss(p=2, reach=None, **kw)


def loss_and_grad(loss: SROTLoss, x0, y0, case: str):
    """(value, dx, dy, n_iter) of the case's SROTLoss."""
    x, y = x0.clone().requires_grad_(), y0.clone().requires_grad_()
    value = loss(x, y, scores=scores(x0, y0)) if case == "soft_p1" else loss(x, y)
    gx, gy = torch.autograd.grad(value, (x, y))
    return float(value.detach()), gx, gy, loss.last_result.n_iter


def bench_loss(n: int, case: str, tol, warm: int) -> dict:
    """Loss + gradient on both backends. ``warm`` > 0: a flow step -- potentials from one (untimed) blocksparse
    call from scratch (with ``tol``), then the timed call on points moved by 1e-3 x blur: ``warm`` updates at the
    target eps from those potentials (no eps-scaling), the same on both backends."""
    x0, y0, diam = clouds(n, seed=1)
    blur = 0.01 * diam
    out = {}
    x1, start = x0, None
    if warm:
        first = make_loss(blur, case, tol, "blocksparse", warm)
        loss_and_grad(first, x0, y0, case)
        start = first._warm  # the potentials SROTLoss keeps for warm_start
        x1 = x0 + 1e-3 * blur * torch.randn(x0.shape, generator=torch.Generator().manual_seed(2))
    for backend in ("cpu", "blocksparse"):
        loss = make_loss(blur, case, tol, backend, warm)
        if warm:
            loss._warm, loss.tol, loss.max_iter = start, 1e-300, warm  # exactly `warm` updates on both
        (value, gx, gy, n_iter), secs = timed(lambda: loss_and_grad(loss, x1, y0, case))  # noqa: B023
        out[backend] = dict(value=value, seconds=secs, gx=gx, gy=gy, n_iter=n_iter)
    d, s = out["cpu"], out["blocksparse"]
    rel = abs(s["value"] - d["value"]) / abs(d["value"])
    gerr = max(float((s[k] - d[k]).norm() / d[k].norm()) for k in ("gx", "gy"))
    return dict(kind="loss", case=case, n=n, blur=blur, tol=tol, warm=warm, dense_s=d["seconds"], sparse_s=s["seconds"],
                speedup=d["seconds"] / s["seconds"], value_dense=d["value"], value_sparse=s["value"],
                value_rel_diff=rel, grad_rel_diff=gerr, n_iter=d["n_iter"], n_iter_sparse=s["n_iter"])


def bench_cold(n: int, case: str, tol: float, thresholds, dense: bool) -> list:
    """Cold loss + gradient: dense ``cpu`` (if ``dense``) and ``blocksparse`` at each truncation threshold."""
    x0, y0, diam = clouds(n, seed=1)
    blur = 0.01 * diam
    runs = [("cpu", None)] if dense else []
    runs += [("blocksparse", t) for t in thresholds]
    rows, ref = [], None
    for backend, thr in runs:
        if thr is not None:
            blocksparse.THRESHOLD = thr
        loss = make_loss(blur, case, tol, backend)
        (value, gx, gy, n_iter), secs = timed(lambda: loss_and_grad(loss, x0, y0, case))  # noqa: B023
        row = dict(kind="cold", case=case, n=n, blur=blur, tol=tol, backend=backend, threshold=thr, seconds=secs,
                   value=value, n_iter=n_iter, passes=loss.last_result.passes)
        if ref is None and backend == "cpu":
            ref = (value, gx, gy, secs)
        elif ref is not None:
            row.update(speedup=ref[3] / secs, value_rel_diff=abs(value - ref[0]) / abs(ref[0]),
                       grad_rel_diff=max(float((g - r).norm() / r.norm()) for g, r in zip((gx, gy), ref[1:3])))
        rows.append(row)
        print(json.dumps(row), flush=True)
    blocksparse.THRESHOLD = thresholds[0]
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pass-sizes", type=int, nargs="*", default=[10000, 20000, 50000])
    ap.add_argument("--loss-sizes", type=int, nargs="*", default=[20000])
    ap.add_argument("--ps", type=int, nargs="*", default=[2, 1])
    ap.add_argument("--cases", nargs="*", default=["plain_p2", "soft_p1"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--potentials", action="store_true",
                    help="pass: h from a blocksparse solve (else h = log b, zero potentials)")
    ap.add_argument("--tol", type=float, default=None, help="loss: SROTLoss tol (default None: fixed schedule)")
    ap.add_argument("--warm", type=int, default=0,
                    help="loss: time a warm-started flow step of this many updates at the target eps")
    ap.add_argument("--dense-max", type=int, default=10**9, help="pass: no dense pass above this n")
    ap.add_argument("--cold-sizes", type=int, nargs="*", default=[])
    ap.add_argument("--no-dense", action="store_true", help="cold: skip the dense solve (too slow at this n)")
    ap.add_argument("--thresholds", type=float, nargs="*", default=[blocksparse.THRESHOLD],
                    help="cold: blocksparse.THRESHOLD values to run")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    meta = dict(threads=torch.get_num_threads(), machine=platform.machine(), torch=torch.__version__,
                threshold=blocksparse.THRESHOLD, compiled=cpu_ops.available())
    for n in args.pass_sizes:
        for p in args.ps:
            rows.append(bench_pass(n, p, args.potentials, n <= args.dense_max))
            print(json.dumps(rows[-1]), flush=True)
    for n in args.loss_sizes:
        for case in args.cases:
            rows.append(bench_loss(n, case, args.tol, args.warm))
            print(json.dumps(rows[-1]), flush=True)
    for n in args.cold_sizes:
        for case in args.cases:
            rows += bench_cold(n, case, 1e-3 if args.tol is None else args.tol, args.thresholds, not args.no_dense)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
