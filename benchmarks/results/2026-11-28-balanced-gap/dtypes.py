"""The drop-in problem (bench_convergence.py's) at n = 256 / 1000, d = 64, float32 / float64: SROTLoss() with
its value test and without (value_tol=None), and sinkhorn(tol=1e-4) (max_iter 1000), updates and marginal
errors. ``PYTHONPATH=TREE python dtypes.py``"""
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench_convergence import _dropin_data  # noqa: E402

from srot_fast import SROTLoss  # noqa: E402
from srot_fast.sinkhorn import sinkhorn  # noqa: E402

torch.set_num_threads(1)
for n, d in [(256, 64), (1000, 64)]:
    x, y = _dropin_data(n, d)
    for dt in (torch.float32, torch.float64):
        for vt in ("default", None):
            loss = SROTLoss() if vt == "default" else SROTLoss(value_tol=None)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                loss(x.to(dt), y.to(dt))
                res = sinkhorn(x.to(dt), y.to(dt), p=2, eps=0.05**2, tol=1e-4)
            r = loss.last_result
            print(n, d, dt, vt, "loss n_iter", int(r.n_iter), f"{float(r.marginal_error):.2e}",
                  "| sinkhorn tol1e-4", int(res.n_iter), f"{float(res.marginal_error):.2e}")
