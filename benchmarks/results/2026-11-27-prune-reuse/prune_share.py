"""A cold block-sparse solve with the pruning margin REUSE_SLACK given on the command line: updates, passes,
prunings and the seconds spent in them, then one pass at the solution; with a 4th argument, also the drift of h
(max - min of h - h_previous, nats) between consecutive passes at the target eps.

    python prune_share.py N P SLACK [spans]
"""
import math
import sys
import time

import torch
from srot_fast.kernels import blocksparse as bs

from srot_fast import sinkhorn
from srot_fast.geometry import bbox_diameter

n = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
p = int(sys.argv[2]) if len(sys.argv) > 2 else 2
bs.REUSE_SLACK = float(sys.argv[3]) if len(sys.argv) > 3 else bs.REUSE_SLACK
spans = len(sys.argv) > 4

calls = []
real_prune = bs._prune


def timed_prune(*a):
    t0 = time.perf_counter()
    out = real_prune(*a)
    calls.append(time.perf_counter() - t0)
    return out


bs._prune = timed_prune
torch.manual_seed(0)
x, y = torch.rand(n, 2), torch.rand(n, 2)
y[:, 0] += 0.1
eps = (0.01 * bbox_diameter(x, y)) ** p
t = time.perf_counter()
r = sinkhorn(x, y, p=p, eps=eps, tol=1e-3, backend="blocksparse")
print("slack", bs.REUSE_SLACK, "solve", round(time.perf_counter() - t, 2), "updates", int(r.n_iter), "passes",
      r.passes, "prunings", len(calls), "pruning s", round(sum(calls), 2), "value", float(r.value))
h = (-math.log(n) + r.g / eps).float()
bs.softmin(x, y, h, eps, p)
t = time.perf_counter()
bs.softmin(x, y, h, eps, p)
print(f"pass {time.perf_counter() - t:.3f} s, kept {bs.last_kept_fraction():.4f}")
if not spans:
    sys.exit()

log = []
real_softmin = bs.softmin


def spy(x_, y_, h_, eps_, p_, **kw):
    log.append((x_.data_ptr(), float(eps_), h_.detach().double().clone()))
    return real_softmin(x_, y_, h_, eps_, p_, **kw)


bs.softmin = spy
sinkhorn(x, y, p=p, eps=eps, tol=1e-3, backend="blocksparse")
bs.softmin = real_softmin
last, drifts = {}, []
for ptr, e, hh in log:
    if (ptr, e) in last and e == float(eps):
        d = hh - last[ptr, e]
        fin = torch.isfinite(d)
        drifts.append(round(float(d[fin].max() - d[fin].min()), 3))
    last[ptr, e] = hh
print("target-eps consecutive drifts (nats):", drifts)
