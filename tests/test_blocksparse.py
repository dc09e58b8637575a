"""The ``blocksparse`` backend (kernels/blocksparse.py) against the dense paths, in float64.

Primitives are compared with ``kernels.tensorized`` (dense N x M, float64); full solves with the dense
``cpu`` backend on the same data and the same fixed number of updates (``tol`` below any reachable error), so
the two perform the same arithmetic except for the dropped block pairs and the summation order.

Tolerances. The module guarantees that the dropped terms of a row weigh at most THRESHOLD (1e-12 by default)
of the row's sum, so a soft-min moves by at most -eps log(1 - THRESHOLD) and a weighted mean by at most
2 THRESHOLD max_j |phi - x_i|; float64 rounding of the two summation orders adds ~1e-15 relative of the cost
scale. Primitives: within that bound plus 1e-12 of the cost (or coordinate) scale. Solves: values, potentials,
masses, gradients and barycentric projections within atol = rtol = 1e-9 (the per-pass differences are ~1e-14
and the updates are contractions). Pruning is forced on small problems (``MIN_PAIRS = 0``; in most tests also
``DENSE_FRACTION = 2``, never dense), and each test checks that block pairs were actually dropped where the
geometry allows it.
"""
from __future__ import annotations

import math

import pytest
import torch
from reference import assert_argmax
from srot_fast.kernels import blocksparse as bs
from srot_fast.kernels import cpu_ops
from srot_fast.kernels import tensorized as ref

from srot_fast import sinkhorn
from srot_fast.loss import SROTLoss

DT = torch.float64
INF = float("inf")
TOL = dict(atol=1e-9, rtol=1e-9)
pytestmark = [
    pytest.mark.filterwarnings("ignore:Sinkhorn stopped at max_iter"),
    pytest.mark.skipif(not cpu_ops.available(), reason="needs the compiled cpu kernel"),
]


@pytest.fixture(autouse=True)
def _force_sparse(monkeypatch):
    """Prune even small problems, and record the kept fraction of every pruning sweep."""
    monkeypatch.setattr(bs, "MIN_PAIRS", 0)
    monkeypatch.setattr(bs, "DENSE_FRACTION", 2.0)
    kept = []
    real = bs._prune

    def spy(*args):
        out = real(*args)
        kept.append(out[2])
        return out

    monkeypatch.setattr(bs, "_prune", spy)
    bs.clear_cache()
    yield kept
    bs.clear_cache()


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _clusters(n, d, g, shift=0.0):
    """(n, d) points around 8 random centres in [0, 10]^d (spread 0.3): block pairs of different clusters can
    be dropped even at these small sizes."""
    centres = torch.rand(8, d, generator=g, dtype=DT) * 10
    return centres[torch.randint(8, (n,), generator=g)] + 0.3 * torch.randn(n, d, generator=g, dtype=DT) + shift


def _check_primitives(x, y, h, eps, p, thr=None, ops=bs):
    """Every primitive of ``ops`` (a block-sparse module) against the float64 reference, within the truncation
    bound of the module."""
    thr = bs.THRESHOLD if thr is None else thr
    x64, y64, h64 = x.double(), y.double(), h.double()
    scale = max(ref.max_cost(x64, y64, p).item(), 1.0)
    want = ref.softmin(x64, y64, h64, eps, p)
    got = ops.softmin(x, y, h, eps, p)
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got))
    bound = -eps * math.log1p(-thr) + 1e-12 * scale
    assert (got - want)[finite].abs().max() <= bound
    reach = torch.cdist(x64, y64).amax(1, keepdim=True)  # max_j |x_i - y_j|: bounds |phi - x_i| (p = 2, 'y')
    for phi in ("y", "grad"):
        want = ref.weighted_mean(x64, y64, h64, eps, p, phi)
        got = ops.weighted_mean(x, y, h, eps, p, phi)
        rows = finite
        lim = 2 * thr * (1.0 if (phi == "grad" and p == 1) else reach[rows]) + 1e-12 * (1 + reach[rows])
        assert ((got - want)[rows].abs() <= lim).all(), phi
        assert got[~rows].isnan().all()
    logits = h64[None, :] - ref.cost_matrix(x64, y64, p) / eps
    arg = ops.plan_argmax(x, y, h, eps, p)
    best = logits.amax(1)
    got_val = logits.gather(1, arg[:, None])[:, 0]
    assert (got_val[finite] >= best[finite] - 1e-12 * (1 + best[finite].abs())).all()
    assert (arg[~finite] == 0).all()
    torch.testing.assert_close(ops.max_cost(x, y, p), ref.max_cost(x64, y64, p), rtol=1e-14, atol=0)


