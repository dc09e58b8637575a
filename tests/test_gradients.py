"""Gradients of the loss value (envelope theorem, docs/DESIGN.md, Gradients) against finite differences, float64.

The value is a Sinkhorn fixed point solved to a relative marginal error of 1e-13, so the finite
differences of ``torch.autograd.gradcheck`` (step 1e-6) carry ~1e-7 of solver noise: gradcheck's
default tolerances (atol 1e-5, rtol 1e-3) are far above it, and far below a wrong gradient.
The configuration grid uses gradcheck's ``fast_mode`` (random projections u^T J v: one finite
difference per input instead of one per entry; it still fails on a 1e-3 error in a single entry of
the weight gradient, checked by mutation while writing these tests); two configurations are also
checked entry by entry.
GeomLoss is not used as a gradient reference (its unbalanced point gradients are off, see docs/DESIGN.md, Gradients).
"""
import math

import pytest
import torch
from reference import cost_np, random_problem, torch_threads

from srot_fast import SROTLoss, sinkhorn

TOL = 1e-13
# every solve here must reach its tolerance: a ConvergenceWarning fails the test
pytestmark = pytest.mark.filterwarnings("error::srot_fast.ConvergenceWarning")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with torch_threads(1):
        yield


SOLVE = dict(tol=TOL, max_iter=200_000)

# (name, SROTLoss keyword arguments) for p = 2; blur is in data units (eps = blur**p).
CONFIGS = {
    "balanced": dict(),
    "kl": dict(reach=0.7),
    "kl_semi": dict(reach=(0.7, math.inf)),
    "tv": dict(reach=0.5, penalty="tv"),
    "partial": dict(mass=0.6),
    "balanced_debias": dict(debias=True),
    "kl_debias": dict(reach=0.7, debias=True),
    "kl_pair_debias": dict(reach=(0.5, 1.5), debias=True),
}


def _inputs(n=6, m=5, seed=3):
    x, y, a, b = random_problem(n, m, seed=seed, shift=0.2)
    # weights as unnormalised positive numbers; balanced configs normalise them (so the masses stay equal)
    return [t.clone().requires_grad_(True) for t in (x, y, a * n, b * m)]


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_gradcheck_loss_points_and_weights(name, p):
    kw = CONFIGS[name]
    loss = SROTLoss(p=p, blur=0.3, backend="tensorized", **{"debias": False, **kw}, **SOLVE)
    # balanced: a, b must keep equal masses, so normalise them (the gradient is then defined up to a
    # constant, which the normalisation projects out). Partial and unbalanced: raw weights, so the
    # constant part of d/da (e.g. the dummy mass |a| - s of partial OT) is checked too.
    normalise = "reach" not in kw and "mass" not in kw

    def value(x, y, wa, wb):
        a = wa / wa.sum() if normalise else wa / 6
        b = wb / wb.sum() if normalise else wb / 5
        return loss(a, x, b, y)

    assert torch.autograd.gradcheck(value, _inputs(), eps=1e-6, atol=1e-5, rtol=1e-3, fast_mode=True)


@pytest.mark.parametrize("name,p", [("kl", 1), ("partial", 2)])
def test_gradcheck_loss_full_jacobian(name, p):
    """Entry-by-entry gradcheck (no random projection) on two configurations."""
    kw = CONFIGS[name]
    loss = SROTLoss(p=p, blur=0.3, backend="tensorized", **{"debias": False, **kw}, **SOLVE)
    normalise = "reach" not in kw and "mass" not in kw

    def value(x, y, wa, wb):
        a = wa / wa.sum() if normalise else wa / 6
        b = wb / wb.sum() if normalise else wb / 5
        return loss(a, x, b, y)

    assert torch.autograd.gradcheck(value, _inputs(), eps=1e-6, atol=1e-5, rtol=1e-3)


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("penalty,extra", [("balanced", {}), ("kl", {"tau": (0.5, 0.8)}),
                                           ("tv", {"tau": 0.4}), ("balanced", {"mass": 0.7})])
