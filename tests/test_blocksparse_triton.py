"""The block-sparse Triton kernels (kernels/triton/blocksparse.py) against the dense paths, in float64.

Under ``TRITON_INTERPRET=1`` on CPU; on a CUDA machine the inputs go to the GPU (``ON``) and the kernels run
compiled, against the same CPU float64 references. Same bounds and tolerances as tests/test_blocksparse.py
(its module docstring): primitives within the truncation bound plus 1e-12 of the cost scale, solves within
atol = rtol = 1e-9 of the dense ``cpu`` backend at the same fixed number of updates. Pruning is forced on these
small problems (``MIN_PAIRS = 0``, ``DENSE_FRACTION = 2``); the interpreter is slow, so the problems are a few
hundred points of well separated clusters, where whole block pairs can be dropped.
"""
from __future__ import annotations

import math
import types

import pytest
import torch
from srot_fast.kernels import blocksparse as bs
from srot_fast.kernels import cpu_ops
from srot_fast.kernels.tensorized import max_cost as ref_max_cost
from srot_fast.kernels.tensorized import softmin as ref_softmin
from test_blocksparse import CONFIGS, HARD, _check_primitives, _clusters, _hard, _solve

from srot_fast import backends

triton = pytest.importorskip("triton")
tbs = pytest.importorskip("srot_fast.kernels.triton.blocksparse")

DT = torch.float64
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _on_dev(fn):
    """``fn`` with its tensor inputs moved to ``DEV`` and its output back to the CPU."""
    return lambda *args: fn(*(t.to(DEV) if torch.is_tensor(t) else t for t in args)).cpu()


# the block-sparse Triton module on DEV, with CPU inputs and outputs
ON = types.SimpleNamespace(**{name: _on_dev(getattr(tbs, name))
                              for name in ("softmin", "weighted_mean", "plan_argmax", "max_cost")})


def _through_triton(monkeypatch):
    """Solves on 'blocksparse' take the Triton kernels: CUDA tensors do by themselves; on CPU (interpreter) the
    CPU tensors are routed to them."""
    if DEV.type == "cpu":
        monkeypatch.setattr(bs, "_on_gpu", lambda t: tbs)


def _to_dev(data):
    return tuple(t.to(DEV) for t in data)
pytestmark = [
    pytest.mark.triton,
    pytest.mark.filterwarnings("ignore:Sinkhorn stopped at max_iter"),
]


@pytest.fixture(autouse=True)
def _force_sparse(monkeypatch):
    """Prune small problems; record the kept fraction of every pass."""
    monkeypatch.setattr(bs, "MIN_PAIRS", 0)
    monkeypatch.setattr(bs, "DENSE_FRACTION", 2.0)
    monkeypatch.setattr(tbs, "SUPER", 2)  # super-blocks of 2 blocks: both pruning levels at these sizes
    kept = []
    real = tbs.block_pairs

    def spy(*args):
        out = real(*args)
        kept.append(out[2])
        return out

    monkeypatch.setattr(tbs, "block_pairs", spy)
    tbs.clear_cache()
    yield kept
    tbs.clear_cache()


