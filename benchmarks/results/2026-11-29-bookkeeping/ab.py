"""SROTLoss() and geomloss.SamplesLoss() (both defaults; then both with reach = 1, KL; then SROTLoss alone for
partial OT, mass = 0.5 without debiasing, which GeomLoss does not offer), loss + gradient, one thread, two unit
Gaussians 0.5 apart, n = 32 to 1000: best of 9 after a warm-up round, interleaved; one JSON line per size with
the times, SROTLoss's updates and value. Run as PYTHONPATH=PKG python ab.py LABEL, PKG holding the srot_fast to
time (for another revision: a copy of its srot_fast/ with a link srot_fast/kernels -> its kernels/, see
run.sh)."""
import json
import sys
import time
import warnings

import geomloss
import torch
from srot_fast.kernels import cpu_ops

import srot_fast
from srot_fast import SROTLoss

warnings.simplefilter("ignore")
torch.set_num_threads(1)
CASES = [(n, d, None) for n, d in [(32, 2), (64, 2), (256, 2), (256, 64), (1000, 2), (1000, 64)]]
CASES += [(n, d, 1.0) for n, d in [(64, 2), (256, 2), (256, 64), (1000, 2)]]  # KL, reach 1 on both sides
CASES += [(n, d, "partial") for n, d in [(64, 2), (256, 2), (1000, 2)]]
for n, d, reach in CASES:
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, d, generator=gen), torch.randn(n, d, generator=gen)
    y[:, 0] += 0.5
    if reach == "partial":
        losses = {"srot": SROTLoss(mass=0.5, debias=False)}
    else:
        losses = {"srot": SROTLoss(reach=reach), "geomloss": geomloss.SamplesLoss(reach=reach)}
    best = dict.fromkeys(losses, float("inf"))
    for rep in range(10):
        for name, loss in losses.items():
            xg = x.clone().requires_grad_()
            t0 = time.perf_counter()
            value = loss(xg, y)
            value.backward()
            if rep:
                best[name] = min(best[name], time.perf_counter() - t0)
            if name == "srot":
                v = float(value)
    print(json.dumps(dict(label=sys.argv[1], n=n, d=d, reach=reach, srot_ms=best["srot"] * 1e3,
                          geomloss_ms=best["geomloss"] * 1e3 if "geomloss" in best else None,
                          updates=int(losses["srot"].last_result.n_iter), value=v, srot=srot_fast.__file__,
                          kernels=cpu_ops.__file__)), flush=True)