def test_gradcheck_sinkhorn_with_offsets(penalty, extra, p):
    """Soft-SROT offsets u, v: d value / d u = pi 1, d value / d v = pi^T 1 (and points still right)."""
    x, y, a, b = random_problem(6, 5, seed=4, shift=0.2)
    gen = torch.Generator().manual_seed(1)
    u = (0.3 * torch.rand(6, generator=gen, dtype=torch.float64)).requires_grad_(True)
    v = (0.3 * torch.rand(5, generator=gen, dtype=torch.float64)).requires_grad_(True)
    x.requires_grad_(True)

    def value(x, u, v):
        return sinkhorn(x, y, a, b, p=p, eps=0.3**p, penalty=penalty, u=u, v=v, **extra, **SOLVE).value

    assert torch.autograd.gradcheck(value, (x, u, v), eps=1e-6, atol=1e-5, rtol=1e-3, fast_mode=True)


@pytest.mark.parametrize("extra", [{}, {"penalty": "kl", "tau": 0.6}, {"mass": 0.7}])
def test_each_input_alone_gets_its_gradient(extra):
    """The solve keeps only what the backward of the inputs that require grad reads: differentiating in one
    input at a time (x, y, a, b, u or v) gives that input's part of the gradient in all six at once."""
    x, y, a, b = random_problem(6, 5, seed=5, shift=0.2)
    gen = torch.Generator().manual_seed(2)
    u, v = (0.3 * torch.rand(k, generator=gen, dtype=torch.float64) for k in (6, 5))
    inputs = (x, y, a, b, u, v)

    def grads(which):
        ts = [t.clone().requires_grad_(k in which) for k, t in enumerate(inputs)]
        value = sinkhorn(*ts[:4], p=2, eps=0.09, u=ts[4], v=ts[5], **extra, **SOLVE).value
        return torch.autograd.grad(value, [ts[k] for k in which])

    every = grads(range(6))
    for k in range(6):
        assert every[k].abs().max() > 1e-4
        torch.testing.assert_close(grads([k])[0], every[k], rtol=0, atol=1e-12)


def test_gradcheck_hard_strategy_weights():
    """Hard SROT: the gradient flows through the renormalisation of the kept weights."""
    x, y, wa, wb = _inputs()
    s_x = torch.tensor([0.1, 0.9, 0.2, 0.3, 0.1, 0.4], dtype=torch.float64)  # x_1 flagged
    s_y = torch.tensor([0.9, 0.8, 0.3, 0.7, 0.6], dtype=torch.float64)       # y_2 flagged
    loss = SROTLoss(p=2, blur=0.3, strategy="hard", **SOLVE, debias=False)

    def value(x, y, wa, wb):
        return loss(wa / wa.sum(), x, wb / wb.sum(), y, scores=(s_x, s_y))

    assert torch.autograd.gradcheck(value, (x, y, wa, wb), eps=1e-6, atol=1e-5, rtol=1e-3, fast_mode=True)


@pytest.mark.parametrize("reach", [None, 1.0])
def test_p1_gradient_at_coincident_points(reach):
    """x_0 == y_0 with p = 1: the cost has a kink there. The gradient must be finite and equal to the
    centre of the subdifferential, i.e. the central finite difference; the one-sided difference
    exceeds it by pi_00 * |direction| (the plan mass sitting on the kink)."""
    x, y, a, b = random_problem(7, 6, seed=5)
    x[0] = y[0]
    x.requires_grad_(True)
    penalty = dict(penalty="balanced") if reach is None else dict(penalty="kl", tau=reach)
    res = sinkhorn(x, y, a, b, p=1, eps=0.05, **penalty, **SOLVE)
    (grad,) = torch.autograd.grad(res.value, x)
    assert torch.isfinite(grad).all()
    assert grad.abs().max() < 10.0
    pi00 = float(res.plan()[0, 0])
    assert pi00 > 1e-3  # the kink carries mass, so the checks below are not vacuous

    def val(xx):
        return float(sinkhorn(xx, y, a, b, p=1, eps=0.05, **penalty, **SOLVE).value)

    h = 1e-6
    for k in range(2):
        e = torch.zeros_like(x)
        e[0, k] = h
        xd = x.detach()
        plus, minus, mid = val(xd + e), val(xd - e), val(xd)
        central = (plus - minus) / (2 * h)
        forward = (plus - mid) / h
        assert central == pytest.approx(float(grad[0, k]), abs=1e-6)
        assert forward - float(grad[0, k]) == pytest.approx(pi00, rel=1e-3, abs=1e-6)


