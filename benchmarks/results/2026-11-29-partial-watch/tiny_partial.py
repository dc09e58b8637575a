"""Tiny partial OT problems with soft-SROT cost offsets: updates and failures of the accelerated and the plain loop.

    python tiny_partial.py EPS N [nooff]

N random problems (seeds 0..N-1) of 3-29 x 3-29 points in 2-D (y shifted by 0.5), uniform-random uneven weights,
offsets u, v = soft_offsets of uniform-random scores (the soft SROT cost gamma / CE), transported mass U(0.1, 0.9),
float64, the tensorized backend, tol 1e-4, max_iter 5000. ``nooff``: the same problems without offsets.
Prints the updates summed over the problems, the unconverged solves (ConvergenceWarning), those whose final error
is above 1e-2, the seeds where the accelerated solve fails and the plain one converges, and the solves that take
more than 3 x plain's updates + 50.
"""
import sys
import warnings

import torch

from srot_fast import sinkhorn
from srot_fast.weights import soft_offsets

eps, n_problems = float(sys.argv[1]), int(sys.argv[2])
stats = {True: [0, 0, 0], False: [0, 0, 0]}
fails, slow = [], []
for seed in range(n_problems):
    gen = torch.Generator().manual_seed(seed)
    n, m = (int(torch.randint(3, 30, (1,), generator=gen)) for _ in range(2))
    x = torch.randn(n, 2, generator=gen, dtype=torch.float64)
    y = torch.randn(m, 2, generator=gen, dtype=torch.float64) + 0.5
    a = torch.rand(n, generator=gen, dtype=torch.float64) + 0.05
    b = torch.rand(m, generator=gen, dtype=torch.float64) + 0.05
    a, b = a / a.sum(), b / b.sum()
    sx, sy = torch.rand(n, generator=gen, dtype=torch.float64), torch.rand(m, generator=gen, dtype=torch.float64)
    cost = ((x[:, None] - y[None]) ** 2).sum(-1) / 2
    u, v = soft_offsets(sx, sy, float(cost.max()))
    if "nooff" in sys.argv:
        u = v = None
    mass = float(torch.rand(1, generator=gen)) * 0.8 + 0.1
    res = {}
    for acc in (True, False):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            r = sinkhorn(x, y, a, b, eps=eps, mass=mass, u=u, v=v, tol=1e-4, max_iter=5000, backend="tensorized",
                         accelerate=acc)
        res[acc] = (int(r.n_iter), len(caught) > 0, float(r.marginal_error))
        stats[acc][0] += res[acc][0]
        stats[acc][1] += res[acc][1]
        stats[acc][2] += res[acc][2] > 1e-2
    if res[True][1] and not res[False][1]:
        fails.append(seed)
    if res[True][0] > 3 * res[False][0] + 50:
        slow.append((seed, res[True][0], res[False][0]))
print(sys.argv[1:], "accelerated: updates %d, unconverged %d, error > 1e-2 %d" % tuple(stats[True]),
      "| plain: %d %d %d" % tuple(stats[False]), "| accelerated fails where plain converges:", fails,
      "| > 3x plain:", slow)
