"""One soft-min pass of the compiled cpu kernel, streaming (distances computed) against stored (``sq=``, read),
p = 2, float32, and the time of ``squared_distances`` itself; ``--threads`` (default 1), ``--low-d`` for d = 2, 3
at the sizes where storing is not used. Prints the largest difference of the two passes' outputs (0: the stored
pass follows the streaming pass's tiles)."""
import argparse
import time

import torch
from srot_fast.kernels import cpu_ops


def tm(fn, *args, k=20, **kw):
    fn(*args, **kw)
    t = time.perf_counter()
    for _ in range(k):
        fn(*args, **kw)
    return (time.perf_counter() - t) / k * 1e3


ap = argparse.ArgumentParser()
ap.add_argument("--threads", type=int, default=1)
ap.add_argument("--low-d", action="store_true")
args = ap.parse_args()
torch.set_num_threads(args.threads)
cases = ([(b, n, d) for b, n in [(1, 256), (1, 512), (1, 1000), (1, 1448), (16, 256)] for d in (2, 3)] if args.low_d
         else [(1, n, d) for n in (256, 1000, 2000) for d in (2, 4, 8, 16, 64, 256)])
for b, n, d in cases:
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(b, n, d, generator=gen), torch.randn(b, n, d, generator=gen)
    h = torch.randn(b, n, generator=gen)
    eps = 0.1 * d
    sq = cpu_ops.squared_distances(x, y)
    diff = float((cpu_ops.softmin(x, y, h, eps, 2) - cpu_ops.softmin(x, y, h, eps, 2, sq=sq)).abs().max())
    stream = tm(cpu_ops.softmin, x, y, h, eps, 2)
    stored = tm(cpu_ops.softmin, x, y, h, eps, 2, sq=sq)
    sq_time = tm(cpu_ops.squared_distances, x, y, k=5)
    print(f"B={b} n={n} d={d}: stream {stream:.3f} ms, stored {stored:.3f} ms, squared_distances {sq_time:.2f} ms, "
          f"max |difference| {diff:.1e}", flush=True)
