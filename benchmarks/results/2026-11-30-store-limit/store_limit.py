"""SROTLoss() (and reach = 1, KL) loss + gradient on two unit Gaussians 0.5 apart, d = 2, with the `cpu` backend's
small-problem limit for stored squared distances (srot_fast.geometry.STORE_SMALL) at 2^18 and 2^20 pairs (or
the limits in $LIMITS, e.g. LIMITS=18,22), alternated in one process: best of 7 after a warm-up call, ROUNDS rounds.
One JSON line per (n, reach, limit, round) with the time, the updates and the value.
Usage: python store_limit.py THREADS ROUNDS N [N ...]."""
import json
import os
import sys
import time
import warnings

import torch

import srot_fast.geometry as geometry
from srot_fast import SROTLoss

warnings.simplefilter("ignore")
threads, rounds, sizes = int(sys.argv[1]), int(sys.argv[2]), [int(s) for s in sys.argv[3:]]
limits = [1 << int(k) for k in os.environ.get("LIMITS", "18,20").split(",")]
torch.set_num_threads(threads)
for n in sizes:
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 2, generator=gen), torch.randn(n, 2, generator=gen)
    y[:, 0] += 0.5
    for reach in (None, 1.0):
        for rnd in range(rounds):
            for limit in limits:
                geometry.STORE_SMALL = geometry.STORE_COLD = limit  # (the runs here predate STORE_COLD)
                loss = SROTLoss(reach=reach)
                best = float("inf")
                for rep in range(8):
                    xg = x.clone().requires_grad_()
                    t0 = time.perf_counter()
                    value = loss(xg, y)
                    value.backward()
                    if rep:
                        best = min(best, time.perf_counter() - t0)
                print(json.dumps(dict(n=n, reach=reach, limit=limit, round=rnd, threads=threads, ms=best * 1e3,
                                      updates=int(loss.last_result.n_iter), value=float(value))), flush=True)