# ------------------------------------------------------------------------------------------ primitives
@pytest.mark.parametrize("d", [1, 2, 3])
@pytest.mark.parametrize("p", [1, 2])
def test_primitives_match_dense(d, p, _force_sparse):
    """Random potentials-like log-weights (with -inf columns) at a small eps: pruned passes agree with the
    dense reference within the stated bound."""
    g = _gen(10 * d + p)
    n, m = 1500, 1300
    x = _clusters(n, d, g)
    y = _clusters(m, d, g, 0.2)
    y[7] = x[3]  # a coincident pair: the p = 1 kink
    h = -math.log(m) + 0.5 * torch.randn(m, generator=g, dtype=DT)
    h[::13] = -INF
    eps = 0.05 ** p
    _check_primitives(x, y, h, eps, p)
    assert min(_force_sparse) < 0.9  # block pairs were dropped


@pytest.mark.parametrize("d", [1, 2, 3])
def test_potential_like_weights(d, _force_sparse):
    """h = log b + g / eps with a smooth potential g varying by thousands of nats across the data (as in a
    solve at small eps, where the p = 2 trend bound does the pruning): still within the stated bound."""
    g = _gen(50 + d)
    x = torch.rand(1500, d, generator=g, dtype=DT) * 4
    y = torch.rand(1300, d, generator=g, dtype=DT) * 4
    eps = 0.02 ** 2
    pot = -0.4 * ((y - 2.0) ** 2).sum(-1) + 0.3 * y[:, 0] + 0.01 * torch.randn(1300, generator=g, dtype=DT)
    h = -math.log(1300) + pot / eps
    _check_primitives(x, y, h, eps, 2)
    if d <= 2:  # 1500 points in 3-D make blocks too wide against eps to drop anything
        assert min(_force_sparse) < 0.9


def _shell(n, g, radius, centre):
    """(n, 3) points on a sphere shell: 64-point blocks of a 2-D surface in 3-D are wide against a small eps."""
    v = torch.randn(n, 3, generator=g, dtype=DT)
    return radius * v / v.norm(dim=1, keepdim=True) + torch.tensor(centre, dtype=DT)


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("potential", [False, True])
def test_row_bounds_on_wide_blocks(p, potential, monkeypatch, _force_sparse):
    """Two sphere shells apart, eps small against the blocks: the second sweep (exact row bounds over the most
    promising column blocks, and at p = 2 their linear trend across the row block) keeps fewer pairs than the
    box bounds alone, and every primitive stays within the stated bound."""
    g = _gen(70 + p + 2 * potential)
    x, y = _shell(3000, g, 1.0, (0.0, 0.0, 0.0)), _shell(2800, g, 1.0, (2.5, 0.0, 0.0))
    eps = 0.01 if p == 1 else 0.05 ** 2
    h = torch.full((2800,), -math.log(2800), dtype=DT)
    if potential:  # a transport-like potential: g_j = <y_j, shift> - |shift|^2 / 2, shift = (-2.5, 0, 0)
        h = h + (-2.5 * y[:, 0] - 3.125) / eps
    monkeypatch.setattr(bs, "TIGHTEN_ABOVE", 2.0)  # box bounds only
    bs.softmin(x, y, h, eps, p)
    boxes_only = _force_sparse[-1]
    monkeypatch.setattr(bs, "TIGHTEN_ABOVE", 0.0)
    first = len(_force_sparse)
    _check_primitives(x, y, h, eps, p)
    assert _force_sparse[first] < (0.9 if p == 1 else 0.7) * boxes_only


@pytest.mark.parametrize("p", [1, 2])
def test_loose_threshold_respects_its_bound(p, monkeypatch, _force_sparse):
    """With THRESHOLD = 1e-3 more pairs go than with the default; the errors stay within the stated bound."""
    g = _gen(5 + p)
    x = _clusters(2000, 2, g)
    y = _clusters(1800, 2, g)
    h = -math.log(1800) + torch.randn(1800, generator=g, dtype=DT)
    bs.softmin(x, y, h, 0.05 ** p, p)
    strict = _force_sparse[-1]
    monkeypatch.setattr(bs, "THRESHOLD", 1e-3)
    first = len(_force_sparse)
    _check_primitives(x, y, h, 0.05 ** p, p, thr=1e-3)
    assert _force_sparse[first] < strict  # the soft-min pass


