"""``srot_fast.sinkhorn`` against POT (plans, potentials), duality, fixed points and partial OT.

All comparisons in float64 on small random problems with n != m and non-uniform weights. srot runs
to a relative marginal error of 1e-12 and POT to stopThr 1e-15; both then agree to ~1e-12 on plans
and potentials (measured), so the tolerances below (1e-8 unless said) leave four orders of margin
while any modelling error (wrong reference measure, wrong damping, wrong sign) shows up at >= 1e-4.
"""
import math

import numpy as np
import ot
import pytest
import torch
from reference import cost_np, kl_div, pot_sinkhorn, pot_unbalanced, primal_objective, random_problem, torch_threads

from srot_fast import sinkhorn
from srot_fast.partners import exact_ot, exact_partial

# every solve here must reach its tolerance: a ConvergenceWarning fails the test
pytestmark = pytest.mark.filterwarnings("error::srot_fast.ConvergenceWarning")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with torch_threads(1):
        yield


SOLVE = dict(tol=1e-12, max_iter=100_000)
EPS = {1: 0.1, 2: 0.05}  # cost units; costs are O(1) on these data, so POT's exp(-M/reg) is safe
TAUS = [(1.0, 0.5), (0.3, 2.0), (1.0, math.inf), (math.inf, 0.7)]  # KL, KL, semi-unbalanced x2


def _plan(a, b, f, g, C, eps):
    return a[:, None] * b[None, :] * torch.exp((f[:, None] + g[None, :] - C) / eps)


def _close(actual, expected, atol):
    torch.testing.assert_close(torch.as_tensor(actual), torch.as_tensor(expected), rtol=0, atol=atol)


@pytest.mark.parametrize("p", [1, 2])
def test_reference_potential_convention(p):
    """The adapters' potential conventions rebuild POT's own plans (the mapping used everywhere below)."""
    x, y, a, b = random_problem(12, 9, seed=1, mass_b=1.3)
    C = torch.from_numpy(cost_np(x, y, p))
    plan, f, g = pot_unbalanced(a, b, C, EPS[p], (0.8, 0.6))
    _close(_plan(a, b, f, g, C, EPS[p]), plan, 1e-14)
    b1 = b / b.sum()
    plan, f, g = pot_sinkhorn(a, b1, C, EPS[p])
    _close(_plan(a, b1, f, g, C, EPS[p]), plan, 1e-14)


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("tau", TAUS, ids=lambda t: f"tau{t[0]}-{t[1]}")
def test_kl_unbalanced_matches_pot(tau, p):
    x, y, a, b = random_problem(30, 23, seed=2, mass_b=1.3)
    eps = EPS[p]
    res = sinkhorn(x, y, a, b, p=p, eps=eps, penalty="kl", tau=tau, **SOLVE)
    plan, f, g = pot_unbalanced(a, b, cost_np(x, y, p), eps, tau)
    assert res.marginal_error <= 1e-12
    _close(res.plan(), plan, 1e-8)
    _close(res.f, f, 1e-8)  # unbalanced (one side at least): potentials are unique
    _close(res.g, g, 1e-8)
    _close(res.row_mass, plan.sum(1), 1e-8)
    _close(res.col_mass, plan.sum(0), 1e-8)
    # the value is the primal objective at the optimum (strong duality)
    C = torch.from_numpy(cost_np(x, y, p))
    _close(res.value.detach(), primal_objective(plan, C, a, b, eps, "kl", tau), 1e-8)


