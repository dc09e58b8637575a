"""The default detector on few points in 16 and 64 dimensions: two Gaussians N(0, I) and N(8 e_1, I), 200 clean
points per side plus 20 type-II outliers drawn from the other side's law. Prints, per D, seed and epochs setting
(None: the default rule, about 2000 optimiser steps), the epochs run and the flagged counts: clean / type II,
source | target, and the fit time. From the repository root: OMP_NUM_THREADS=1 python <this file>."""
import time

import torch

from srot_fast import OutlierDetector


def data(seed: int, d: int, n: int, k: int, sep: float = 8.0):
    gen = torch.Generator().manual_seed(seed)
    xs, yt = torch.randn(n, d, generator=gen), torch.randn(n, d, generator=gen)
    yt[:, 0] += sep
    x2, y2 = torch.randn(k, d, generator=gen), torch.randn(k, d, generator=gen)
    x2[:, 0] += sep  # source outliers drawn from the target's law, and the other way round
    return torch.cat([xs, x2]), torch.cat([yt, y2]), torch.cat([torch.zeros(n), torch.ones(k)]).bool()


for d in (16, 64):
    for seed in (0, 1):
        x, y, outlier = data(seed, d, 200, 20)
        for epochs in (None, 40, 20, 10):
            t0 = time.perf_counter()
            det = OutlierDetector(seed=seed, progress=False, epochs=epochs).fit(x, y)
            mx, my = det.outlier_masks(x, y)
            print(f"D {d} seed {seed} epochs={epochs} ({det.n_epochs_} run): "
                  f"source clean {int(mx[~outlier].sum())}/200 type II {int(mx[outlier].sum())}/20 | "
                  f"target clean {int(my[~outlier].sum())}/200 type II {int(my[outlier].sum())}/20 | "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
