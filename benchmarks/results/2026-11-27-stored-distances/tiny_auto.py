"""Loss + gradient of SROTLoss() on the smallest problems (N M < 4096), backend 'tensorized' (what 'auto' picked
there before) against 'cpu' (what it picks now when the compiled kernel is available), and geomloss.SamplesLoss()
beside them; one thread, two Gaussians 0.5 apart, d = 2, best of 8."""
import time
import warnings

import geomloss
import torch

from srot_fast import SROTLoss

warnings.simplefilter("ignore")
torch.set_num_threads(1)
for n in (16, 32, 63):
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 2, generator=gen), torch.randn(n, 2, generator=gen)
    y[:, 0] += 0.5
    losses = {"tensorized": SROTLoss(backend="tensorized"), "cpu": SROTLoss(backend="cpu"),
              "SamplesLoss()": geomloss.SamplesLoss()}
    out = []
    for name, loss in losses.items():
        best = float("inf")
        for _ in range(8):
            xg = x.clone().requires_grad_()
            t0 = time.perf_counter()
            value = loss(xg, y)
            value.backward()
            best = min(best, time.perf_counter() - t0)
        upd = getattr(getattr(loss, "last_result", None), "n_iter", None)
        out.append(f"{name} {best * 1e3:.1f} ms (value {float(value):.6f}" + (f", {int(upd)} updates)" if upd else ")"))
    print(f"n={n}: " + ", ".join(out), flush=True)
