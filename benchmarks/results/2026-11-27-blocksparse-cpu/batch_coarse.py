"""Batched cold solve on 'blocksparse' with the coarse-to-fine start on and off (CPU, torch's threads).

B problems of n points each (bench_blocksparse.py's clouds, seeds 0..B-1), 2-D, p = 2, blur = 0.01 x the
batch's bounding-box diagonal, float32, sinkhorn(tol=1e-3, value_tol=1e-4); runs on, off, on and prints one
JSON line per run (seconds, passes, updates and values per problem).

    python batch_coarse.py B N
"""
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from bench_blocksparse import clouds  # noqa: E402

from srot_fast import _multiscale as ms  # noqa: E402
from srot_fast import sinkhorn  # noqa: E402


def main(b: int, n: int) -> None:
    pairs = [clouds(n, seed=k)[:2] for k in range(b)]
    X, Y = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
    both = torch.cat([X.flatten(0, 1), Y.flatten(0, 1)])
    blur = 0.01 * float((both.amax(0) - both.amin(0)).norm())
    default = ms.MIN_PAIRS
    for on in (True, False, True):
        ms.MIN_PAIRS = default if on else 1 << 62
        t = time.perf_counter()
        r = sinkhorn(X, Y, p=2, eps=blur**2, tol=1e-3, value_tol=1e-4, backend="blocksparse")
        secs = time.perf_counter() - t
        print(json.dumps(dict(coarse=on, B=b, n=n, threads=torch.get_num_threads(), seconds=round(secs, 2),
                              passes=r.passes, n_iter=r.n_iter.tolist(), value=r.value.tolist(),
                              converged=r.converged.tolist())), flush=True)
    ms.MIN_PAIRS = default


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