@pytest.mark.parametrize("p", [1, 2])
def test_balanced_matches_pot(p):
    x, y, a, b = random_problem(30, 23, seed=3)
    eps = EPS[p]
    res = sinkhorn(x, y, a, b, p=p, eps=eps, **SOLVE)
    plan, f, g = pot_sinkhorn(a, b, cost_np(x, y, p), eps)
    _close(res.plan(), plan, 1e-8)
    # balanced potentials are unique up to (f + c, g - c): remove the constant, then compare
    c = (res.f - f).mean()
    _close(res.f - c, f, 1e-8)
    _close(res.g + c, g, 1e-8)
    _close(res.row_mass, a, 1e-10)
    _close(res.col_mass, b, 1e-10)
    # value = <C, pi> + eps KL(pi | a x b)
    C = torch.from_numpy(cost_np(x, y, p))
    _close(res.value.detach(), (C * plan).sum() + eps * kl_div(plan, a[:, None] * b[None, :]), 1e-8)


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("tau", [(0.5, 0.8), (0.5, math.inf), 0.25, 3.0], ids=str)
def test_tv_zero_duality_gap(tau, p):
    """TV (partial-like) penalty: primal objective of result.plan() == dual value, to 1e-8.
    Three far source points make the TV clamps active (f_i = tau_a) for small tau."""
    x, y, a, b = random_problem(30, 23, seed=4, mass_b=1.3)
    x[:3] += 3.0
    eps = EPS[p]
    res = sinkhorn(x, y, a, b, p=p, eps=eps, penalty="tv", tau=tau, **SOLVE)
    C = torch.from_numpy(cost_np(x, y, p))
    primal = primal_objective(res.plan(), C, a, b, eps, "tv", tau)
    assert abs(float(primal) - float(res.value)) <= 1e-8
    tau_a = tau[0] if isinstance(tau, tuple) else tau
    assert (res.f.abs() <= tau_a + 1e-12).all()
    if tau_a <= 0.5:  # the far points sit on the clamp: they would cost more than tau_a to move
        assert torch.allclose(res.f[:3], torch.full((3,), tau_a, dtype=res.f.dtype), atol=1e-12)


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("penalty,tau", [("balanced", None), ("kl", (0.7, 1.5)), ("kl", (math.inf, 0.5)),
                                         ("tv", (0.2, 0.6))])