def test_float32_matches_within_float32_rounding():
    g = _gen(3)
    x = torch.rand(1200, 2, generator=g) * 4
    y = torch.rand(1000, 2, generator=g) * 4
    h = torch.full((1000,), -math.log(1000.0))
    for p in (1, 2):
        eps = 0.05 ** p
        want = ref.softmin(x.double(), y.double(), h.double(), eps, p)
        got = bs.softmin(x, y, h, eps, p)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * ref.max_cost(x, y, p).item())
        wm = bs.weighted_mean(x, y, h, eps, p, "y")
        torch.testing.assert_close(wm.double(), ref.weighted_mean(x.double(), y.double(), h.double(), eps, p, "y"),
                                   rtol=1e-5, atol=1e-4)


def test_batched_equals_unbatched(_force_sparse):
    """A ragged batch (padding columns at -inf, one fully masked problem) equals the per-problem calls."""
    g = _gen(4)
    x = torch.stack([_clusters(900, 2, g) for _ in range(3)])
    y = torch.stack([_clusters(700, 2, g) for _ in range(3)])
    h = -math.log(700) + torch.randn(3, 700, generator=g, dtype=DT)
    h[0, -100:] = -INF
    h[1] = -INF
    eps = 0.003
    out = bs.softmin(x, y, h, eps, 2)
    wm = bs.weighted_mean(x, y, h, eps, 2, "grad")
    arg = bs.plan_argmax(x, y, h, eps, 2)
    mc = bs.max_cost(x, y, 1)
    assert torch.isposinf(out[1]).all() and wm[1].isnan().all() and (arg[1] == 0).all()
    for b in (0, 2):
        torch.testing.assert_close(out[b], bs.softmin(x[b], y[b], h[b], eps, 2), rtol=1e-13, atol=1e-13)
        torch.testing.assert_close(wm[b], bs.weighted_mean(x[b], y[b], h[b], eps, 2, "grad"), rtol=1e-13, atol=1e-13)
        assert torch.equal(arg[b], bs.plan_argmax(x[b], y[b], h[b], eps, 2))
        _check_primitives(x[b], y[b], h[b], eps, 2)
    torch.testing.assert_close(mc, ref.max_cost(x, y, 1), rtol=1e-14, atol=0)
    assert bs.softmin(x[:0], y[:0], h[:0], eps, 2).shape == (0, 900)
    assert min(_force_sparse) < 0.9


# ------------------------------------------------------------------------------------------ hard cases
def _hard(case, g):
    n, m = 700, 600
    if case == "one_cell":  # every point in one cell: a spread far below any grid resolution
        x = 1.0 + 1e-13 * torch.rand(n, 2, generator=g, dtype=DT)
        y = 1.0 + 1e-13 * torch.rand(m, 2, generator=g, dtype=DT)
    elif case == "far_apart":  # two clouds 100 diameters apart
        x = torch.rand(n, 2, generator=g, dtype=DT)
        y = torch.rand(m, 2, generator=g, dtype=DT) + torch.tensor([100.0, 0.0], dtype=DT)
    elif case == "duplicates":  # 10 distinct sites, each repeated, shared by both clouds
        sites = torch.rand(10, 2, generator=g, dtype=DT) * 3
        x = sites[torch.randint(10, (n,), generator=g)]
        y = sites[torch.randint(10, (m,), generator=g)]
    elif case == "unequal_density":  # a dense clump plus sparse outliers, against a uniform cloud
        x = torch.cat([0.01 * torch.rand(n - 50, 2, generator=g, dtype=DT) + 1.5,
                       torch.rand(50, 2, generator=g, dtype=DT) * 3])
        y = torch.rand(m, 2, generator=g, dtype=DT) * 3
    elif case == "masked_region":  # -inf on every column of a half plane (whole blocks)
        x = torch.rand(n, 2, generator=g, dtype=DT) * 3
        y = torch.rand(m, 2, generator=g, dtype=DT) * 3
    else:
        raise ValueError(case)
    h = -math.log(m) + 0.3 * torch.randn(m, generator=g, dtype=DT)
    if case == "masked_region":
        h[y[:, 0] < 1.5] = -INF
    return x, y, h


