"""Times every block-sparse soft-min of one cold p = 2 solve, grouped by (rows, columns, eps).

Run from the repository root: ``python <this file> N RATIO SWITCH`` (srot_fast._multiscale settings).
"""
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, "benchmarks")
from bench_blocksparse import clouds  # noqa: E402
from srot_fast.kernels import blocksparse as bs  # noqa: E402

from srot_fast import _multiscale as ms  # noqa: E402
from srot_fast import sinkhorn  # noqa: E402

torch.set_num_threads(2)
n = int(sys.argv[1])
ms.RATIO, ms.SWITCH = float(sys.argv[2]), float(sys.argv[3])
x, y, diam = clouds(n, seed=1)
log = []
real_softmin = bs.softmin


def softmin(x_, y_, h, eps, p):
    t = time.time()
    out = real_softmin(x_, y_, h, eps, p)
    log.append((x_.shape[-2], y_.shape[-2], eps, bs.last_kept_fraction(), time.time() - t))
    return out


bs.softmin = softmin
t = time.time()
r = sinkhorn(x, y, p=2, eps=(0.01 * diam) ** 2, tol=1e-3, value_tol=1e-4, backend="blocksparse")
print("total", time.time() - t, r.n_iter, r.passes)
agg = defaultdict(lambda: [0, 0.0, 0.0])
for rows, cols, eps, kept, secs in log:
    key = (max(rows, cols), min(rows, cols), f"{eps:.2e}")
    agg[key][0] += 1
    agg[key][1] += secs
    agg[key][2] = kept
for key, (count, secs, kept) in sorted(agg.items(), key=lambda kv: (-kv[0][0], kv[0][2])):
    print(key, count, f"{secs:.2f} s", f"kept {kept:.3f}")
