"""One soft-min pass and one weighted mean ("grad") against n = m on a GPU (call 2 of NOTES.md): dense Triton
pass (fixed 128 x 32 TRANS tile, 4 warps), one pruning, the block-sparse pass reusing it, the dense weighted mean
(default tile, not autotuned) and the block-sparse one. Synthetic near-solution h (the potential of a
translation). From the repository root with srot_fast/kernels linked to kernels/:
python3 pass_vs_n.py [budget seconds]; without a GPU, with TRITON_INTERPRET=1 set, it runs tiny sizes."""
import json
import math
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.getcwd())
from srot_fast.kernels import blocksparse as bs  # noqa: E402
from srot_fast.kernels.triton import blocksparse as tbs  # noqa: E402
from srot_fast.kernels.triton import launchers  # noqa: E402

DRY = not torch.cuda.is_available()
DEV = "cpu" if DRY else "cuda"
if DRY:
    bs.MIN_PAIRS, bs.DENSE_FRACTION = 0, 2.0
    torch.cuda.synchronize = lambda: None


def ev(fn, reps=5):
    if DRY:
        return wall(fn, 1)
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return sorted(ts)[len(ts) // 2]


def wall(fn, reps=3):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


out_path = os.path.join(os.environ.get("OUT", "."), "prof2.json")
rows = []
meta = dict(device="dry" if DRY else torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
            tile=list(tbs.TILE))
print(meta, flush=True)
cases = [(1000, 2, 2), (3000, 2, 2)] if DRY else [(10_000, 2, 2), (30_000, 2, 2), (100_000, 2, 2), (300_000, 2, 2),
                                                  (1_000_000, 2, 2), (1_000_000, 3, 2), (300_000, 3, 2)]
budget = float(sys.argv[1]) if len(sys.argv) > 1 else 80.0
t_start = time.perf_counter()


def case(n, d, p):
    row = dict(n=n, d=d, p=p)
    gen = torch.Generator(device=DEV).manual_seed(0)
    x = torch.rand(n, d, device=DEV, generator=gen)
    y = torch.rand(n, d, device=DEV, generator=gen)
    y[:, 0] += 0.1
    diam = float((torch.cat([x, y]).amax(0) - torch.cat([x, y]).amin(0)).norm())
    eps = (0.01 * diam) ** p
    t = torch.zeros(d, device=DEV)
    t[0] = 0.1
    h = (-math.log(n) + (y @ t) / eps).float()
    row["eps"] = eps
    big = n >= 1_000_000
    try:
        dense = lambda: launchers.softmin_fwd(x, y, h, eps, p, path="small", block_n=128, block_m=32, trans=True,  # noqa
                                              num_warps=4)
        row["dense_pass_s"] = ev(dense, 3 if big else 5)
        ref = dense()
        tbs.clear_cache()
        ox, oy = tbs._order(x[None]), tbs._order(y[None])
        hs = h[None].gather(1, oy.perm)
        row["pruning_s"] = wall(lambda: tbs.block_pairs(ox, oy, hs, eps, p))
        row["kept_fraction"] = tbs.block_pairs(ox, oy, hs, eps, p)[2]
        row["sparse_pass_s"] = wall(lambda: tbs.softmin(x, y, h, eps, p), 5)  # the first prunes, the rest reuse
        got = tbs.softmin(x, y, h, eps, p)
        row["sparse_vs_dense_maxabs"] = float((got - ref).abs().max())
        row["sparse_wmean_s"] = wall(lambda: tbs.weighted_mean(x, y, h, eps, p, "grad"), 3)
        dw = lambda: launchers.weighted_mean_fwd(x, y, h, eps, p, "grad", path="small", autotune=False)  # noqa
        row["dense_wmean_s"] = ev(dw, 1 if big else 3)
        row["wmean_vs_dense_maxabs"] = float((tbs.weighted_mean(x, y, h, eps, p, "grad") - dw()).abs().max())
        row["pass_speedup"] = row["dense_pass_s"] / row["sparse_pass_s"]
        row["wmean_speedup"] = row["dense_wmean_s"] / row["sparse_wmean_s"]
    except Exception as e:  # noqa: BLE001
        row["error"] = repr(e)[:500]
    return row


for n, d, p in cases:
    if time.perf_counter() - t_start > budget:
        rows.append(dict(n=n, d=d, p=p, skipped="budget"))
        continue
    row = case(n, d, p)
    rows.append(row)
    print(json.dumps(row), flush=True)
    with open(out_path, "w") as fh:
        json.dump(dict(meta=meta, rows=rows), fh, indent=1)
with open(out_path, "w") as fh:
    json.dump(dict(meta=meta, rows=rows), fh, indent=1)
print("total", time.perf_counter() - t_start)