def _islands(n, d, g, shift=0.0):
    """(n, d) points in n / 64 tight clusters of 64 (spread 0.05) on a line, 3 apart: after the Morton sort each
    64-point block is one cluster, so block pairs of different clusters can be dropped at a few hundred points."""
    k = n // 64
    centres = 3.0 * torch.arange(k, dtype=DT)[:, None] * torch.ones(d, dtype=DT)
    return centres[torch.arange(n) * k // n] + 0.05 * torch.randn(n, d, generator=g, dtype=DT) + shift


@pytest.mark.parametrize("d", [1, 2, 3])
@pytest.mark.parametrize("p", [1, 2])
def test_primitives_match_dense(d, p, _force_sparse):
    g = torch.Generator().manual_seed(10 * d + p)
    x, y = _islands(320, d, g), _islands(256, d, g, shift=0.02)
    y[5] = x[7]  # a coincident pair: the p = 1 kink
    h = -math.log(256) + 0.5 * torch.randn(256, generator=g, dtype=DT)
    h[::13] = -math.inf
    _check_primitives(x, y, h, 0.05**p, p, ops=ON)
    assert min(_force_sparse) < 0.5


def test_potential_like_weights(_force_sparse):
    """h = log b + g / eps with a potential varying by thousands of nats (p = 2 at small eps, where the linear
    trend bound enters): values within the bound."""
    g = torch.Generator().manual_seed(3)
    x, y = _islands(320, 2, g), _islands(256, 2, g, shift=0.02)
    eps = 0.02**2
    pot = -0.4 * ((y - 4.5) ** 2).sum(-1) + 0.3 * y[:, 0] + 0.01 * torch.randn(256, generator=g, dtype=DT)
    h = -math.log(256) + pot / eps
    _check_primitives(x, y, h, eps, 2, ops=ON)
    assert min(_force_sparse) < 0.9


def test_trend_max_closed_form():
    """The per-coordinate maximum of the p = 2 trend bound equals a brute-force maximum over a grid of the two
    intervals (never below it: the bound must hold), for random intervals, slopes (zero included) and eps."""
    g = torch.Generator().manual_seed(5)
    k = 400
    a, c = torch.randn(k, generator=g, dtype=DT), torch.randn(k, generator=g, dtype=DT)
    e, f = a + torch.rand(k, generator=g, dtype=DT), c + torch.rand(k, generator=g, dtype=DT)
    beta = torch.randn(k, generator=g, dtype=DT) * 10
    beta[::10] = 0.0
    mid = 0.5 * (c + f)
    eps = torch.rand(k, generator=g, dtype=DT) * 0.5 + 0.01
    got = tbs.trend_max(a, e, c, f, beta, mid, eps)
    s = torch.linspace(0, 1, 401, dtype=DT)
    xs = a[:, None] + (e - a)[:, None] * s                                    # (k, 401)
    ys = c[:, None] + (f - c)[:, None] * s
    vals = beta[:, None, None] * (ys[:, None, :] - mid[:, None, None]) - (xs[:, :, None] - ys[:, None, :]) ** 2 / (
        2 * eps[:, None, None])
    brute = vals.flatten(1).amax(1)
    assert (got >= brute - 1e-12).all()
    assert ((got - brute) <= 1e-3 * (1 + brute.abs())).all()


def test_float32_and_batch(_force_sparse):
    """A batch of 2 problems (one with a masked row of h) equals the problems one by one; float32 within its
    rounding of the float64 result."""
    g = torch.Generator().manual_seed(4)
    x = torch.stack([_islands(256, 2, g), _islands(256, 2, g, shift=0.5)])
    y = torch.stack([_islands(192, 2, g, shift=0.01), _islands(192, 2, g)])
    h = -math.log(192) + 0.3 * torch.randn(2, 192, generator=g, dtype=DT)
    h[1, :] = -math.inf
    eps = 0.03**2
    out = ON.softmin(x, y, h, eps, 2)
    wm = ON.weighted_mean(x, y, h, eps, 2, "grad")
    arg = ON.plan_argmax(x, y, h, eps, 2)
    assert torch.isposinf(out[1]).all() and wm[1].isnan().all() and (arg[1] == 0).all()
    torch.testing.assert_close(out[0], ON.softmin(x[0], y[0], h[0], eps, 2), rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(wm[0], ON.weighted_mean(x[0], y[0], h[0], eps, 2, "grad"), rtol=1e-13, atol=1e-13)
    assert torch.equal(arg[0], ON.plan_argmax(x[0], y[0], h[0], eps, 2))
    out32 = ON.softmin(x[0].float(), y[0].float(), h[0].float(), eps, 2)
    torch.testing.assert_close(out32.double(), out[0], rtol=1e-5, atol=1e-5)
    assert min(_force_sparse) < 0.9


@pytest.mark.parametrize("case", HARD)
def test_hard_case_primitives(case):
    """One cell, far apart clouds, duplicates, unequal densities, masked regions; a small blur and one larger
    than the data."""
    x, y, h = _hard(case, torch.Generator().manual_seed(HARD.index(case)))
    x, y, h = x[:300], y[:260], h[:260]
    for eps in (0.02**2, 1e3):
        _check_primitives(x, y, h, eps, 2, ops=ON)


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("super_", [1, 2, 4])
def test_block_pairs_guarantee(p, super_, monkeypatch):
    """The pruning alone (torch, no kernel): in every row the terms of the dropped block pairs sum to at most
    THRESHOLD of the row's sum, at a loose THRESHOLD (1e-3) and weights with a linear trend (the p = 2 trend
    bound), for super-blocks of 1, 2 and 4 blocks; the CSR lists each row block's kept column blocks once, in
    increasing order, and the kept fraction is the mask's."""
    monkeypatch.setattr(bs, "THRESHOLD", 1e-3)
    monkeypatch.setattr(tbs, "SUPER", super_)
    monkeypatch.setattr(bs, "DENSE_FRACTION", 2.0)
    g = torch.Generator().manual_seed(7 + p)
    x, y = _clusters(1500, 2, g), _clusters(1300, 2, g, 0.2)
    eps = 0.05**p
    h = -math.log(1300) + 0.5 * torch.randn(1300, generator=g, dtype=DT) + 0.1 * y[:, 0] / eps
    h[::11] = -math.inf
    ox, oy = tbs._order(x[None]), tbs._order(y[None])
    hs = h[None].gather(1, oy.perm)
    offs, cblk, frac = tbs.block_pairs(ox, oy, hs, eps, p)
    assert offs is not None and frac < 0.8
    xs, ys = ox.pts[0], oy.pts[0]
    logits = hs[0][None, :] - (torch.cdist(xs, ys) if p == 1 else 0.5 * torch.cdist(xs, ys) ** 2) / eps
    kept = torch.zeros(ox.nblk, oy.nblk, dtype=torch.bool)
    for i in range(ox.nblk):
        row = cblk[offs[i]:offs[i + 1]]
        assert torch.equal(row, row.unique())  # sorted, no repeats
        kept[i, row] = True
    mask = kept.repeat_interleave(tbs.BLOCK, 0)[:1500].repeat_interleave(tbs.BLOCK, 1)[:, :1300]
    full = torch.logsumexp(logits, 1)
    dropped = torch.logsumexp(logits.masked_fill(mask, -math.inf), 1)
    assert (dropped - full <= math.log(1e-3) + 1e-9).all()
    assert frac == pytest.approx(mask.double().mean().item(), rel=1e-12)


def test_pruning_is_reused_while_h_drifts_less_than_the_slack(_force_sparse):
    """As on the CPU path: a drift of h spanning less than REUSE_SLACK reuses the last pruning (the result within
    the bound), a wider one prunes again."""
    g = torch.Generator().manual_seed(12)
    x, y = _islands(320, 2, g), _islands(256, 2, g, shift=0.02)
    xd, yd = x.to(DEV), y.to(DEV)  # the same point tensors in every pass, as in a solve (the cache keys on them)
    h = -math.log(256) + 0.5 * torch.randn(256, generator=g, dtype=DT)
    eps = 0.05**2
    tbs.softmin(xd, yd, h.to(DEV), eps, 2)
    assert len(_force_sparse) == 1
    s = bs.REUSE_SLACK
    h2 = h + 0.99 * s * torch.rand(256, generator=g, dtype=DT)
    got, want = tbs.softmin(xd, yd, h2.to(DEV), eps, 2).cpu(), ref_softmin(x, y, h2, eps, 2)
    assert len(_force_sparse) == 1
    scale = max(float(ref_max_cost(x, y, 2)), 1.0)
    assert (got - want).abs().max() <= -eps * math.log1p(-bs.THRESHOLD) + 1e-12 * scale
    tbs.softmin(xd, yd, (h + 1.5 * s * torch.rand(256, generator=g, dtype=DT)).to(DEV), eps, 2)
    assert len(_force_sparse) == 2


def test_large_eps_falls_back_at_the_super_block_level(monkeypatch):
    """At an eps far larger than the data every super-block pair is kept: the pruning returns the dense
    fallback before testing any block pair, and the pass equals the dense reference."""
    monkeypatch.setattr(bs, "DENSE_FRACTION", 0.5)
    calls = []
    real = tbs._candidates
    monkeypatch.setattr(tbs, "_candidates", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(6)
    x, y = _islands(320, 2, g), _islands(256, 2, g, shift=0.02)
    h = torch.full((256,), -math.log(256), dtype=DT)
    ox, oy = tbs._order(x[None]), tbs._order(y[None])
    assert tbs.block_pairs(ox, oy, h[None], 1e4, 2) == (None, None, 1.0) and not calls
    torch.testing.assert_close(ON.softmin(x, y, h, 1e4, 2), ref_softmin(x, y, h, 1e4, 2), rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(not cpu_ops.available(), reason="the reference solve needs the compiled cpu kernel")
@pytest.mark.parametrize("cfg,p", [("kl_soft", 2), ("partial_soft", 1)])
def test_solve_matches_dense(cfg, p, monkeypatch, _force_sparse):
    """A solve on 'blocksparse' with the Triton kernels (what CUDA tensors get) equals the dense 'cpu' backend:
    values, potentials, masses, gradients."""
    g = torch.Generator().manual_seed(20 + p)
    x, y = _islands(256, 2, g), _islands(192, 2, g, shift=0.02)
    a = torch.rand(256, generator=g, dtype=DT) + 0.5
    b = torch.rand(192, generator=g, dtype=DT) + 0.5
    s_x = torch.rand(256, generator=g, dtype=DT) * 0.98 + 0.01
    s_y = torch.rand(192, generator=g, dtype=DT) * 0.98 + 0.01
    data = (x, y, a / a.sum(), b / b.sum(), s_x, s_y)
    ref_res, ref_grads = _solve("cpu", CONFIGS[cfg], p, data, 12)
    _through_triton(monkeypatch)
    _force_sparse.clear()
    res, grads = _solve("blocksparse", CONFIGS[cfg], p, _to_dev(data), 12)
    assert res.n_iter == ref_res.n_iter and res.f.device.type == DEV.type
    for name in ("value", "f", "g", "row_mass", "col_mass"):
        torch.testing.assert_close(getattr(res, name).detach().cpu(), getattr(ref_res, name).detach(), atol=1e-9,
                                   rtol=1e-9, msg=name)
    for name, got, want in zip("xyab", grads, ref_grads):
        torch.testing.assert_close(got.cpu(), want, atol=1e-9, rtol=1e-9, msg=f"d value / d {name}")
    assert _force_sparse and min(_force_sparse) < 0.6


def test_cuda_tensors_may_take_blocksparse():
    """backend='blocksparse' is accepted for CUDA tensors (the Triton kernels); 'cpu' is not."""
    cuda = torch.device("cuda")
    assert backends.resolve_backend("blocksparse", 10**4, 10**4, cuda) == "blocksparse"
    with pytest.raises(ValueError, match="backend='cpu' needs CPU tensors"):
        backends.resolve_backend("cpu", 10**4, 10**4, cuda)


@pytest.mark.skipif(not cpu_ops.available(), reason="the reference solve needs the compiled cpu kernel")
@pytest.mark.parametrize("cfg", ["kl_soft", "partial"])
def test_coarse_start_on_the_triton_passes(cfg, monkeypatch, _force_sparse):
    """The coarse-to-fine start (srot_fast/_multiscale.py) with the Triton kernels (what CUDA tensors get): cells,
    lift and fine passes through them reach the fixed point of the ordinary schedule on the same passes (values
    within 1e-8 relative at tol 1e-7, as tests/test_multiscale.py). Partial OT without offsets: with them it
    takes the ordinary schedule."""
    from srot_fast import _multiscale as ms
    from srot_fast import sinkhorn

    _through_triton(monkeypatch)
    g = torch.Generator().manual_seed(31)
    x, y = _islands(192, 2, g), _islands(128, 2, g, shift=0.02)
    a = torch.rand(192, generator=g, dtype=DT) + 0.5
    b = torch.rand(128, generator=g, dtype=DT) + 0.5
    u, v = 0.5 * torch.rand(192, generator=g, dtype=DT), 0.5 * torch.rand(128, generator=g, dtype=DT)
    x, y, a, b, u, v = _to_dev((x, y, a, b, u, v))
    kw = dict(penalty="balanced", mass=0.6) if cfg == "partial" else dict(CONFIGS[cfg])
    if not kw.pop("offsets", False):
        u = v = None
    cells = []
    real = ms._cells
    monkeypatch.setattr(ms, "_cells", lambda *args: cells.append(1) or real(*args))
    out = {}
    for on in (False, True):
        monkeypatch.setattr(ms, "MIN_PAIRS", 0 if on else 1 << 62)
        cells.clear()
        out[on] = sinkhorn(x, y, a / a.sum(), b / b.sum(), p=2, eps=0.2**2, u=u, v=v, tol=1e-7, max_iter=3000,
                           backend="blocksparse", **kw)
        assert bool(cells) == on
    assert out[True].converged and out[False].converged
    torch.testing.assert_close(out[True].value, out[False].value, rtol=1e-8, atol=0)
