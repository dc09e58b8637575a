"""The coarse-to-fine start of the block-sparse backend (srot_fast/_multiscale.py), in float64.

A solve with the coarse start and one without it (the ordinary eps-scaling, same backend) reach the same fixed
point to the same tol: values agree within 1e-8 relative (the value's error is second order in the marginal
error, tol = 1e-7 here), transported masses within 1e-5 absolute (first order in it, total mass 1), and
the coarse path must actually run (cells built) where it applies and not where it must not. Small problems
are forced through it (``MIN_PAIRS = 0`` in both modules).
"""
from __future__ import annotations

import pytest
import torch
from srot_fast.kernels import blocksparse as bs
from srot_fast.kernels import cpu_ops

from srot_fast import _multiscale as ms
from srot_fast import sinkhorn
from srot_fast.loss import SROTLoss

DT = torch.float64
pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="needs the compiled cpu kernel")


@pytest.fixture
def coarse(monkeypatch):
    """Force the block-sparse passes and the coarse start on small problems; count the cell builds."""
    monkeypatch.setattr(bs, "MIN_PAIRS", 0)
    calls = []
    real = ms._cells

    def spy(*args):
        calls.append(args[0].shape[1])
        return real(*args)

    monkeypatch.setattr(ms, "_cells", spy)

    def switch(on: bool):
        monkeypatch.setattr(ms, "MIN_PAIRS", 0 if on else 1 << 62)
        calls.clear()
        return calls

    return switch


def _data(seed, n=900, m=800, d=2):
    g = torch.Generator().manual_seed(seed)
    centres = torch.rand(6, d, generator=g, dtype=DT) * 6
    x = centres[torch.randint(6, (n,), generator=g)] + 0.3 * torch.randn(n, d, generator=g, dtype=DT)
    y = centres[torch.randint(6, (m,), generator=g)] + 0.3 * torch.randn(m, d, generator=g, dtype=DT) + 0.1
    a = torch.rand(n, generator=g, dtype=DT) + 0.5
    b = torch.rand(m, generator=g, dtype=DT) + 0.5
    a[:7] = 0  # zero weights: in no cell
    u = 0.5 * torch.rand(n, generator=g, dtype=DT)
    v = 0.5 * torch.rand(m, generator=g, dtype=DT)
    return x, y, a / a.sum(), b / b.sum(), u, v


CONFIGS = {
    "balanced": dict(penalty="balanced"),
    "kl_soft": dict(penalty="kl", tau=(0.7, 1.3), offsets=True),
    "tv_soft": dict(penalty="tv", tau=0.5, offsets=True),
    "partial": dict(penalty="balanced", mass=0.6),  # (with offsets: no coarse start, test_partial_soft_srot_...)
}


def _solve(cfg, p, data, blur):
    x, y, a, b, u, v = data
    kw = dict(cfg)
    if not kw.pop("offsets", False):
        u = v = None
    xx = x.clone().requires_grad_()
    res = sinkhorn(xx, y, a, b, p=p, eps=blur**p, u=u, v=v, tol=1e-7, max_iter=3000, backend="blocksparse", **kw)
    return res, torch.autograd.grad(res.value, xx)[0]


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("p", [1, 2])
def test_same_fixed_point(cfg, p, coarse):
    data = _data(10 + p)
    blur = 0.5 if cfg == "balanced" else 0.2  # balanced OT between clusters of unequal mass converges slowly
    coarse(False)
    want, gwant = _solve(CONFIGS[cfg], p, data, blur)
    calls = coarse(True)
    got, ggot = _solve(CONFIGS[cfg], p, data, blur)
    assert calls, "the coarse start did not run"
    assert got.converged and want.converged
    torch.testing.assert_close(got.value, want.value, rtol=1e-8, atol=0)
    for name in ("row_mass", "col_mass"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=0, atol=1e-5, msg=name)
    scale = gwant.abs().max()
    assert (ggot - gwant).abs().max() <= 1e-4 * scale


@pytest.mark.parametrize("d", [1, 3])
def test_other_dimensions(d, coarse):
    data = _data(20 + d, d=d)
    coarse(False)
    want, _ = _solve(CONFIGS["kl_soft"], 2, data, 0.2)
    calls = coarse(True)
    got, _ = _solve(CONFIGS["kl_soft"], 2, data, 0.2)
    assert calls
    torch.testing.assert_close(got.value, want.value, rtol=1e-8, atol=0)


