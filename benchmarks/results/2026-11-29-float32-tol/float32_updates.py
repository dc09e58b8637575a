"""Updates to tol 1e-4 of the default (accelerated) sinkhorn in float32 and float64, and SROTLoss()'s updates.

    python float32_updates.py

Two 1000-point unit Gaussians in 2-D one apart (seeds 0-2), p = 2, eps = blur**2, the default backend,
max_iter 20000; then SROTLoss() (defaults) on 0.5-apart Gaussians at n = 1000 / 5000, d = 2 / 64.
"""
import warnings

import torch

import srot_fast

warnings.simplefilter("ignore")
for seed in range(3):
    torch.manual_seed(seed)
    x, y = torch.randn(1000, 2), torch.randn(1000, 2) + 1
    for blur in (0.05, 0.02):
        n = [int(srot_fast.sinkhorn(x.to(dt), y.to(dt), p=2, eps=blur**2, max_iter=20000, tol=1e-4).n_iter)
             for dt in (torch.float32, torch.float64)]
        print(f"seed {seed} blur {blur}: updates float32 {n[0]}, float64 {n[1]} ({n[0] / n[1]:.2f}x)")
for n, d in ((1000, 2), (1000, 64), (5000, 2)):
    torch.manual_seed(0)
    x, y = torch.randn(n, d), torch.randn(n, d) + 0.5
    its = []
    for dt in (torch.float32, torch.float64):
        loss = srot_fast.SROTLoss()
        loss(x.to(dt), y.to(dt))
        its.append(int(torch.as_tensor(loss.last_result.n_iter).max()))
    print(f"SROTLoss() n {n} d {d}: updates float32 {its[0]}, float64 {its[1]}")
