"""KL updates to tol 1e-6 with unequal masses: 1000 vs 800 points (unit Gaussians 0.5 apart, 2-D, float64),
masses 1 and 1.3, p = 2, tau in {0.1, 1, 10, 100}, blur 0.05 and 0.02, seeds 0-2, default backend.

    PYTHONPATH=TREE python kl_probe.py      # one line per seed: tau/blur:updates value; then the total
"""
import warnings

import torch

import srot_fast

warnings.simplefilter("ignore")
torch.set_num_threads(1)
print(srot_fast.__file__)
total = 0
for seed in range(3):
    torch.manual_seed(seed)
    x = torch.randn(1000, 2).double()
    y = (torch.randn(800, 2) + 0.5).double()
    b = torch.full((800,), 1.3 / 800).double()
    out = []
    for tau in (0.1, 1.0, 10.0, 100.0):
        for blur in (0.05, 0.02):
            r = srot_fast.sinkhorn(x, y, None, b, p=2, eps=blur**2, max_iter=20000, tol=1e-6, penalty="kl", tau=tau)
            total += int(r.n_iter)
            out.append(f"{tau:g}/{blur:g}:{int(r.n_iter)}{'' if bool(r.converged) else '!'} v={float(r.value):.8f}")
    print(seed, " ".join(out), flush=True)
print("total", total)
