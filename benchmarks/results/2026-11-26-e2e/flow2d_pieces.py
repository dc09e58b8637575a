"""The pieces of ``srot-fast flow2d`` at large n, timed one by one (CPU): data, detector fit (capped training set)
and scoring, the backend 'auto' picks, W1 on subsamples, gamma = max C, and the cost of one soft-min pass at the
flow's eps with zero potentials (h = log b) (unless ``--no-pass``) and, with ``--solve``, with the potentials
of a solved SROT hard plan (what every warm-started flow step sees), with the fraction of point pairs the pass
kept.

    python flow2d_pieces.py N [--solve] [--no-pass] [--threads T]   ->  one JSON line on stdout
"""
import argparse
import json
import resource
import time

import torch
from srot_fast.kernels import blocksparse

from srot_fast.backends import resolve_backend
from srot_fast.datasets import make_flow_2d
from srot_fast.experiments import flow2d
from srot_fast.sinkhorn import sinkhorn
from srot_fast.weights import hard_weights


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, round(time.perf_counter() - t, 2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("n", type=int)
    ap.add_argument("--solve", action="store_true")
    ap.add_argument("--no-pass", dest="one_pass", action="store_false", help="skip the soft-min passes")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n, p, eps = args.n, flow2d.P, flow2d.BLUR ** flow2d.P
    rec = {"n": n, "threads": args.threads}
    d, rec["data_s"] = timed(lambda: make_flow_2d(n, flow2d.OUTLIER_FRAC, seed=0))
    x, y, is_out = d.alpha, d.beta0, d.alpha_outlier
    (scores, det), rec["detector_s"] = timed(lambda: flow2d.fit_detectors(
        x, y, is_out, ("vat",), seed=0, progress=False, device="cpu", max_points=flow2d.DETECTOR_POINTS))
    rec["detection"] = det["vat"]
    rec["auto_backend"] = resolve_backend("auto", n, n, "cpu", points=(x, y), eps=eps, p=p)
    gen = torch.Generator().manual_seed(1)
    ic = flow2d.subsample_index(int((~is_out).sum()), 1000, gen)
    ib = flow2d.subsample_index(n, 1000, gen)
    _, rec["w1_s"] = timed(lambda: flow2d.exact_w(x[~is_out][ic], y[ib], 1))
    _, rec["max_cost_s"] = timed(lambda: blocksparse.max_cost(x, y, p))
    log_b = torch.full((n,), -torch.log(torch.tensor(float(n))).item())
    if args.one_pass:
        _, rec["pass_log_b_s"] = timed(lambda: blocksparse.softmin(x, y, log_b, eps, p))
        rec["kept_log_b"] = blocksparse.last_kept_fraction()
    if args.solve:
        a = torch.full((n,), 1.0 / n)
        a_hard = hard_weights(a, scores["vat"], a, torch.ones(n))[0]
        res, rec["solve_s"] = timed(lambda: sinkhorn(x, y, a_hard, a, p=p, eps=eps, tol=flow2d.FLOW_TOL,
                                                     backend="blocksparse"))
        rec["solve_iters"] = int(res.n_iter)
        h = log_b + res.g / eps
        _, rec["pass_solved_s"] = timed(lambda: blocksparse.softmin(x, y, h, eps, p))
        rec["kept_solved"] = blocksparse.last_kept_fraction()
    rec["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    print(json.dumps(rec))


if __name__ == "__main__":
    main()