def test_fixed_point_equations(penalty, tau, p):
    """f = A_a(-eps LSE_j[log b_j + (g_j - C_ij)/eps]) and the same for g, on a dense cost."""
    x, y, a, b = random_problem(25, 18, seed=5, mass_b=1.0 if penalty == "balanced" else 0.8)
    eps = EPS[p]
    res = sinkhorn(x, y, a, b, p=p, eps=eps, penalty=penalty, tau=tau, **SOLVE)
    C = torch.from_numpy(cost_np(x, y, p))
    s = -eps * torch.logsumexp(torch.log(b)[None, :] + (res.g[None, :] - C) / eps, dim=1)
    t = -eps * torch.logsumexp(torch.log(a)[:, None] + (res.f[:, None] - C) / eps, dim=0)

    def aprox(v, tau_side):
        if penalty == "balanced" or math.isinf(tau_side):
            return v
        if penalty == "kl":
            return tau_side / (tau_side + eps) * v
        return v.clamp(-tau_side, tau_side)

    tau_a, tau_b = tau if tau is not None else (math.inf, math.inf)
    _close(res.f, aprox(s, tau_a), 1e-9)
    _close(res.g, aprox(t, tau_b), 1e-9)


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("tau", [(1.0, 0.5), (0.3, 2.0)], ids=str)
def test_soft_offsets_are_kl_target_reweighting(tau, p):
    r"""docs/DESIGN.md, Problem: with KL penalties, the cost C + u + v with targets a, b and reference a x b equals
    UOT with cost C, targets a~ = a e^{-u/tau_a}, b~ = b e^{-v/tau_b}, reference still a x b.

    Derivation: <u, pi 1> + tau_a KL(pi 1 | a) = tau_a KL(pi 1 | a~) + tau_a (|a| - |a~|). POT ties the
    reference to the targets, so pass c = a x b explicitly; equivalently
    eps KL(pi | a x b) = eps KL(pi | a~ x b~) - eps <pi, u/tau_a + v/tau_b> + const, i.e. POT with the
    default reference a~ x b~ and cost C - eps u / tau_a - eps v / tau_b. Same plan for all three.
    """
    x, y, a, b = random_problem(30, 23, seed=6, mass_b=1.3)
    gen = torch.Generator().manual_seed(7)
    u = 0.5 * torch.rand(30, generator=gen, dtype=torch.float64)
    v = 0.5 * torch.rand(23, generator=gen, dtype=torch.float64)
    eps, (ta, tb) = EPS[p], tau
    C = torch.from_numpy(cost_np(x, y, p))
    at, bt = a * torch.exp(-u / ta), b * torch.exp(-v / tb)

    res = sinkhorn(x, y, a, b, p=p, eps=eps, penalty="kl", tau=tau, u=u, v=v, **SOLVE)
    plan_c, _, _ = pot_unbalanced(at, bt, C, eps, tau, c=a[:, None] * b[None, :])
    plan_m, _, _ = pot_unbalanced(at, bt, C - eps * u[:, None] / ta - eps * v[None, :] / tb, eps, tau)
    _close(res.plan(), plan_c, 1e-8)
    _close(res.plan(), plan_m, 1e-8)

    # the same statement inside srot: targets a~, b~ with offsets -eps u/tau_a, -eps v/tau_b
    res2 = sinkhorn(x, y, at, bt, p=p, eps=eps, penalty="kl", tau=tau, u=-eps * u / ta, v=-eps * v / tb,
                    **SOLVE)
    _close(res2.plan(), res.plan(), 1e-8)
    const = (ta * (a.sum() - at.sum()) + tb * (b.sum() - bt.sum())
             + eps * (a.sum() * b.sum() - at.sum() * bt.sum()))
    _close(res.value.detach(), res2.value.detach() + const, 1e-8)

    # value = primal objective with the offset cost (duality with offsets)
    primal = primal_objective(plan_c, C + u[:, None] + v[None, :], a, b, eps, "kl", tau)
    _close(res.value.detach(), primal, 1e-8)

    # the check discriminates: POT's default reference a~ x b~ with cost C is a different problem
    plan_naive, _, _ = pot_unbalanced(at, bt, C, eps, tau)
    assert (res.plan() - plan_naive).abs().max() > 1e-5


@pytest.mark.parametrize("p", [1, 2])
def test_offsets_do_not_change_balanced_plan(p):
    """Balanced: separable offsets shift the value by <a, u> + <b, v> and leave the plan unchanged."""
    x, y, a, b = random_problem(20, 15, seed=8)
    gen = torch.Generator().manual_seed(9)
    u = torch.rand(20, generator=gen, dtype=torch.float64)
    v = torch.rand(15, generator=gen, dtype=torch.float64)
    res0 = sinkhorn(x, y, a, b, p=p, eps=EPS[p], **SOLVE)
    res1 = sinkhorn(x, y, a, b, p=p, eps=EPS[p], u=u, v=v, **SOLVE)
    _close(res1.plan(), res0.plan(), 1e-10)
    _close(res1.value.detach(), res0.value.detach() + (a * u).sum() + (b * v).sum(), 1e-10)


