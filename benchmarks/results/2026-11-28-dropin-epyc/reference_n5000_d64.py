"""The float64 reference of bench_convergence.py's drop-in problem at n = 5000, d = 64 (``dropin_reference``)
for increasing ``ref_max_iter``, with the 5000^2 squared distances kept for the solve (the stored pass gives
the streaming pass's values; it makes the reference ~2x faster on one thread). One JSON line per budget.

    PYTHONPATH=. python benchmarks/results/2026-11-28-dropin-epyc/reference_n5000_d64.py 300 1000 3000
"""
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench_convergence import dropin_reference  # noqa: E402

import srot_fast.geometry as geometry  # noqa: E402

torch.set_num_threads(1)
geometry.STORE_PAIRS = 1 << 26  # keep the distances (float64, 2 x 200 MB)
for budget in map(int, sys.argv[1:]):
    start = time.perf_counter()
    ref = dropin_reference(5000, 64, budget)
    print(json.dumps(dict(ref, ref_max_iter=budget, seconds=time.perf_counter() - start)), flush=True)
