"""Updates to tol 1e-4 of 29 problems, each as given and under K - 1 perturbations of x, u, v (as chaos.py):
the test's problems at seeds 1-3 (partial / KL / TV with offsets, balanced, partial without offsets; blur 0.005
diam) and the convergence grid's p = 2 problems at n = 1000, d = 2, blur/diam 0.005 and 0.02 (bench_convergence.py).
``python panel.py K OUT.json`` (one thread); a count at 20000 did not converge."""
import json
import pathlib
import statistics
import sys

import torch
from problems import perturb, safeguard_problem, solve

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from bench_convergence import problem  # noqa: E402

torch.set_num_threads(1)
K, out = int(sys.argv[1]), sys.argv[2]
cases = []
for seed in (1, 2, 3):
    x, y, u, v, diam = safeguard_problem(seed)
    for name, off in (("partial", 1), ("kl", 1), ("tv", 1), ("balanced", 0), ("partial", 0)):
        label = f"n300 s{seed} {name}{'+off' if off else ''}"
        cases.append((label, x, y, u if off else None, v if off else None, diam, 0.005, name))
for ratio in (0.005, 0.02):
    for name in ("balanced", "kl", "tv", "partial"):
        for off in (False, True):
            if name != "balanced" or not off:
                x, y, u, v, diam = problem(1000, 2, 2, off)
                cases.append((f"grid r{ratio} {name}{'+off' if off else ''}", x, y, u, v, diam, ratio, name))
res = {}
for label, x, y, u, v, diam, ratio, name in cases:
    counts = []
    for k in range(K):
        gen = torch.Generator().manual_seed(100 + k)
        xk, uk, vk = (x, u, v) if k == 0 else (perturb(x, gen), perturb(u, gen), perturb(v, gen))
        r = solve(xk, y, uk, vk, diam, name, ratio)
        counts.append(int(r.n_iter) if float(r.marginal_error) <= 1e-4 else 20000)
    res[label] = counts
    print(f"{label}: med {statistics.median(counts)} max {max(counts)} {counts}", flush=True)
with open(out, "w") as f:
    json.dump(res, f)
