"""Where a batched solve spends its time: bench_convergence.batch_case's problem (64 problems of 256 points, d = 2,
p = 2, blur 0.05, debias off, float32), loss + gradient, under cProfile (which inflates the Python-heavy parts),
and the kernel work in problem-passes (a pass over one problem) for the batched call and for a loop of single
calls."""
import cProfile
import pstats
import time

import torch

from srot_fast import SROTLoss
from srot_fast.backends import get_ops


def main():
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, 2, generator=gen)
    y = torch.randn(64, 256, 2, generator=gen) + 0.5
    loss = SROTLoss(p=2, blur=0.05, debias=False)

    def batched():
        xg = x.clone().requires_grad_()
        loss(xg, y).sum().backward()
        return loss.last_result

    batched()
    t0 = time.perf_counter()
    res = batched()
    print(f"batched {time.perf_counter() - t0:.3f} s, {res.passes} passes, updates max "
          f"{int(res.n_iter.max())}, median {float(res.n_iter.double().median())}")
    prof = cProfile.Profile()
    prof.enable()
    batched()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)

    ops = get_ops("cpu")
    real, work = ops.softmin, []

    def counting(a, b, h, eps, p):
        work.append(a.shape[0])
        return real(a, b, h, eps, p)

    ops.softmin = counting
    loss(x, y)
    batched_work = sum(work)
    work.clear()
    for k in range(x.shape[0]):
        loss(x[k], y[k])
    ops.softmin = real
    print(f"problem-passes: batched {batched_work}, loop {sum(work)}")


if __name__ == "__main__":
    main()
