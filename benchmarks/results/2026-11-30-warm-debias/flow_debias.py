"""A 2-D gradient flow with SROTLoss(p=2, blur=0.05, tol=1e-3, warm_start=True): 100 steps of a blob of N points
(std 0.3) towards N points on the unit circle, x <- x - 0.05 N grad, one thread. Three modes, alternated: no
debiasing; debiasing with its two self-transport solves cold at each call (as before they were warm-started; the
kept potentials are dropped before each call); debiasing warm-started. One JSON line per (N, mode, round): seconds,
updates of the transport solves, updates of the debiasing solves, final value.
Usage: python flow_debias.py ROUNDS N [N ...]."""
import json
import math
import sys
import time
import warnings

import torch

from srot_fast import SROTLoss

warnings.simplefilter("ignore")
torch.set_num_threads(1)
rounds, sizes = int(sys.argv[1]), [int(s) for s in sys.argv[2:]]
for n in sizes:
    for rnd in range(rounds):
        for mode in ("no-debias", "debias-cold", "debias-warm"):
            gen = torch.Generator().manual_seed(0)
            x = 0.3 * torch.randn(n, 2, generator=gen)
            angle = 2 * math.pi * torch.rand(n, generator=gen)
            y = torch.stack([angle.cos(), angle.sin()], 1)
            loss = SROTLoss(p=2, blur=0.05, tol=1e-3, warm_start=True, debias=mode != "no-debias")
            counts = {"transport": 0, "debias": 0}
            solve = loss._solve

            def spy(a, b, *args, solve=solve, counts=counts, **kw):
                res = solve(a, b, *args, **kw)
                counts["debias" if a is b else "transport"] += int(res.n_iter)
                return res

            loss._solve = spy
            t0 = time.perf_counter()
            for _ in range(100):
                if mode == "debias-cold":
                    loss._warm_debias = None
                xg = x.clone().requires_grad_()
                value = loss(xg, y)
                (g,) = torch.autograd.grad(value, xg)
                x = x - 0.05 * n * g
            print(json.dumps(dict(n=n, mode=mode, round=rnd, seconds=time.perf_counter() - t0, **counts,
                                  value=float(value))), flush=True)
