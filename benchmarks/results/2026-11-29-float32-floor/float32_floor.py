"""How finely float32 resolves the marginal error: the float64 solution, rounded to float32, measured in float32.

    python float32_floor.py

Two 1000-point unit Gaussians in 2-D one apart (seed 0), p = 2 (cost |x - y|^2 / 2), eps = blur**2. The float64
potentials (tol 1e-10) are cast to each dtype and one soft-min pass in that dtype (dense torch) gives the row
and column errors mean |exp((f - s) / eps) - 1| and mean |exp((g - t) / eps) - 1|; beside them the estimate
finfo(float32).eps * (mean |f| + mean |g|) / (2 eps) that the ConvergenceWarning uses.
"""
import warnings

import torch

import srot_fast

warnings.simplefilter("ignore")
torch.manual_seed(0)
x = torch.randn(1000, 2).double()
y = (torch.randn(1000, 2) + 1).double()
for blur in (0.05, 0.02):
    eps = blur**2
    r = srot_fast.sinkhorn(x, y, p=2, eps=eps, max_iter=20000, tol=1e-10)
    f, g = r.f.double(), r.g.double()
    for dt in (torch.float64, torch.float32):
        X, Y, F, G = x.to(dt), y.to(dt), f.to(dt), g.to(dt)
        C = ((X[:, None] - Y[None]) ** 2).sum(-1) / 2
        lw = torch.full((1000,), -torch.log(torch.tensor(1000.0)).item(), dtype=dt)
        s = -eps * torch.logsumexp((G[None] - C) / eps + lw[None], 1)
        t = -eps * torch.logsumexp((F[:, None] - C) / eps + lw[:, None], 0)
        row = (torch.exp((F - s).double() / eps) - 1).abs().mean()
        col = (torch.exp((G - t).double() / eps) - 1).abs().mean()
        est = torch.finfo(torch.float32).eps * (f.abs().mean() + g.abs().mean()) / (2 * eps)
        print(f"blur {blur} {str(dt)[6:]}: row {row:.2e} col {col:.2e} row+col {row + col:.2e}"
              + (f"  estimate {est:.2e}" if dt == torch.float32 else ""))
