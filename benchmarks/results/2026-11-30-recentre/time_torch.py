"""Time per update of partial OT: the torch loop (tensorized) and the compiled loop (cpu); 300 x 400 float64
points, p = 2, offsets, 300 updates, best of 5. From the repository root, OMP_NUM_THREADS=1."""
import time
import warnings

import torch

from srot_fast import sinkhorn

warnings.simplefilter("ignore")
gen = torch.Generator().manual_seed(0)
x = torch.randn(300, 2, generator=gen, dtype=torch.float64)
y = torch.randn(400, 2, generator=gen, dtype=torch.float64) + 1
u, v = torch.rand(300, generator=gen, dtype=torch.float64), torch.rand(400, generator=gen, dtype=torch.float64)
best = []
for backend in ("tensorized", "cpu"):
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        r = sinkhorn(x, y, u=u, v=v, p=2, eps=1e-4, mass=0.6, tol=1e-14, max_iter=300, backend=backend)
        ts.append((time.perf_counter() - t0) / int(r.n_iter))
    print(backend, "ms/update %.3f" % (1e3 * min(ts)), int(r.n_iter))
