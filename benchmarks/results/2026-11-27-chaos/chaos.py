"""Updates of the value-safeguard test's problems (seeds 1, 2) under K runs, the first as given, the others with
u, v perturbed (generator seeds 100 + k): ``python chaos.py K`` (one thread)."""
import statistics
import sys

import torch
from problems import runs, safeguard_problem, solve

torch.set_num_threads(1)
K = int(sys.argv[1])
for seed in (1, 2):
    x, y, u, v, diam = safeguard_problem(seed)
    for name in ("partial", "kl", "tv"):
        counts = []
        for uk, vk in runs(u, v, K):
            counts.append(int(solve(x, y, uk, vk, diam, name).n_iter))
        print(seed, name, "median", statistics.median(counts), counts, flush=True)
