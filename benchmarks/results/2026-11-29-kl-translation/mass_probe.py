"""KL and TV (tau 0.5, 1, 5) between 500 and 400 points, target mass 1, 1 + 1e-6, 1.01, 1.2, 2; p = 2, blur 0.05,
tol 1e-6, 5000 updates at most, accelerated then plain for each mass ('!': not converged).

    PYTHONPATH=TREE python mass_probe.py
"""
import warnings

import torch

import srot_fast

warnings.simplefilter("ignore")
torch.set_num_threads(1)
print(srot_fast.__file__)
torch.manual_seed(0)
x = torch.randn(500, 2).double()
y = (torch.randn(400, 2) + 0.5).double()
a = torch.full((500,), 1 / 500).double()
for pen in ("kl", "tv"):
    for tau in (0.5, 1.0, 5.0):
        out = []
        for mb in (1.0, 1.0 + 1e-6, 1.01, 1.2, 2.0):
            b = torch.full((400,), mb / 400).double()
            for acc in (True, False):
                r = srot_fast.sinkhorn(x, y, a, b, p=2, eps=0.05**2, max_iter=5000, tol=1e-6, penalty=pen, tau=tau,
                                       accelerate=acc)
                out.append(f"{int(r.n_iter)}{'' if bool(r.converged) else '!'}")
        print(pen, tau, "masses 1, 1+1e-6, 1.01, 1.2, 2 (acc/plain):", " ".join(out), flush=True)
