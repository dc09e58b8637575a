"""Time of one Anderson step, torch ops against the compiled C step (``Anderson.native``), after 10 warm-up steps
of a contraction, per batch size B and potential length M."""
import time

import torch

from srot_fast._anderson import Anderson


def bench(batch, m, native, k=200):
    gen = torch.Generator().manual_seed(0)
    acc = Anderson(batch, torch.zeros(batch, m), torch.ones(batch, m, dtype=torch.bool))
    acc.native = native
    g = torch.randn(batch, m, generator=gen)
    done = torch.zeros(batch, dtype=torch.bool)
    err = torch.ones(batch, dtype=torch.float64)
    for i in range(10):
        g = acc.step(g, 0.9 * g, err * 0.9**i, done)
    t = time.perf_counter()
    for i in range(k):
        g = acc.step(g, 0.9 * g + 1e-3, err * 0.9 ** (i + 10), done)
    return (time.perf_counter() - t) / k * 1e6


for batch, m in [(1, 256), (64, 256), (1, 100000), (8, 100000)]:
    print(batch, m, "torch %.0f us" % bench(batch, m, False, 50), "C %.0f us" % bench(batch, m, True, 50))
