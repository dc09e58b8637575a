"""The 40 x 50 soft SROT problem (KL reach 1, eps 0.01, p = 2) on which the accelerated loop cycled: value, updates,
converged and marginal error at tol 1e-5, 1e-6, 1e-8 (max_iter 1000), accelerated and plain, backends cpu and
tensorized. The data are those of tests/test_solver.py::_kl_cycle."""
import warnings

import torch

from srot_fast import sinkhorn, soft_offsets

warnings.simplefilter("ignore")
gen = torch.Generator().manual_seed(0)
x = 0.5 * torch.randn(40, 2, generator=gen, dtype=torch.float64)
y = torch.randn(50, 2, generator=gen, dtype=torch.float64) + 2
s_x, s_y = torch.full((40,), 0.1, dtype=torch.float64), torch.full((50,), 0.9, dtype=torch.float64)
s_x[-4:], s_y[-5:] = 0.9, 0.2
u, v = soft_offsets(s_x, s_y, float(((x[:, None] - y[None]) ** 2).sum(-1).max() / 2))
for tol in (1e-5, 1e-6, 1e-8):
    for backend in ("cpu", "tensorized"):
        for accelerate in (True, False):
            r = sinkhorn(x, y, p=2, eps=0.01, penalty="kl", tau=1.0, u=u, v=v, tol=tol, backend=backend,
                         accelerate=accelerate)
            print(f"tol {tol:g} {backend} accelerate={accelerate}: value {float(r.value):.10g}, "
                  f"{int(r.n_iter)} updates, converged {bool(r.converged)}, error {float(r.marginal_error):.2e}")
