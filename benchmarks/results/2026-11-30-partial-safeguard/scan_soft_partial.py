"""Soft SROT partial OT on small float32 problems: results reported converged whose plan is off.

    python scan_soft_partial.py [N]

N random problems (seeds 0..N-1) of 5-79 x 5-79 points in 2-D (y shifted by 1), uniform random scores,
SROTLoss(p, blur=0.05, strategy="soft", mass=0.9, debias=False) at p = 1 and 2, float32 (the defaults otherwise:
tol 1e-3). Counts the solves reported converged whose transported mass (from the dense plan) is more than 1e-2
from 0.9, and the solves reported not converged.
"""
import sys
import warnings

import torch

from srot_fast import SROTLoss

warnings.simplefilter("ignore")
n_problems = int(sys.argv[1]) if len(sys.argv) > 1 else 200
total = wrong = unconverged = 0
for seed in range(n_problems):
    gen = torch.Generator().manual_seed(seed)
    n, m = int(torch.randint(5, 80, (1,), generator=gen)), int(torch.randint(5, 80, (1,), generator=gen))
    x, y = torch.randn(n, 2, generator=gen), torch.randn(m, 2, generator=gen) + 1
    scores = (torch.rand(n, generator=gen), torch.rand(m, generator=gen))
    for p in (1, 2):
        loss = SROTLoss(p=p, blur=0.05, strategy="soft", mass=0.9, debias=False)
        loss(x, y, scores=scores)
        res = loss.last_result
        total += 1
        mass = float(res.plan().double().sum())
        if not res.converged:
            unconverged += 1
        elif abs(mass - 0.9) > 1e-2:
            wrong += 1
            print(f"seed {seed} ({n} x {m}), p = {p}: converged, plan mass {mass:.4f}, error {res.marginal_error:.2e}")
print(f"solves {total}: reported converged with the plan's mass off by > 1e-2: {wrong}; not converged: {unconverged}")
