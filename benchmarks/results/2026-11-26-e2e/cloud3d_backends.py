"""One plan of ``srot-fast cloud3d`` (SROT hard: the VAT-flagged source points replaced by the true outlier mask,
p = 2, blur 0.05, tol 1e-3) solved by ``blocksparse`` and by the dense ``cpu`` kernel, one after the other, with the
fraction of point pairs a block-sparse pass keeps with zero potentials (h = log b) and with the solved ones.

    python cloud3d_backends.py N [--threads T]   ->  JSON lines on stdout
"""
import argparse
import json
import time

import torch
from srot_fast.kernels import blocksparse

from srot_fast.datasets import make_cloud_3d
from srot_fast.sinkhorn import sinkhorn
from srot_fast.weights import hard_weights


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("n", type=int)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n, eps = args.n, 0.05**2
    d = make_cloud_3d(n, seed=0)
    u = torch.full((n,), 1.0 / n)
    a = hard_weights(u, d.x_outlier.double(), u, torch.ones(n))[0]
    log_b = torch.log(u)
    blocksparse.softmin(d.x, d.y, log_b, eps, 2)
    print(json.dumps({"n": n, "threads": args.threads, "kept_log_b": blocksparse.last_kept_fraction()}), flush=True)
    values = {}
    for backend in ("blocksparse", "cpu"):
        t = time.perf_counter()
        r = sinkhorn(d.x, d.y, a, u, p=2, eps=eps, tol=1e-3, backend=backend)
        rec = {"backend": backend, "solve_s": round(time.perf_counter() - t, 1), "n_iter": int(r.n_iter),
               "passes": getattr(r, "passes", None), "value": float(r.value),
               "marginal_error": float(r.marginal_error)}
        if backend == "blocksparse":
            blocksparse.softmin(d.x, d.y, log_b + r.g / eps, eps, 2)
            rec["kept_solved"] = blocksparse.last_kept_fraction()
        values[backend] = rec["value"]
        print(json.dumps(rec), flush=True)
    print(json.dumps({"value_rel_diff": abs(values["blocksparse"] - values["cpu"]) / abs(values["cpu"])}))


if __name__ == "__main__":
    main()
