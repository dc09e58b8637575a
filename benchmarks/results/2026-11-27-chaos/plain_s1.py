"""Plain Sinkhorn (``accelerate=False``) on the seed 1 partial problem with offsets, up to 100000 updates."""
import time

import torch
from problems import safeguard_problem, solve

torch.set_num_threads(1)
t0 = time.time()
r = solve(*safeguard_problem(1), "partial", accelerate=False, max_iter=100000)
print("accelerate False", int(r.n_iter), float(r.marginal_error), time.time() - t0, flush=True)