def test_upstream_gradient_is_propagated():
    """d(3.7 * loss) = 3.7 * d(loss) for points and weights, on both sides."""
    x, y, wa, wb = _inputs()
    loss = SROTLoss(p=2, blur=0.3, reach=0.8, **SOLVE, debias=False)
    g1 = torch.autograd.grad(loss(wa, x, wb, y), (x, y, wa, wb))
    g2 = torch.autograd.grad(3.7 * loss(wa, x, wb, y), (x, y, wa, wb))
    for t1, t2 in zip(g1, g2):
        assert t1.abs().max() > 1e-3
        torch.testing.assert_close(t2, 3.7 * t1, rtol=1e-12, atol=0)


def test_batched_gradient_matches_loop():
    """(B, N, D) input: the gradient of sum_b loss_b equals the per-item gradients."""
    xs, ys = [], []
    for k in range(3):
        x, y, _, _ = random_problem(6, 5, seed=10 + k)
        xs.append(x)
        ys.append(y)
    X = torch.stack(xs).requires_grad_(True)
    Y = torch.stack(ys)
    # value_tol=None: solved to the marginal tolerance (the gradient's error is first order in it)
    loss = SROTLoss(p=1, blur=0.2, reach=1.0, **SOLVE, debias=False, value_tol=None)
    (gX,) = torch.autograd.grad(loss(X, Y).sum(), X)
    for k in range(3):
        xk = xs[k].clone().requires_grad_(True)
        (gk,) = torch.autograd.grad(loss(xk, ys[k]), xk)
        torch.testing.assert_close(gX[k], gk, rtol=0, atol=1e-12)


def test_p2_point_gradient_is_plan_weighted_displacement():
    """Closed form for p = 2: d value / d x_i = sum_j pi_ij (x_i - y_j), from the dense plan."""
    x, y, a, b = random_problem(8, 7, seed=6, mass_b=1.2)
    x.requires_grad_(True)
    res = sinkhorn(x, y, a, b, p=2, eps=0.05, penalty="kl", tau=0.6, **SOLVE)
    (grad,) = torch.autograd.grad(res.value, x)
    C = torch.from_numpy(cost_np(x, y, 2))
    plan = a[:, None] * b[None, :] * torch.exp((res.f[:, None] + res.g[None, :] - C) / 0.05)
    expected = plan.sum(1)[:, None] * x.detach() - plan @ y
    torch.testing.assert_close(grad, expected, rtol=0, atol=1e-12)


def test_point_gradient_stays_bounded_with_a_fixed_iteration_budget():
    """Unconverged solve (GeomLoss-style fixed budget, 3 updates): for balanced OT, p = 2, the x-gradient is
    a_i (x_i - bary_i) exactly -- the row weights come from the exact f-update for the final g, not from an
    unconverged f (which made a_i exp((f_i - f_hat_i) / eps) explode in a 100k-point flow)."""
    import warnings

    g = torch.Generator().manual_seed(0)
    x = 0.3 * torch.randn(200, 2, generator=g, dtype=torch.float64)
    theta = 6.2832 * torch.rand(150, generator=g, dtype=torch.float64)
    y = torch.stack([theta.cos(), theta.sin()], 1)
    xg = x.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = sinkhorn(xg, y, p=2, eps=0.05**2, tol=1e-30, max_iter=3, backend="tensorized")
    assert res.marginal_error > 1e-2  # really unconverged
    (gx,) = torch.autograd.grad(res.value, xg)
    a = torch.full((200, 1), 1 / 200, dtype=torch.float64)
    torch.testing.assert_close(gx, a * (x - res.barycentric_projection()), atol=1e-12, rtol=1e-10)
