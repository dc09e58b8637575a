"""Partial OT with soft offsets converges slowly: how often Anderson's safeguard restarts, and what a looser
safeguard would change. Problems of bench_convergence.py (n = 1000, d = 2, tol 1e-4, backend 'cpu').

    OMP_NUM_THREADS=2 python safeguard_probe.py restarts      # steps and restarts, partial p = 2 0.005
    OMP_NUM_THREADS=2 python safeguard_probe.py factor 2 5 20 1e9   # updates with the restart test err > F best

The factor run replaces ``Anderson.step``'s restart test (err > 2 x the best error so far) by err > F x best,
by editing the method's source in memory; nothing in the package changes.
"""
import inspect
import math
import os
import sys
import textwrap
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from bench_convergence import problem  # noqa: E402

import srot_fast._anderson as A  # noqa: E402
from srot_fast import sinkhorn  # noqa: E402

CASES = [(2, 0.005, True, 0.5), (2, 0.005, False, 0.5), (2, 0.005, True, None), (2, 0.02, True, 0.5),
         (1, 0.005, True, 0.5), (2, 0.005, True, "kl"), (2, 0.005, True, "tv"), (1, 0.005, True, None)]


def solve(p, ratio, off, mass):
    x, y, u, v, diam = problem(1000, 2, p, off)
    kw = dict(mass=mass) if isinstance(mass, float) else (dict(penalty=mass, tau=1.0) if mass else {})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sinkhorn(x, y, p=p, eps=(ratio * diam) ** p, u=u, v=v, scaling=0.5, diameter=diam, tol=1e-4,
                        max_iter=20000, backend="cpu", **kw)


def restarts():
    orig, count = A.Anderson.step, dict(steps=0, restarts=0)

    def step(self, g, g_hat, err, done):
        count["steps"] += 1
        count["restarts"] += int((~(err <= 2 * self.best)).sum())
        return orig(self, g, g_hat, err, done)

    A.Anderson.step = step
    for off in (True, False):
        count.update(steps=0, restarts=0)
        r = solve(2, 0.005, off, 0.5)
        print(f"partial p = 2, blur/diam 0.005, offsets {off}: {int(r.n_iter)} updates, {count['steps']} Anderson "
              f"steps, {count['restarts']} restarts")
    A.Anderson.step = orig


def factor(values):
    src = textwrap.dedent(inspect.getsource(A.Anderson.step))
    src = src.replace("err <= 2 * self.best", "err <= FACTOR * self.best")
    assert "FACTOR" in src
    orig = A.Anderson.step
    for f in values:
        ns = dict(torch=torch, math=math, FACTOR=float(f))
        exec(src, ns)
        A.Anderson.step = ns["step"]
        row = [f"p{p} {ratio} offsets={int(off)} {mass or 'balanced'}: {int(solve(p, ratio, off, mass).n_iter)}"
               for p, ratio, off, mass in CASES]
        print(f"F = {f}: " + " | ".join(row), flush=True)
    A.Anderson.step = orig


if __name__ == "__main__":
    if sys.argv[1] == "restarts":
        restarts()
    else:
        factor(sys.argv[2:])
