"""Updates to tol 1e-4 of partial OT (mass 0.5) on the grid's hardest partial cases (p = 2, blur/diam 0.005),
over problem seeds 1-4, with the ``srot_fast`` of a given source tree:

    python hard_seeds.py TREE

Problems and settings are those of ``../2026-11-27-before/grid_tree.py`` (its ``problem``), seed varied."""
import pathlib
import sys
import warnings

sys.path.insert(0, sys.argv[1])
sys.path.insert(1, str(pathlib.Path(__file__).resolve().parent.parent / "2026-11-27-before"))

from grid_tree import problem  # noqa: E402

from srot_fast import sinkhorn  # noqa: E402

warnings.simplefilter("ignore")
total = 0
for d, n, offsets in ((2, 1000, True), (2, 4000, True), (64, 1000, False), (64, 1000, True)):
    for seed in (1, 2, 3, 4):
        x, y, u, v, diam = problem(n, d, 2, offsets, seed=seed)
        res = sinkhorn(x, y, p=2, eps=(0.005 * diam) ** 2, u=u, v=v, scaling=0.5, diameter=diam, tol=1e-4,
                       max_iter=20000, backend="cpu", mass=0.5)
        total += int(res.n_iter)
        print(f"d={d} n={n} offsets={offsets} seed={seed} updates={int(res.n_iter)} "
              f"error={float(res.marginal_error):.2e}", flush=True)
print("total", total)
