"""Tiny unbalanced problems (KL tau 1, TV tau 0.5) with soft offsets: N random problems of 3-29 x 3-29 points, uneven
weights, eps 0.05 and 0.005, tol 1e-5, max_iter 5000, float64, backend cpu. Prints per penalty: updates, unconverged,
and the solves worse than plain by > 3x updates + 50 or with a value off plain's by > 1e-6 relative."""
import sys
import warnings

import torch

from srot_fast import sinkhorn, soft_offsets

warnings.simplefilter("ignore")
N = int(sys.argv[1]) if len(sys.argv) > 1 else 60
for pen, tau in (("kl", 1.0), ("tv", 0.5)):
    for eps in (0.05, 0.005):
        upd = unc = 0
        bad = []
        for seed in range(N):
            gen = torch.Generator().manual_seed(seed)
            n, m = (int(torch.randint(3, 30, (1,), generator=gen)) for _ in range(2))
            x = torch.randn(n, 2, generator=gen, dtype=torch.float64)
            y = torch.randn(m, 2, generator=gen, dtype=torch.float64) + 0.5
            a, b = torch.rand(n, generator=gen, dtype=torch.float64), torch.rand(m, generator=gen, dtype=torch.float64)
            a, b = a / a.sum(), b / b.sum()
            u, v = soft_offsets(torch.rand(n, generator=gen, dtype=torch.float64),
                                torch.rand(m, generator=gen, dtype=torch.float64), 1.0)
            kw = dict(p=2, eps=eps, penalty=pen, tau=tau, u=u, v=v, tol=1e-5, max_iter=5000, backend="cpu")
            r = sinkhorn(x, y, a, b, **kw)
            rp = sinkhorn(x, y, a, b, accelerate=False, **kw)
            upd += int(r.n_iter)
            unc += int(not r.converged)
            if rp.converged and (not r.converged or int(r.n_iter) > 3 * int(rp.n_iter) + 50
                                 or abs(float(r.value) - float(rp.value)) > 1e-6 * abs(float(rp.value))):
                bad.append((seed, int(r.n_iter), int(rp.n_iter), bool(r.converged), float(r.value), float(rp.value)))
        print(pen, eps, "updates", upd, "unconverged", unc, "worse than plain", bad, flush=True)
