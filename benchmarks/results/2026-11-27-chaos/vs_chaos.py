"""The value-safeguard test's problems (partial / KL / TV with offsets) at the given seeds, each under K runs as in
chaos.py: (updates, value) with the dual-objective safeguard (``by_value``, the default) and with the error test
alone, as the test switches it. ``python vs_chaos.py K SEEDS OUT.json``, SEEDS e.g. 1,2,3,4 (one thread)."""
import json
import sys

import torch
from problems import runs, safeguard_problem, solve

import srot_fast._anderson as anderson

torch.set_num_threads(1)
K, seeds, out = int(sys.argv[1]), [int(s) for s in sys.argv[2].split(",")], sys.argv[3]
real = anderson.Anderson.__init__


def run(by_value: bool) -> dict:
    def init(self, *args, **kwargs):
        kwargs["by_value"] = by_value and kwargs.get("by_value", False)
        real(self, *args, **kwargs)

    anderson.Anderson.__init__ = init
    res = {}
    for seed in seeds:
        x, y, u, v, diam = safeguard_problem(seed)
        for name in ("partial", "kl", "tv"):
            found = []
            for uk, vk in runs(u, v, K):
                r = solve(x, y, uk, vk, diam, name)
                found.append((int(r.n_iter), float(r.value)))
            res[f"s{seed} {name}"] = found
            print("value" if by_value else "error", seed, name, [c for c, _ in found], flush=True)
    anderson.Anderson.__init__ = real
    return res


result = dict(value=run(True), error=run(False))
with open(out, "w") as f:
    json.dump(result, f)
