"""Small hard p = 2 problems: updates of the debiased loss with and without the loop's SCALE_NEAR exception.

    python small_p2.py > small_p2.txt

Two 300-point unit Gaussians 0.5 apart in 2-D (seeds 0-3), float64, ``SROTLoss()`` (p = 2, blur 0.05,
debiased) at tol 1e-5 (value_tol 1e-9) and 1e-6 (value_tol 1e-10); SCALE_NEAR = 0 switches the exception off.
"""
import warnings

import torch

import srot_fast._loop as loop
from srot_fast import SROTLoss

warnings.simplefilter("ignore")
torch.set_num_threads(1)
for near in (0.0, loop.SCALE_NEAR):
    loop.SCALE_NEAR = near
    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        x, y = torch.randn(300, 2, generator=gen), torch.randn(300, 2, generator=gen)
        y[:, 0] += 0.5
        for tol, value_tol, cap in ((1e-5, 1e-9, 5000), (1e-6, 1e-10, 20000)):
            loss = SROTLoss(tol=tol, value_tol=value_tol, max_iter=cap)
            value = float(loss(x.double(), y.double()))
            res = loss.last_result
            print(f"SCALE_NEAR {near} seed {seed} tol {tol:g}: updates {int(res.n_iter)}, value {value:.12f}, "
                  f"marginal error {float(res.marginal_error):.1e}, converged {bool(res.converged)}", flush=True)
