"""Kept fraction of a block-sparse pass on the cloud3d data (n = 20 000, SROT hard weights from the true outlier
mask, p = 2) at blur 0.05 and 0.02: with the potentials of a solved plan and with zero potentials (h = log b)."""
import time

import torch
from srot_fast.kernels import blocksparse

from srot_fast.datasets import make_cloud_3d
from srot_fast.sinkhorn import sinkhorn
from srot_fast.weights import hard_weights

torch.set_num_threads(1)
n = 20000
d = make_cloud_3d(n, seed=0)
u = torch.full((n,), 1.0 / n)
a = hard_weights(u, d.x_outlier.double(), u, torch.ones(n))[0]
for blur in (0.05, 0.02):
    eps = blur ** 2
    t = time.perf_counter()
    r = sinkhorn(d.x, d.y, a, u, p=2, eps=eps, tol=1e-3, backend="blocksparse")
    dt = time.perf_counter() - t
    blocksparse.softmin(d.x, d.y, torch.log(u) + r.g / eps, eps, 2)
    k1 = blocksparse.last_kept_fraction()
    blocksparse.softmin(d.x, d.y, torch.log(u), eps, 2)
    k0 = blocksparse.last_kept_fraction()
    print("blur", blur, "solve s", round(dt, 1), "iters", r.n_iter, "kept solved", k1, "kept log b", k0, flush=True)