def _augmented(a, b, C, s, u=None, v=None):
    """Partial OT as balanced OT with one dummy point per side (Chapel et al. 2020): dense version."""
    n, m = C.shape
    M = np.zeros((n + 1, m + 1))
    M[:n, :m] = C + (0 if u is None else u[:, None].numpy()) + (0 if v is None else v[None, :].numpy())
    M[n, m] = 1e6  # dummy <-> dummy forbidden (exp(-1e6/eps) == 0)
    aa = np.concatenate([a.numpy(), [b.sum().item() - s]])
    bb = np.concatenate([b.numpy(), [a.sum().item() - s]])
    return aa, bb, M


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("offsets", [False, True])
def test_partial_matches_pot_on_augmented_problem(offsets, p):
    """Entropic partial OT (mass=s) == POT's balanced Sinkhorn on the dense augmented problem.
    (In balanced OT the entropic reference only adds a constant, so ot.sinkhorn's plain entropy is fine.)
    Offsets apply to real pairs only: not transporting a point is free."""
    x, y, a, b = random_problem(20, 15, seed=10, mass_b=1.2)
    s, eps = 0.7, EPS[p]
    gen = torch.Generator().manual_seed(11)
    u = 0.5 * torch.rand(20, generator=gen, dtype=torch.float64) if offsets else None
    v = 0.5 * torch.rand(15, generator=gen, dtype=torch.float64) if offsets else None
    res = sinkhorn(x, y, a, b, p=p, eps=eps, mass=s, u=u, v=v, **SOLVE)
    aa, bb, M = _augmented(a, b, cost_np(x, y, p), s, u, v)
    plan = torch.from_numpy(ot.sinkhorn(aa, bb, M, reg=eps, numItermax=100_000, stopThr=1e-15, warn=False))
    _close(res.plan(), plan[:-1, :-1], 1e-8)
    assert abs(res.transported_mass - s) <= 1e-8
    _close(res.row_mass, plan[:-1, :-1].sum(1), 1e-8)


@pytest.mark.parametrize("p,eps", [(1, 1e-2), (2, 3e-3)])
@pytest.mark.parametrize("s", [0.5, 0.9])
def test_partial_small_eps_vs_exact_partial(s, p, eps):
    """sinkhorn(mass=s) at small eps vs exact partial OT (POT): the plan moves exactly s, respects
    a and b, and exact <= <C, pi_eps> <= value <= exact + eps KL(pi_exact_aug | aa x bb), the
    entropic bracket (pi_exact_aug: exact plan plus its dummy row/column, a feasible plan)."""
    x, y, a, b = random_problem(20, 16, seed=12, mass_b=1.3)
    res = sinkhorn(x, y, a, b, p=p, eps=eps, mass=s, **SOLVE)
    exact, plan0 = exact_partial(x, y, a, b, mass=s, p=p)
    C = torch.from_numpy(cost_np(x, y, p))
    plan = res.plan()
    assert abs(float(plan.sum()) - s) <= 1e-6
    assert (plan.sum(1) <= a + 1e-10).all() and (plan.sum(0) <= b + 1e-10).all()
    assert abs(float(plan0.sum()) - s) <= 1e-9
    assert exact == pytest.approx(float((C * plan0).sum()), abs=1e-12)

    aug = torch.zeros(21, 17, dtype=torch.float64)
    aug[:-1, :-1] = plan0
    aug[:-1, -1] = a - plan0.sum(1)
    aug[-1, :-1] = b - plan0.sum(0)
    aa = torch.cat([a, (b.sum() - s).reshape(1)])
    bb = torch.cat([b, (a.sum() - s).reshape(1)])
    bound = eps * float(kl_div(aug.clamp_min(0), aa[:, None] * bb[None, :]))
    linear = float((C * plan).sum())
    value = float(res.value)
    assert exact - 1e-9 <= linear <= value + 1e-9
    assert value <= exact + bound + 1e-9
    assert value - exact <= 10 * eps * math.log(20 * 16)  # the bracket is not vacuous


@pytest.mark.parametrize("p", [1, 2])
def test_exact_ot_matches_emd2(p):
    x, y, a, b = random_problem(25, 19, seed=13)
    value, plan = exact_ot(x, y, a, b, p=p)
    M = cost_np(x, y, p)
    assert value == pytest.approx(ot.emd2(a.numpy(), b.numpy(), M), abs=1e-12)
    _close(plan.sum(1), a, 1e-12)
    _close(plan.sum(0), b, 1e-12)
    # full mass: exact partial with s = 1 is exact OT
    value_p, _ = exact_partial(x, y, a, b, mass=1.0, p=p)
    assert value_p == pytest.approx(value, abs=1e-9)
    # entropic bracket: exact <= <C, pi_eps> <= OT_eps <= exact + eps KL(pi_exact | a x b)
    #                                                   <= exact + eps log(min(n, m))
    eps = 1e-2
    res = sinkhorn(x, y, a, b, p=p, eps=eps, **SOLVE)
    linear = float((torch.from_numpy(M) * res.plan()).sum())
    assert value - 1e-9 <= linear <= float(res.value) + 1e-9
    assert float(res.value) <= value + eps * float(kl_div(plan, a[:, None] * b[None, :])) + 1e-9
    assert float(res.value) <= value + eps * math.log(19)


