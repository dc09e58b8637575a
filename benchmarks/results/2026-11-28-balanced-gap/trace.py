"""Every marginal error the loop computes for SROTLoss(debias=False) on 256 points in 64-D (seed 0), then the
updates and value. ``PYTHONPATH=TREE python trace.py``"""
import torch

import srot_fast._loop as loop
from srot_fast import SROTLoss

torch.set_num_threads(1)
log = []
_marginal_error = loop.marginal_error


def logged(*args, **kw):
    err = _marginal_error(*args, **kw)
    log.append(float(err.max()))
    return err


loop.marginal_error = logged
gen = torch.Generator().manual_seed(0)
x = torch.randn(256, 64, generator=gen)
y = torch.randn(256, 64, generator=gen)
y[:, 0] += 0.5
loss = SROTLoss(debias=False)
value = loss(x, y)
print(int(loss.last_result.n_iter), float(value))
print(" ".join(f"{e:.1e}" for e in log))