HARD = ["one_cell", "far_apart", "duplicates", "unequal_density", "masked_region"]


@pytest.mark.parametrize("case", HARD)
@pytest.mark.parametrize("p", [1, 2])
def test_hard_case_primitives(case, p):
    x, y, h = _hard(case, _gen(HARD.index(case)))
    for eps in (0.02 ** p, 1e3):  # small, and a blur far larger than the data (nothing can be dropped)
        _check_primitives(x, y, h, eps, p)
        _check_primitives(y, x, torch.full((x.shape[0],), -math.log(x.shape[0]), dtype=DT), eps, p)


def test_all_columns_masked():
    x, y, h = _hard("masked_region", _gen(0))
    h[:] = -INF
    assert torch.isposinf(bs.softmin(x, y, h, 0.01, 2)).all()
    assert bs.weighted_mean(x, y, h, 0.01, 2, "y").isnan().all()
    assert (bs.plan_argmax(x, y, h, 0.01, 2) == 0).all()


def test_dense_fallbacks(monkeypatch, _force_sparse):
    """A large eps keeps every pair and runs the dense pass (with the default DENSE_FRACTION); d = 4 always
    runs the dense pass; both equal the dense kernel."""
    monkeypatch.setattr(bs, "DENSE_FRACTION", 0.5)
    g = _gen(8)
    x, y = torch.rand(800, 2, generator=g, dtype=DT), torch.rand(700, 2, generator=g, dtype=DT)
    h = torch.full((700,), -math.log(700), dtype=DT)
    torch.testing.assert_close(bs.softmin(x, y, h, 10.0, 2), cpu_ops.softmin(x, y, h, 10.0, 2), rtol=0, atol=0)
    assert _force_sparse[-1] == 1.0 and bs.last_kept_fraction() == 1.0
    x4, y4 = torch.rand(300, 4, generator=g, dtype=DT), torch.rand(200, 4, generator=g, dtype=DT)
    h4 = torch.zeros(200, dtype=DT)
    torch.testing.assert_close(bs.softmin(x4, y4, h4, 0.01, 2), ref.softmin(x4, y4, h4, 0.01, 2))
    torch.testing.assert_close(bs.max_cost(x4, y4, 1), ref.max_cost(x4, y4, 1))


@pytest.mark.parametrize("p", [1, 2])
def test_pruning_is_reused_while_h_drifts_less_than_the_slack(p, monkeypatch, _force_sparse):
    """A pass whose h differs from the last pruned one (same points, eps, settings) by a drift spanning at most
    REUSE_SLACK nats reuses that pruning, and every primitive stays within the stated bound -- also for a drift
    that lifts the far half of the columns and lowers the near half by (almost) the full slack; a wider drift,
    a new -inf entry or another THRESHOLD prune again."""
    calls = []
    real = bs._prune
    monkeypatch.setattr(bs, "_prune", lambda *a: calls.append(a[3] is not None) or real(*a))
    lse_prunes = lambda: sum(calls)  # noqa: E731  (max_cost's prunings have no h and are not reused)
    g = _gen(40 + p)
    x, y = _clusters(1500, 2, g), _clusters(1300, 2, g, 0.2)
    eps = 0.05**p
    h = -math.log(1300) + 0.5 * torch.randn(1300, generator=g, dtype=DT)
    bs.softmin(x, y, h, eps, p)
    assert lse_prunes() == 1 and bs.last_kept_fraction() < 0.9
    near = torch.cdist(y, x).amin(1) < torch.cdist(y, x).amin(1).median()
    s = bs.REUSE_SLACK
    for drift in (s * (torch.rand(1300, generator=g, dtype=DT) - 0.5) + 7.0,
                  torch.where(near, -0.4995 * s, 0.4995 * s).to(DT)):
        _check_primitives(x, y, h + drift, eps, p)
    assert lse_prunes() == 1
    bs.softmin(x, y, h + 1.5 * s * torch.rand(1300, generator=g, dtype=DT), eps, p)
    assert lse_prunes() == 2
    h_inf = h.clone()
    h_inf[3] = -math.inf
    bs.softmin(x, y, h_inf, eps, p)
    assert lse_prunes() == 3
    monkeypatch.setattr(bs, "THRESHOLD", 1e-6)
    bs.softmin(x, y, h_inf, eps, p)
    assert lse_prunes() == 4


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_slope_of_degenerate_blocks(device):
    """The least-squares slope behind the p = 2 trend bound: a block with one finite weight or with every weight
    -inf gets the slope 0 (not an error: the CUDA solver once refused the zero Gram matrix), one with all its
    points equal a finite slope (any slope gives valid bounds), a regular block the least-squares fit."""
    g = _gen(8)
    xc = torch.randn(4, 64, 2, generator=g, dtype=DT)
    v = torch.randn(4, 64, generator=g, dtype=DT)
    v[0, 1:] = -math.inf  # one finite weight
    v[1] = -math.inf  # none
    xc[2] = xc[2, :1]  # all points equal
    v[3] = xc[3] @ torch.tensor([2.0, -3.0], dtype=DT) + 0.01 * torch.randn(64, generator=g, dtype=DT)
    xc, v = xc.to(device), v.to(device)
    out = bs._slope(xc, v, torch.isfinite(v)).cpu()
    assert torch.equal(out[:2], torch.zeros(2, 2, dtype=DT)) and torch.isfinite(out[2]).all()
    xm = xc[3].cpu() - xc[3].cpu().mean(0)
    want = torch.linalg.lstsq(xm, v[3].cpu() - v[3].cpu().mean()).solution
    torch.testing.assert_close(out[3], want, rtol=1e-9, atol=1e-12)


