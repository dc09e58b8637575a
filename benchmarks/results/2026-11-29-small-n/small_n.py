"""Loss + gradient time of SROTLoss() (defaults), SROTLoss(tol=None) (GeomLoss's fixed schedule) and
geomloss.SamplesLoss() (defaults; "auto" picks tensorized at these sizes), one thread, two unit Gaussians 0.5 apart
(as bench_convergence.py's drop-in), n = 32 to 1000, d = 2 and 64; best of 9, interleaved."""
import time
import warnings

import geomloss
import torch

from srot_fast import SROTLoss

warnings.simplefilter("ignore")
torch.set_num_threads(1)
for n, d in [(32, 2), (64, 2), (256, 2), (256, 64), (1000, 2), (1000, 64)]:
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, d, generator=gen), torch.randn(n, d, generator=gen)
    y[:, 0] += 0.5
    losses = {"SROTLoss()": SROTLoss(), "SROTLoss(tol=None)": SROTLoss(tol=None),
              "SamplesLoss()": geomloss.SamplesLoss()}
    best = dict.fromkeys(losses, float("inf"))
    for rep in range(10):
        for name, loss in losses.items():
            xg = x.clone().requires_grad_()
            t0 = time.perf_counter()
            loss(xg, y).backward()
            if rep:  # the first round warms up
                best[name] = min(best[name], time.perf_counter() - t0)
    upd = int(losses["SROTLoss()"].last_result.n_iter)
    times = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in best.items())
    print(f"n={n} d={d}: {times} (SROTLoss() {upd} updates)", flush=True)
