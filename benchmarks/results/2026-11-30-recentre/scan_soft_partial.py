"""Soft SROT partial OT on small problems: solves reported converged whose plan carries the wrong mass.

    python scan_soft_partial.py N DTYPE COMPILED

N random problems (seeds 0..N-1) of 5-79 x 5-79 points in 2-D (y shifted by 1), uniform random scores,
SROTLoss(p, blur=0.05, strategy="soft", mass=0.9, debias=False) at p = 1 and 2 (tol 1e-3, the defaults
otherwise), DTYPE float32 or float64; COMPILED 1: the compiled loop (the default on CPU), 0: the torch loop
(``_loop.COMPILED_LOOP = False``). Prints each solve reported converged whose dense plan's mass is more than 1e-2
from 0.9, then the counts: right, wrong, not converged, and the updates summed over the solves.
"""
import sys
import warnings

import torch

from srot_fast import SROTLoss, _loop

warnings.simplefilter("ignore")
n_problems, dtype, compiled = int(sys.argv[1]), getattr(torch, sys.argv[2]), sys.argv[3] == "1"
_loop.COMPILED_LOOP = compiled
right = wrong = unconverged = updates = 0
for seed in range(n_problems):
    gen = torch.Generator().manual_seed(seed)
    n, m = int(torch.randint(5, 80, (1,), generator=gen)), int(torch.randint(5, 80, (1,), generator=gen))
    x, y = torch.randn(n, 2, generator=gen), torch.randn(m, 2, generator=gen) + 1
    scores = (torch.rand(n, generator=gen), torch.rand(m, generator=gen))
    for p in (1, 2):
        loss = SROTLoss(p=p, blur=0.05, strategy="soft", mass=0.9, debias=False)
        loss(x.to(dtype), y.to(dtype), scores=tuple(s.to(dtype) for s in scores))
        res = loss.last_result
        updates += int(res.n_iter)
        mass = float(res.plan().double().sum())
        if not res.converged:
            unconverged += 1
        elif abs(mass - 0.9) > 1e-2:
            wrong += 1
            print(f"seed {seed} ({n} x {m}), p = {p}: converged, plan mass {mass:.4f}, error {res.marginal_error:.2e}")
        else:
            right += 1
print(f"{sys.argv[2]} compiled={compiled}: right {right} wrong {wrong} unconverged {unconverged} updates {updates}")
