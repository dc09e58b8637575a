"""KL with soft-SROT-like cost offsets: tests/test_solver.py's _offsets_problem (300 + 300 points, offsets
0.1 diam^2 U(0, 1)), p = 2, blur 0.005 diam, tol 1e-4, tau 1 and 10, seeds 2-7, backend 'cpu'.

    PYTHONPATH=TREE python offsets_probe.py TREE/tests
"""
import sys
import warnings

import srot_fast

sys.path.insert(0, sys.argv[1])
from test_solver import _offsets_problem  # noqa: E402

warnings.simplefilter("ignore")
print(srot_fast.__file__)
total = 0
for seed in range(2, 8):
    x, y, u, v, diam = _offsets_problem(seed)
    out = []
    for tau in (1.0, 10.0):
        res = srot_fast.sinkhorn(x, y, p=2, eps=(0.005 * diam) ** 2, u=u, v=v, scaling=0.5, diameter=diam, tol=1e-4,
                                 max_iter=20000, backend="cpu", penalty="kl", tau=tau)
        total += int(res.n_iter)
        out.append(f"{int(res.n_iter)}{'' if bool(res.converged) else '!'} {float(res.value):.8f}")
    print(seed, out, flush=True)
print("total", total)