@pytest.mark.parametrize("batched", [False, True])
def test_self_transport_debiased_loss(batched, coarse):
    """SROTLoss with debias=True (the self-transport solves take the symmetric coarse start too), on one problem
    and on a batch of two problems at two scales: same values and gradients as the ordinary schedule."""
    x, y, a, b, _, _ = _data(30)
    if batched:
        d1 = _data(31)
        x, y = torch.stack([x, 0.5 * d1[0]]), torch.stack([y, 0.5 * d1[1]])
        a, b = torch.stack([a, d1[2]]), torch.stack([b, d1[3]])
    out = {}
    for on in (False, True):
        calls = coarse(on)
        xx = x.clone().requires_grad_()
        loss = SROTLoss(p=2, blur=0.2, reach=1.0, backend="blocksparse", tol=1e-7, value_tol=None, max_iter=3000)
        value = loss(a, xx, b, y)
        out[on] = (value.detach(), torch.autograd.grad(value.sum(), xx)[0], len(calls))
    assert out[True][2] >= 4 and out[False][2] == 0  # cells of x and y, then of x and of y alone
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-7, atol=1e-10)
    torch.testing.assert_close(out[True][1], out[False][1], rtol=0, atol=1e-4 * float(out[False][1].abs().max()))


@pytest.mark.parametrize("cfg", ["kl_soft", "partial"])
def test_batch(cfg, coarse):
    """A batch of three problems: two scales (the grids share the larger width) and one ragged problem padded
    with zero-weight points far away (outside its grid's corner: neutral). Same fixed point as the ordinary
    schedule, problem by problem."""
    probs = [_data(50 + k) for k in range(3)]
    x1, y1, a1, b1, u1, v1 = probs[1]
    probs[1] = (0.5 * x1, 0.5 * y1 - 1.0, a1, b1, 0.25 * u1, 0.25 * v1)
    x2, y2, a2, b2, u2, v2 = (t.clone() for t in probs[2])
    a2[-200:], b2[-100:] = 0.0, 0.0
    x2[-200:], y2[-100:] = 100.0, -100.0
    probs[2] = (x2, y2, a2 / a2.sum(), b2 / b2.sum(), u2, v2)
    X, Y, A, B, U, V = (torch.stack(t) for t in zip(*probs))
    kw = dict(CONFIGS[cfg])
    if not kw.pop("offsets", False):
        U = V = None
    out = {}
    for on in (False, True):
        calls = coarse(on)
        out[on] = sinkhorn(X, Y, A, B, p=2, eps=0.2**2, u=U, v=V, tol=1e-7, max_iter=3000, backend="blocksparse",
                           **kw)
        assert bool(calls) == on
    assert out[True].converged.all() and out[False].converged.all()
    torch.testing.assert_close(out[True].value, out[False].value, rtol=1e-8, atol=0)
    assert (out[True].n_iter < out[False].n_iter).any()  # the start changed the path


def test_batched_cells_in_3d():
    """Cells of a batch of 9 problems in 3-D, each with zero-weight points far outside its box: every problem's
    cells hold its own points, their masses sum to its mass, padding cells weigh nothing."""
    g = torch.Generator().manual_seed(8)
    x = torch.rand(9, 300, 3, generator=g, dtype=DT) * torch.arange(1, 10, dtype=DT)[:, None, None]
    a = torch.rand(9, 300, generator=g, dtype=DT)
    a[:, -20:] = 0.0
    x[:, -20:] = 1e9
    la = a.log()
    lo, w = ms._grid(x, x, la, la)
    kept = x[:, :-20]
    torch.testing.assert_close(lo, kept.amin(1), rtol=0, atol=0)  # the corner of the points of positive weight
    side = float((kept.amax(1) - kept.amin(1)).amax())
    assert w == pytest.approx(side / 5, rel=1e-12)  # the largest problem's side / ceil((300 / 4)^(1/3))
    cells = ms._cells(x, la, lo, w)
    assert (cells.of[:, -20:] == -1).all() and (cells.of[:, :-20] >= 0).all()
    torch.testing.assert_close(cells.log_w.exp().sum(-1), a.sum(-1), rtol=1e-13, atol=0)
    for k in range(9):
        used = cells.of[k][cells.of[k] >= 0].unique()
        assert torch.equal(used, torch.arange(len(used)))       # cells 0..K_k-1, the rest padding
        assert torch.isneginf(cells.log_w[k, len(used):]).all()
        mine = cells.of[k] == 0
        torch.testing.assert_close(cells.pts[k, 0], (a[k, mine, None] * x[k, mine]).sum(0) / a[k, mine].sum())


