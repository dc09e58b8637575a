"""Interleaved A/B of two sources of the compiled cpu kernel: ``python kernel_ab.py THREADS SOURCE``, SOURCE a
copy of kernels/csrc/cpu_ops.cpp or ``new`` for the tree's own; each run builds into a fresh cache folder and
prints pairs/s (the lower quartile of the call times) for the soft-min (batch of 64 x 256 x 256 and one
4096 x 4096 problem, d = 2, p = 1 and 2), the weighted mean (4096, d = 2, p = 2) and the soft-min at d = 64."""
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

os.environ["SROT_FAST_CACHE"] = tempfile.mkdtemp()
import srot_fast.kernels._cpu_build as cb  # noqa: E402

if sys.argv[2] != "new":
    cb._SRC = Path(sys.argv[2])
from srot_fast.kernels import cpu_ops  # noqa: E402

torch.set_num_threads(int(sys.argv[1]))
gen = torch.Generator().manual_seed(0)


def rate(fn, pairs, reps):
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return pairs / sorted(ts)[len(ts) // 4] / 1e9


x, y, h = torch.randn(64, 256, 2, generator=gen), torch.randn(64, 256, 2, generator=gen) + 0.5, torch.randn(64, 256)
x1, y1, h1 = torch.randn(4096, 2, generator=gen), torch.randn(4096, 2, generator=gen), torch.randn(4096)
x6, y6, h6 = torch.randn(2048, 64, generator=gen), torch.randn(2048, 64, generator=gen), torch.randn(2048)
out = []
for p in (1, 2):
    out.append(f"p{p} batch {rate(lambda p=p: cpu_ops.softmin(x, y, h, 0.0025, p), 64 * 256 * 256, 60):.2f} "
               f"single {rate(lambda p=p: cpu_ops.softmin(x1, y1, h1, 0.0025, p), 4096 * 4096, 20):.2f}")
out.append(f"wmean {rate(lambda: cpu_ops.weighted_mean(x1, y1, h1, 0.0025, 2), 4096 * 4096, 20):.2f}")
out.append(f"d64 {rate(lambda: cpu_ops.softmin(x6, y6, h6, 1.0, 2), 2048 * 2048, 10):.2f}")
print(sys.argv[2][-12:], " | ".join(out), "Gpairs/s", flush=True)
