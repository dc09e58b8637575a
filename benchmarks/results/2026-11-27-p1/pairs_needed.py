"""How many pairs carry a row's mass at solved potentials, p = 1 against p = 2: the floor of any exact
truncation. n = m = 4000 uniform points in the unit square (y shifted by 0.1), float64, blur = 0.01 x diameter,
balanced OT solved to tol 1e-5 on the dense 'cpu' backend; per row, the fewest columns (largest plan entries
first) whose weights sum to 1 - thr, for thr = 1e-12 and 1e-6; the kept fractions of the C++ and the torch
(Triton path) block pruning at the default THRESHOLD 1e-12; and the pairs whose logit is within 30 nats of
the row's largest. Run: ``OMP_NUM_THREADS=2 python pairs_needed.py > pairs_needed.txt``."""
import math
import warnings

import torch
from srot_fast.kernels import blocksparse as bs
from srot_fast.kernels.triton import blocksparse as tbs

from srot_fast import sinkhorn
from srot_fast.geometry import bbox_diameter

torch.manual_seed(0)
n = 4000
x = torch.rand(n, 2, dtype=torch.float64)
y = torch.rand(n, 2, dtype=torch.float64)
y[:, 0] += 0.1
diam = bbox_diameter(x, y)
bs.DENSE_FRACTION, bs.MIN_PAIRS = 2.0, 0
for p in (2, 1):
    eps = (0.01 * diam) ** p
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = sinkhorn(x, y, p=p, eps=eps, tol=1e-5, max_iter=2000, backend="cpu")
    h = -math.log(n) + r.g / eps
    dist = torch.cdist(x, y)
    logits = h[None, :] - (dist if p == 1 else 0.5 * dist**2) / eps
    w = (logits - torch.logsumexp(logits, 1, keepdim=True)).exp()
    cum = w.sort(1, descending=True).values.cumsum(1)
    for thr in (1e-12, 1e-6):
        need = ((cum < 1 - thr).sum(1) + 1).double()
        print(f"p={p} thr={thr}: pairs needed per row median {need.median().item():.0f}, "
              f"mean frac {need.mean().item() / n:.4f}")
    bs.softmin(x, y, h, eps, p)
    print("  cpu blocksparse kept", bs.last_kept_fraction())
    ox, oy = tbs._order(x[None]), tbs._order(y[None])
    print("  torch pruning kept", tbs.block_pairs(ox, oy, h[None].gather(1, oy.perm), eps, p)[2])
    near = ((logits - logits.amax(1, keepdim=True)) > -30).double().mean().item()
    print(f"  pairs within 30 nats of the row max: {near:.4f}")