def test_result_independent_of_schedule():
    """scaling and diameter only change the path, not the fixed point."""
    x, y, a, b = random_problem(20, 15, seed=14, mass_b=0.9)
    kw = dict(p=2, eps=0.05, penalty="kl", tau=0.7, **SOLVE)
    r1 = sinkhorn(x, y, a, b, scaling=0.5, **kw)
    r2 = sinkhorn(x, y, a, b, scaling=0.9, diameter=10.0, **kw)
    _close(r1.f, r2.f, 1e-9)
    _close(r1.value.detach(), r2.value.detach(), 1e-10)


@pytest.mark.parametrize("penalty,tau", [("balanced", None), ("kl", 0.5)])
def test_result_accessors_match_dense_plan(penalty, tau):
    """row_mass, col_mass, transported_mass, marginal_error and barycentric_projection vs the plan."""
    x, y, a, b = random_problem(20, 15, seed=15)
    gen = torch.Generator().manual_seed(16)
    v = 0.3 * torch.rand(15, generator=gen, dtype=torch.float64)
    res = sinkhorn(x, y, a, b, p=2, eps=0.05, penalty=penalty, tau=tau, v=v, tol=1e-3)
    C = torch.from_numpy(cost_np(x, y, 2)) + v[None, :]
    plan = _plan(a, b, res.f, res.g, C, 0.05)
    _close(res.plan(), plan, 1e-14)
    _close(res.row_mass, plan.sum(1), 1e-12)
    _close(res.col_mass, plan.sum(0), 1e-12)
    assert res.transported_mass == pytest.approx(float(plan.sum()), abs=1e-12)
    _close(res.barycentric_projection(), (plan @ y) / plan.sum(1, keepdim=True), 1e-12)
    if penalty == "balanced":  # loose tol: the reported error is the true |pi 1 - a|_1 / |a| + |pi^T 1 - b|_1 / |b|
        assert 0 < res.marginal_error <= 1e-3
        gap = (plan.sum(1) - a).abs().sum() / a.sum() + (plan.sum(0) - b).abs().sum() / b.sum()
        assert res.marginal_error == pytest.approx(float(gap), rel=1e-6)
    assert res.n_iter >= 1 and res.p == 2 and res.eps == 0.05 and res.backend in ("cpu", "tensorized")  # 'auto'


def test_float32_close_to_float64():
    x, y, a, b = random_problem(20, 15, seed=17, mass_b=1.2)
    kw = dict(p=1, eps=0.1, penalty="kl", tau=1.0, tol=1e-6)
    r64 = sinkhorn(x, y, a, b, **kw)
    r32 = sinkhorn(x.float(), y.float(), a.float(), b.float(), **kw)
    assert r32.f.dtype == torch.float32 and r32.value.dtype == torch.float32
    _close(r32.f.double(), r64.f, 1e-4)
    assert float(r32.value) == pytest.approx(float(r64.value), rel=1e-4)


def test_zero_weights_equal_dropped_points():
    """A point with zero weight neither carries nor receives mass: same as removing it."""
    x, y, a, b = random_problem(20, 15, seed=18)
    a = a.clone()
    a[[2, 7]] = 0.0
    a = a / a.sum()
    keep = a > 0
    kw = dict(p=2, eps=0.05, penalty="kl", tau=0.8, **SOLVE)
    r_all = sinkhorn(x, y, a, b, **kw)
    r_kept = sinkhorn(x[keep], y, a[keep], b, **kw)
    _close(r_all.value.detach(), r_kept.value.detach(), 1e-10)
    _close(r_all.plan()[keep], r_kept.plan(), 1e-10)
    assert float(r_all.row_mass[~keep].abs().max()) == 0.0