def test_not_used_where_it_must_not(coarse):
    """tol=None (GeomLoss's fixed schedule), warm starts and the dense backends keep the ordinary schedule:
    identical results, no cells."""
    x, y, a, b, _, _ = _data(40)
    calls = coarse(True)
    r1 = sinkhorn(x, y, a, b, p=2, eps=0.04, tol=None, backend="blocksparse")
    sinkhorn(x, y, a, b, p=2, eps=0.04, tol=1e-3, backend="blocksparse", init=(r1.f, r1.g))
    sinkhorn(x, y, a, b, p=2, eps=0.04, tol=1e-3, backend="cpu")
    assert calls == []
    coarse(False)
    r0 = sinkhorn(x, y, a, b, p=2, eps=0.04, tol=None, backend="blocksparse")
    assert r0.n_iter == r1.n_iter and torch.equal(r0.f, r1.f)


def test_partial_soft_srot_takes_the_ordinary_schedule(coarse):
    """Partial OT with soft SROT offsets (gamma / CE, from uniform scores in [0.05, 0.95]) does not take the coarse
    start: after its lifted start the solve at the target eps stalled (marginal error 0.19 after 1000 updates,
    value 3 % low, where the ordinary schedule converges in 138). No cells; the same result as the ``cpu``
    backend, to the block-sparse truncation (1e-8 relative)."""
    from srot_fast import soft_offsets

    gen = torch.Generator().manual_seed(2)
    x = torch.rand(400, 2, generator=gen, dtype=DT)
    y = torch.rand(450, 2, generator=gen, dtype=DT) + 0.3
    a, b = torch.rand(400, generator=gen, dtype=DT) + 0.1, torch.rand(450, generator=gen, dtype=DT) + 0.1
    s_x = 0.9 * torch.rand(400, generator=gen, dtype=DT) + 0.05
    s_y = 0.9 * torch.rand(450, generator=gen, dtype=DT) + 0.05
    u, v = soft_offsets(s_x, s_y, float(((x[:, None] - y[None]) ** 2).sum(-1).max() / 2))
    kw = dict(p=2, eps=0.02**2, mass=0.7, u=u, v=v, tol=1e-3)
    calls = coarse(True)
    got = sinkhorn(x, y, a / a.sum(), b / b.sum(), backend="blocksparse", **kw)
    assert calls == [] and got.converged
    want = sinkhorn(x, y, a / a.sum(), b / b.sum(), backend="cpu", **kw)
    torch.testing.assert_close(got.value, want.value, rtol=1e-8, atol=0)


def test_cell_offsets_are_weighted_soft_min():
    """U_I = -eps log sum_i (a_i / A_I) exp(-u_i / eps) over each cell, and the cells' masses sum to |a|."""
    g = torch.Generator().manual_seed(5)
    x = torch.rand(1, 500, 2, generator=g, dtype=DT)
    a = torch.rand(1, 500, generator=g, dtype=DT)
    u = torch.rand(1, 500, generator=g, dtype=DT)
    cells = ms._cells(x, a.log(), torch.zeros(1, 2, dtype=DT), 0.25)
    assert cells.pts.shape[1] == 16
    torch.testing.assert_close(cells.log_w.exp().sum(), a.sum(), rtol=1e-13, atol=0)
    eps = 0.1
    got = cells.offsets(u, a.log(), eps)[0]
    for k in range(16):
        mine = cells.of[0] == k
        want = -eps * torch.log((a[0, mine] / a[0, mine].sum() * torch.exp(-u[0, mine] / eps)).sum())
        torch.testing.assert_close(got[k], want, rtol=1e-12, atol=1e-14)
        assert (x[0, mine] // 0.25 == x[0, mine][0] // 0.25).all()  # one grid cell
        torch.testing.assert_close(cells.pts[0, k], (a[0, mine, None] * x[0, mine]).sum(0) / a[0, mine].sum())