def test_ordering_cache_sees_writes_through_data():
    """A write through ``.data`` does not bump the version counter; the cache compares contents, so the next
    pass uses the new points."""
    g = _gen(9)
    x, y = torch.rand(900, 2, generator=g, dtype=DT) * 3, torch.rand(800, 2, generator=g, dtype=DT) * 3
    h = torch.full((800,), -math.log(800), dtype=DT)
    bs.softmin(x, y, h, 0.002, 2)
    x.data.copy_(torch.rand(900, 2, generator=g, dtype=DT) * 3)
    y.data[:400] += 0.5
    torch.testing.assert_close(bs.softmin(x, y, h, 0.002, 2), ref.softmin(x, y, h, 0.002, 2), rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------------ full solves
def _cloud(seed, n, m):
    g = _gen(seed)
    x = _clusters(n, 2, g)
    y = _clusters(m, 2, g, 0.1)
    y[3] = x[5]  # a coincident pair: the p = 1 kink
    a = torch.rand(n, generator=g, dtype=DT) + 0.5
    b = torch.rand(m, generator=g, dtype=DT) + 0.5
    s_x = torch.rand(n, generator=g, dtype=DT) * 0.98 + 0.01
    s_y = torch.rand(m, generator=g, dtype=DT) * 0.98 + 0.01
    return x, y, a / a.sum(), b / b.sum(), s_x, s_y


CONFIGS = {
    "balanced": dict(penalty="balanced"),
    "kl_soft": dict(penalty="kl", tau=(0.7, 1.3), offsets=True),
    "tv_soft": dict(penalty="tv", tau=0.5, offsets=True),
    "partial_soft": dict(penalty="balanced", mass=0.6, offsets=True),
}


def _solve(backend, cfg, p, data, iters):
    x, y, a, b, s_x, s_y = data
    x, y, a, b = (t.clone().requires_grad_() for t in (x, y, a, b))
    kw = dict(cfg)
    u = v = None
    if kw.pop("offsets", False):
        u, v = 0.3 * -torch.log(s_x), 0.3 * -torch.log1p(-s_y)
    res = sinkhorn(x, y, a, b, p=p, eps=0.04**p, u=u, v=v, tol=1e-300, max_iter=iters, backend=backend, **kw)
    grads = torch.autograd.grad(res.value, (x, y, a, b))
    return res, grads


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("p", [1, 2])
def test_solve_matches_dense(cfg, p, _force_sparse):
    """Values, potentials, masses, gradients (points and weights), barycentric projections and plan arg-max
    of a solve on 'blocksparse' vs the dense 'cpu' backend."""
    data = _cloud(20 + p, 1100, 1000)
    ref_res, ref_grads = _solve("cpu", CONFIGS[cfg], p, data, 30)
    _force_sparse.clear()
    res, grads = _solve("blocksparse", CONFIGS[cfg], p, data, 30)
    assert res.backend == "blocksparse" and res.n_iter == ref_res.n_iter
    for name in ("value", "f", "g", "row_mass", "col_mass"):
        torch.testing.assert_close(getattr(res, name).detach(), getattr(ref_res, name).detach(), **TOL, msg=name)
    for name, got, want in zip("xyab", grads, ref_grads):
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got, want, **TOL, msg=f"d value / d {name}")
    torch.testing.assert_close(res.barycentric_projection(), ref_res.barycentric_projection(), **TOL)
    # the arg-max on the reference plan's logits, up to near-ties (the potentials agree to TOL only)
    geom = ref_res._geom
    logits = ref_res._col_logits()[0][None, :] - ref.cost_matrix(geom.x[0], geom.y[0], p) / ref_res.eps
    if geom.u is not None:
        logits = logits - geom.u[0][:, None] / ref_res.eps
    assert_argmax(res.plan_argmax(), logits, 1e-9)
    assert min(_force_sparse) < 0.95  # at the target eps block pairs were dropped