# ------------------------------------------------------------------ runtime options of the Triton backend
def _spy_launchers(monkeypatch) -> list:
    """Record (launcher, precision, autotune) of every Triton launcher call; the launchers still run."""
    from srot_fast.kernels.triton import launchers

    seen = []

    def spy_on(name):
        real = getattr(launchers, name)

        def spy(*args, **kw):
            seen.append((name, kw.get("precision"), kw.get("autotune")))
            return real(*args, **kw)
        return spy
    for name in ("softmin_fwd", "weighted_mean_fwd", "plan_argmax_fwd", "max_sq_fwd"):
        monkeypatch.setattr(launchers, name, spy_on(name))
    return seen


@pytest.mark.triton
@pytest.mark.parametrize("precision", ["ieee", "tf32x3"])
def test_precision_argument_reaches_the_triton_launchers(precision, monkeypatch):
    """``sinkhorn(..., precision=)`` reaches every launcher behind the solve, the gradient and the result's
    accessors (D = 32 float32 points: the large-d tl.dot path, where the precision acts), and the solve
    agrees with the float64 tensorized reference: potentials to 1e-4 of the largest cost, value to 1e-5
    relative, x's gradient to 1e-4 (the interpreter computes tl.dot in float32 whatever the precision, so
    this checks the plumbing; tests/test_gpu.py checks the precisions' numbers on a GPU)."""
    pytest.importorskip("triton")
    monkeypatch.delenv("SROT_TRITON_DOT_PRECISION", raising=False)
    seen = _spy_launchers(monkeypatch)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(20, 32, generator=g), torch.randn(16, 32, generator=g) + 0.3
    scale = float(cost_np(x, y, 2).max())
    kw = dict(p=2, eps=0.1 * scale, penalty="kl", tau=scale, tol=1e-6)
    xd = x.double().requires_grad_()
    ref = sinkhorn(xd, y.double(), backend="tensorized", **kw)
    ref.value.backward()
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # CPU tensors only under the interpreter
    xf = x.to(dev).requires_grad_()
    res = sinkhorn(xf, y.to(dev), backend="triton", precision=precision, autotune=False, **kw)
    res.value.backward()
    _close(res.f.double().cpu(), ref.f.detach(), 1e-4 * scale)
    _close(res.g.double().cpu(), ref.g.detach(), 1e-4 * scale)
    torch.testing.assert_close(res.value.double().cpu(), ref.value.detach(), rtol=1e-5, atol=0)
    torch.testing.assert_close(xf.grad.double().cpu(), xd.grad, rtol=1e-4, atol=1e-4 * scale ** 0.5)
    res.barycentric_projection()
    res.plan_argmax()
    used = {name for name, _, _ in seen}
    assert {"softmin_fwd", "weighted_mean_fwd", "plan_argmax_fwd"} <= used, used
    assert all(prec == precision for _, prec, _ in seen), seen
    assert all(tune is False for name, _, tune in seen if name in ("softmin_fwd", "weighted_mean_fwd")), seen


def test_runtime_options_are_checked_on_every_backend():
    """A bad precision or autotune is refused, naming the argument, whatever the backend (the other backends
    compute in the input dtype and ignore a valid value)."""
    x, y = torch.randn(6, 2, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    for backend in ("tensorized", "cpu"):
        with pytest.raises(ValueError, match="precision must be one of"):
            sinkhorn(x, y, eps=0.5, backend=backend, precision="TF32")
        with pytest.raises(TypeError, match="autotune must be None, True or False"):
            sinkhorn(x, y, eps=0.5, backend=backend, autotune=1)
    ref = sinkhorn(x, y, eps=0.5, backend="tensorized")
    res = sinkhorn(x, y, eps=0.5, backend="tensorized", precision="tf32", autotune=False)
    assert float(res.value) == float(ref.value)
