"""SROTLoss() loss + gradient at n = 64 and 256, d = 2 (one thread, best of 7): time, updates, passes, for the
srot_fast first on sys.path. Run as PYTHONPATH=TREE python per_revision.py LABEL (TREE: a git worktree of a
revision)."""
import sys
import time
import warnings

import torch

from srot_fast import SROTLoss

warnings.simplefilter("ignore")
torch.set_num_threads(1)
for n, d in [(64, 2), (256, 2)]:
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, d, generator=gen), torch.randn(n, d, generator=gen)
    y[:, 0] += 0.5
    loss, best = SROTLoss(), 1e9
    for rep in range(8):
        xg = x.clone().requires_grad_()
        t0 = time.perf_counter()
        loss(xg, y).backward()
        if rep:
            best = min(best, time.perf_counter() - t0)
    r = loss.last_result
    print(sys.argv[1], n, d, f"{best * 1e3:.1f} ms", int(r.n_iter), "passes", r.passes, flush=True)
