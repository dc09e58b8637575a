"""Updates of SROTLoss() (defaults, float32) on two unit Gaussians 0.5 apart, n = 256 / 1000, d = 2 / 16 / 64,
seeds 0-2 (the x-y solve's n_iter). ``PYTHONPATH=TREE python dropin_seeds.py``"""
import torch

from srot_fast import SROTLoss

torch.set_num_threads(1)
total = 0
for n in (256, 1000):
    for d in (2, 16, 64):
        row = []
        for seed in range(3):
            gen = torch.Generator().manual_seed(seed)
            x = torch.randn(n, d, generator=gen)
            y = torch.randn(n, d, generator=gen)
            y[:, 0] += 0.5
            loss = SROTLoss()
            loss(x, y)
            row.append(int(loss.last_result.n_iter))
            total += row[-1]
        print(n, d, row, flush=True)
print("total", total)