@pytest.mark.parametrize("case", ["far_apart", "duplicates", "unequal_density", "one_cell"])
def test_hard_case_solves(case, _force_sparse):
    """KL-unbalanced p = 2 solves on the hard geometries, and a blur larger than the data."""
    g = _gen(30 + HARD.index(case))
    x, y, _ = _hard(case, g)
    a = torch.full((x.shape[0],), 1.0 / x.shape[0], dtype=DT)
    b = torch.full((y.shape[0],), 1.0 / y.shape[0], dtype=DT)
    for blur in (0.03, 50.0):
        out = {}
        for be in ("cpu", "blocksparse"):
            xx, yy = x.clone().requires_grad_(), y.clone().requires_grad_()
            res = sinkhorn(xx, yy, a, b, p=2, eps=blur**2, penalty="kl", tau=1.0, tol=1e-300, max_iter=20, backend=be)
            out[be] = (res, torch.autograd.grad(res.value, (xx, yy)))
        (r0, g0), (r1, g1) = out["cpu"], out["blocksparse"]
        for name in ("value", "f", "g"):
            torch.testing.assert_close(getattr(r1, name).detach(), getattr(r0, name).detach(), **TOL, msg=name)
        for got, want in zip(g1, g0):
            torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("p", [1, 2])
def test_srotloss_soft_on_blocksparse(p):
    """SROTLoss with soft offsets (gamma = max C from blocksparse.max_cost) equals the dense backend."""
    x0, y0, a0, b0, s_x, s_y = _cloud(40 + p, 900, 800)
    out = {}
    for be in ("cpu", "blocksparse"):
        x, y = x0.clone().requires_grad_(), y0.clone().requires_grad_()
        loss = SROTLoss(p=p, blur=0.04, reach=1.0, strategy="soft", backend=be, tol=1e-300, max_iter=25,
                        debias=False)
        value = loss(a0, x, b0, y, scores=(s_x, s_y))
        out[be] = (value.detach(), torch.autograd.grad(value, (x, y)))
    torch.testing.assert_close(out["blocksparse"][0], out["cpu"][0], **TOL)
    for got, want in zip(out["blocksparse"][1], out["cpu"][1]):
        torch.testing.assert_close(got, want, **TOL)


def test_a_threshold_that_is_no_number_is_named(monkeypatch):
    """SROT_BLOCKSPARSE_THRESHOLD=abc made the import of this module raise "could not convert string to float",
    and with it every solve on every backend. Now it reads as NaN: this backend's passes raise a ValueError
    naming the variable and its value, the other backends run."""
    monkeypatch.setenv("SROT_BLOCKSPARSE_THRESHOLD", "abc")
    monkeypatch.setattr(bs, "THRESHOLD", bs._threshold_from_env())
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(700, 2, generator=gen, dtype=torch.float64)
    y = torch.rand(600, 2, generator=gen, dtype=torch.float64)
    assert sinkhorn(x, y, p=2, eps=0.01, backend="cpu").converged
    with pytest.raises(ValueError, match="SROT_BLOCKSPARSE_THRESHOLD.*'abc'"):
        sinkhorn(x, y, p=2, eps=0.01, backend="blocksparse")
