"""Profile of the block-sparse Triton pass on a GPU (call 1 of NOTES.md): pruning phases, reuse, the soft-min
kernel's tiles against the former row-major kernel (defined here), the former weighted-mean kernel's tiles, the
dense pass. Synthetic near-solution h (the potential of a translation). Ran on the tree of commit 5ade367 without
its weighted-mean change (the weighted-mean calls below use that kernel's former signature), from the repository
root with srot_fast/kernels linked to kernels/: python3 prof_tiles.py [budget seconds]."""
import json
import math
import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.getcwd())
from srot_fast.kernels import blocksparse as bs  # noqa: E402
from srot_fast.kernels.triton import blocksparse as tbs  # noqa: E402
from srot_fast.kernels.triton import launchers  # noqa: E402
from srot_fast.kernels.triton.sparse_kernels import _bs_program, _bs_softmin_kernel, _bs_tile, _bs_wmean_kernel  # noqa: E402
from srot_fast.kernels.triton.tiles import _cost_scale, _lse_step  # noqa: E402


@triton.jit
def _old_softmin(x_ptr, y_ptr, h_ptr, offs_ptr, cblk_ptr, prm_ptr, out_ptr, N, M, nrb,
                 D: tl.constexpr, P: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    b, rows, rmask, x_ptr, y_ptr, h_ptr, k0, k1 = _bs_program(x_ptr, y_ptr, h_ptr, offs_ptr, N, M, nrb, D, BLOCK,
                                                              BLOCK_N)
    cscale = _cost_scale(prm_ptr, P)
    eps_ln2 = tl.load(prm_ptr + 1)
    m_i = tl.full((BLOCK_N,), float("-inf"), dtype=prm_ptr.dtype.element_ty)
    s_i = tl.zeros((BLOCK_N,), dtype=prm_ptr.dtype.element_ty)
    for k in range(k0, k1):
        for t in tl.static_range(BLOCK // BLOCK_M):
            _, _, _, _, logit = _bs_tile(x_ptr, y_ptr, h_ptr, cblk_ptr, k, t, rows, rmask, cscale, M, D, P, BLOCK,
                                         BLOCK_N, BLOCK_M)
            m_i, alpha, w = _lse_step(m_i, logit, 1)
            s_i = s_i * alpha + tl.sum(w, 1)
    out = tl.where(s_i > 0, -eps_ln2 * (m_i + tl.log2(tl.where(s_i > 0, s_i, 1.0))), float("inf"))
    tl.store(out_ptr + b * N + rows, out, mask=rmask)


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


out_path = os.path.join(os.environ.get("OUT", "."), "prof1.json")
rows = []
meta = dict(device="dry" if DRY else torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
print(meta, flush=True)
cases = [(1000, 2, 2), (1000, 3, 2), (1000, 2, 1)] if DRY else [
    (100_000, 2, 2), (100_000, 3, 2), (100_000, 2, 1), (1_000_000, 2, 2), (1_000_000, 3, 2)]
budget = float(sys.argv[1]) if len(sys.argv) > 1 else 200.0
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
    t[0] = 0.1 if p == 2 else 1.0
    h = (-math.log(n) + (y @ t) / eps).float()
    row["eps"] = eps
    try:
        # dense pass (the tile the H100 autotuner picked for d = 2: 128 x 32, TRANS, 4 warps)
        dense = lambda: launchers.softmin_fwd(x, y, h, eps, p, path="small", block_n=128, block_m=32, trans=True,  # noqa
                                              num_warps=4)
        row["dense_s"] = ev(dense, 3 if n > 300_000 else 5)
        ref = dense()
        tbs.clear_cache()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ox, oy = tbs._order(x[None]), tbs._order(y[None])
        torch.cuda.synchronize()
        row["order_build_s"] = time.perf_counter() - t0
        hs = h[None].gather(1, oy.perm)
        row["cache_hit_s"] = wall(lambda: (tbs._order(x[None]), tbs._order(y[None])))
        row["col_stats_s"] = wall(lambda: (tbs._col_stats(oy.supers(), hs, p), tbs._col_stats(oy.blocks, hs, p)))
        sst = tbs._col_stats(oy.supers(), hs, p)
        lh = math.log(bs.THRESHOLD / 2) - bs.REUSE_SLACK
        row["super_pairs_s"] = wall(lambda: tbs._super_pairs(ox.supers(), oy.supers(), sst, 0, eps, p,
                                                             lh - math.log(oy.supers().n)))
        sp = tbs._super_pairs(ox.supers(), oy.supers(), sst, 0, eps, p, lh - math.log(oy.supers().n))
        row["super_pairs_kept"] = int(sp.shape[0])
        row["super_pairs_total"] = ox.supers().n * oy.supers().n
        row["block_pairs_s"] = wall(lambda: tbs.block_pairs(ox, oy, hs, eps, p))
        offs, cblk, frac = tbs.block_pairs(ox, oy, hs, eps, p)
        row["kept_fraction"] = frac
        if offs is None:
            row["note"] = "dense fallback"
            return row
        row["kept_block_pairs"] = int(cblk.shape[0])
        ox.pruned = None
        tbs._setup(x[None], y[None], h[None], eps, p)  # prunes and stores
        row["setup_reuse_s"] = wall(lambda: tbs._setup(x[None], y[None], h[None], eps, p))
        setup = tbs._setup(x[None], y[None], h[None], eps, p)
        row["sparse_pass_reuse_s"] = wall(lambda: tbs.softmin(x, y, h, eps, p))
        got = tbs.softmin(x, y, h, eps, p)
        row["sparse_vs_dense_maxabs"] = float((got - ref).abs().max())
        pairs = frac * n * n
        _, _, hs2, offs_, cblk_, prm = setup
        nrb = ox.nblk
        outb = torch.empty(1, n, device=DEV)
        tiles = {}
        for bn, bm, tr, w in [(64, 32, True, 2), (64, 64, True, 2), (64, 16, True, 2), (32, 32, True, 1),
                              (32, 64, True, 1), (64, 64, False, 4), (32, 64, False, 4), (64, 32, True, 4)]:
            def run(bn=bn, bm=bm, tr=tr, w=w):
                _bs_softmin_kernel[(nrb * (64 // bn),)](ox.pts_t(), oy.pts_t(), hs2, offs_, cblk_, prm, outb, n, n,
                                                        nrb, D=d, P=p, BLOCK=64, BLOCK_N=bn, BLOCK_M=bm, TRANS=tr,
                                                        num_warps=w)
            try:
                s = ev(run)
                err = float((bs._unsort(outb, ox)[0] - ref).abs().max())
                tiles[f"{bn}x{bm}{'T' if tr else ''}w{w}"] = [s, pairs / s, err]
            except Exception as e:  # noqa: BLE001
                tiles[f"{bn}x{bm}{'T' if tr else ''}w{w}"] = repr(e)[:200]

        def old(bn=32, bm=64):
            _old_softmin[(nrb * (64 // bn),)](ox.pts, oy.pts, hs2, offs_, cblk_, prm, outb, n, n, nrb, D=d, P=p,
                                              BLOCK=64, BLOCK_N=bn, BLOCK_M=bm)
        s = ev(old)
        tiles["old32x64w4"] = [s, pairs / s, None]
        row["tiles"] = tiles
        outw = torch.empty(1, n, d, device=DEV)
        for bn, bm, w in [(16, 32, 4), (32, 32, 4), (32, 64, 4), (64, 32, 4)]:
            def wm(bn=bn, bm=bm, w=w):
                _bs_wmean_kernel[(nrb * (64 // bn),)](ox.pts, oy.pts, hs2, offs_, cblk_, prm, outw, n, n, nrb, D=d,
                                                      P=p, UNIT=False, BLOCK=64, BLOCK_N=bn, BLOCK_M=bm,
                                                      BLOCK_D=max(2, triton.next_power_of_2(d)), num_warps=w)
            try:
                row[f"wmean_{bn}x{bm}w{w}_s"] = ev(wm)
            except Exception as e:  # noqa: BLE001
                row[f"wmean_{bn}x{bm}w{w}_s"] = repr(e)[:200]
        if n <= 100_000:
            row["dense_wmean_s"] = ev(lambda: launchers.weighted_mean(x, y, h, eps, p))
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
