"""Exact robust-OT partners (ROBOT, OT_TV) against brute-force LPs and entropic TV Sinkhorn, and the GAN
critic losses (ROT critic loss, WGAN-GP gradient penalty) by hand."""
import itertools

import numpy as np
import pytest
import torch
from reference import cost_np, kl_div, random_problem, torch_threads
from scipy.optimize import linprog

from srot_fast import sinkhorn
from srot_fast.partners import exact_ot, exact_ot_tv, exact_robot, gradient_penalty, rot_critic_loss


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with torch_threads(1):
        yield


def _lp_robot(a, b, C, lam):
    """Balanced OT with the truncated cost by scipy's HiGHS LP (independent of POT)."""
    n, m = C.shape
    Ct = np.minimum(C, 2 * lam)
    A = np.zeros((n + m, n * m))
    for i in range(n):
        A[i, i * m:(i + 1) * m] = 1
    for j in range(m):
        A[n + j, j::m] = 1
    res = linprog(Ct.ravel(), A_eq=A, b_eq=np.concatenate([a, b]), bounds=(0, None), method="highs")
    assert res.status == 0
    return res.fun


def _lp_ot_tv(a, b, C, lam):
    """min <C, pi> + lam(|pi 1 - a|_1 + |pi^T 1 - b|_1) with slack variables (p+, p-, q+, q-), by HiGHS."""
    n, m = C.shape
    nv = n * m + 2 * n + 2 * m
    c = np.concatenate([C.ravel(), lam * np.ones(2 * n + 2 * m)])
    A = np.zeros((n + m, nv))
    for i in range(n):
        A[i, i * m:(i + 1) * m] = 1
        A[i, n * m + i] = -1  # p+
        A[i, n * m + n + i] = 1  # p-
    for j in range(m):
        A[n + j, j:n * m:m] = 1
        A[n + j, n * m + 2 * n + j] = -1
        A[n + j, n * m + 2 * n + m + j] = 1
    res = linprog(c, A_eq=A, b_eq=np.concatenate([a, b]), bounds=(0, None), method="highs")
    assert res.status == 0
    return res.fun


def _brute_robot_permutations(C, lam):
    """n = m, uniform weights: an optimal plan is a permutation (Birkhoff), so enumerate them."""
    n = C.shape[0]
    Ct = np.minimum(C, 2 * lam)
    return min(Ct[range(n), list(s)].sum() for s in itertools.permutations(range(n))) / n


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("lam", [0.05, 0.2, 0.6])
def test_robot_vs_lp(p, lam):
    x, y, a, b = random_problem(7, 5, seed=3)
    value, plan = exact_robot(x, y, a, b, lam=lam, p=p)
    C = cost_np(x, y, p)
    assert value == pytest.approx(_lp_robot(a.numpy(), b.numpy(), C, lam), abs=1e-10)
    torch.testing.assert_close(plan.sum(1), a, rtol=0, atol=1e-12)
    torch.testing.assert_close(plan.sum(0), b, rtol=0, atol=1e-12)
    assert value == pytest.approx(float((plan.numpy() * np.minimum(C, 2 * lam)).sum()), abs=1e-12)


def test_robot_vs_permutations_and_truncation_matters():
    gen = torch.Generator().manual_seed(4)
    x = torch.rand(6, 2, generator=gen, dtype=torch.float64)
    y = torch.rand(6, 2, generator=gen, dtype=torch.float64)
    y[0] += 5.0  # one far outlier: truncation caps its cost
    C = cost_np(x, y, 1)
    lam = 0.3
    value, _ = exact_robot(x, y, lam=lam, p=1)
    assert value == pytest.approx(_brute_robot_permutations(C, lam), abs=1e-12)
    full, _ = exact_ot(x, y, p=1)
    assert value < full - 0.5  # the outlier's cost (~5/6) is capped to 2 lam / 6


@pytest.mark.parametrize("p", [1, 2])
def test_robot_huge_lam_is_exact_ot(p):
    x, y, a, b = random_problem(9, 11, seed=5)
    v1, plan1 = exact_robot(x, y, a, b, lam=1e6, p=p)
    v0, plan0 = exact_ot(x, y, a, b, p=p)
    assert v1 == pytest.approx(v0, abs=1e-12)
    # small lam: every pair is truncated, value = 2 lam * mass
    v2, _ = exact_robot(x, y, a, b, lam=1e-4, p=p)
    assert v2 == pytest.approx(2e-4, rel=1e-9)


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("lam", [0.05, 0.2, 1.0])
@pytest.mark.parametrize("mass_b", [1.0, 1.4])
def test_ot_tv_vs_lp(p, lam, mass_b):
    x, y, a, b = random_problem(7, 6, seed=6, mass_b=mass_b)
    value, plan = exact_ot_tv(x, y, a, b, lam=lam, p=p)
    C = cost_np(x, y, p)
    assert value == pytest.approx(_lp_ot_tv(a.numpy(), b.numpy(), C, lam), abs=1e-10)
    assert (plan.sum(1) <= a + 1e-12).all() and (plan.sum(0) <= b + 1e-12).all()
    P, A, B = plan.numpy(), a.numpy(), b.numpy()
    recomputed = (P * C).sum() + lam * (np.abs(P.sum(1) - A).sum() + np.abs(P.sum(0) - B).sum())
    assert value == pytest.approx(float(recomputed), abs=1e-12)


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("lam", [0.05, 0.3])
def test_ot_tv_equals_robot_for_equal_masses(p, lam):
    """Mukherjee et al.: with |a| = |b|, OT_TV with penalty lam == OT with the cost min(C, 2 lam)."""
    x, y, a, b = random_problem(10, 8, seed=7)
    assert exact_ot_tv(x, y, a, b, lam=lam, p=p)[0] == pytest.approx(exact_robot(x, y, a, b, lam=lam, p=p)[0],
                                                                     abs=1e-12)
    # and huge lam: balanced OT
    assert exact_ot_tv(x, y, a, b, lam=1e3, p=p)[0] == pytest.approx(exact_ot(x, y, a, b, p=p)[0], abs=1e-10)


@pytest.mark.parametrize("p,eps", [(1, 1e-3), (2, 5e-4)])
@pytest.mark.parametrize("lam", [0.1, 0.4])
def test_ot_tv_vs_entropic_tv_sinkhorn(p, eps, lam):
    """Entropic bracket: exact <= OT_TV^eps <= exact + eps KL(pi_exact | a x b) (pi_exact is feasible
    for the entropic problem, KL >= 0). The gaps are ~eps log(nm); the bracket tolerance adds 1e-7
    for the Sinkhorn stopping tolerance."""
    x, y, a, b = random_problem(15, 12, seed=8, mass_b=1.2)
    exact, plan0 = exact_ot_tv(x, y, a, b, lam=lam, p=p)
    res = sinkhorn(x, y, a, b, p=p, eps=eps, penalty="tv", tau=lam, tol=1e-10, max_iter=200_000)
    value = float(res.value)
    bound = eps * float(kl_div(plan0.clamp_min(0), a[:, None] * b[None, :]))
    assert exact - 1e-7 <= value <= exact + bound + 1e-7
    assert abs(value - exact) <= 0.05 * abs(exact) + 1e-3  # not vacuous: eps is small
    # the entropic plan's marginals also stay (almost) below a and b
    P = res.plan()
    assert (P.sum(1) <= a + 1e-3).all() and (P.sum(0) <= b + 1e-3).all()


def test_partner_argument_errors():
    x, y, a, b = random_problem(5, 4, seed=9, mass_b=1.3)
    with pytest.raises(ValueError, match="lam"):
        exact_robot(x, y, lam=0.0)
    with pytest.raises(ValueError, match="lam"):
        exact_ot_tv(x, y, lam=-1.0)
    with pytest.raises(ValueError, match="equal total mass"):
        exact_robot(x, y, a, b, lam=0.1)
    with pytest.raises(ValueError, match="b must have shape"):
        exact_ot_tv(x, y, a, b[:3], lam=0.1)
    with pytest.raises(ValueError, match="feature dimension"):
        exact_robot(x, y[:, :1], lam=0.1)
    with pytest.raises(ValueError, match="p must be"):
        exact_ot_tv(x, y, lam=0.1, p=3)


def test_rot_critic_loss_by_hand():
    dr = torch.tensor([1.0, 3.0, -2.0, 0.5])
    df = torch.tensor([0.2, -1.0, 4.0])
    delta = 0.25
    want = -(1.0 + 3.0 - 2.0 + 0.5) / 4 + 0.75 * (0.2 - 1.0 + 4.0) / 3 + 0.25 * 3.0
    assert float(rot_critic_loss(dr, df, delta=delta)) == pytest.approx(want, abs=1e-6)
    # (B, 1) critic outputs work the same
    assert float(rot_critic_loss(dr[:, None], df[:, None], delta=delta)) == pytest.approx(want, abs=1e-6)
    # weights are normalised: w = (1, 1, 2, 0) / 4
    w = torch.tensor([1.0, 1.0, 2.0, 0.0])
    want_w = -(1.0 + 3.0 - 4.0) / 4 + 0.75 * 3.2 / 3 + 0.25 * 3.0
    assert float(rot_critic_loss(dr, df, delta=delta, weights_real=w)) == pytest.approx(want_w, abs=1e-6)


def test_rot_delta_zero_is_wgan_loss():
    gen = torch.Generator().manual_seed(0)
    dr, df = torch.randn(16, generator=gen), torch.randn(9, generator=gen)
    assert float(rot_critic_loss(dr, df, delta=0.0)) == pytest.approx(float(-dr.mean() + df.mean()), abs=1e-6)
    assert float(rot_critic_loss(dr, df, delta=0.3)) != pytest.approx(float(-dr.mean() + df.mean()), abs=1e-3)


def test_rot_zero_weight_removes_point_from_mean_and_max():
    dr = torch.tensor([0.0, 1.0, 100.0])  # the outlier has the largest critic value
    df = torch.tensor([0.5])
    w = torch.tensor([1.0, 1.0, 0.0])
    got = rot_critic_loss(dr, df, delta=0.1, weights_real=w)
    same = rot_critic_loss(dr[:2], df, delta=0.1)
    assert float(got) == pytest.approx(float(same), abs=1e-6)
    assert float(got) == pytest.approx(-0.5 + 0.9 * 0.5 + 0.1 * 1.0, abs=1e-6)
    # gradients: the zero-weight point gets none
    dr_g = dr.clone().requires_grad_(True)
    rot_critic_loss(dr_g, df, delta=0.1, weights_real=w).backward()
    assert dr_g.grad[2] == 0 and dr_g.grad[1] != 0


def test_rot_argument_errors():
    dr, df = torch.randn(4), torch.randn(3)
    for bad in (-0.1, 1.0, 1.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="delta"):
            rot_critic_loss(dr, df, delta=bad)
    for bad in ("0.1", "a", None, True, torch.tensor([0.1, 0.2])):
        with pytest.raises(TypeError, match="delta"):
            rot_critic_loss(dr, df, delta=bad)
    assert float(rot_critic_loss(dr, df, delta=torch.tensor(0.25))) == pytest.approx(
        float(rot_critic_loss(dr, df, delta=0.25)), abs=1e-6)
    with pytest.raises(ValueError, match="weights_real has zero total mass"):
        rot_critic_loss(dr, df, weights_real=torch.zeros(4))
    with pytest.raises(ValueError, match="weights_real must have shape"):
        rot_critic_loss(dr, df, weights_real=torch.ones(3))
    with pytest.raises(ValueError, match="weights_real has negative"):
        rot_critic_loss(dr, df, weights_real=torch.tensor([1.0, -1.0, 1.0, 1.0]))
    with pytest.raises(ValueError, match="d_real"):
        rot_critic_loss(torch.randn(4, 2), df)
    with pytest.raises(ValueError, match="d_fake"):
        rot_critic_loss(dr, torch.randn(0))


def test_gradient_penalty_linear_critic():
    gen = torch.Generator().manual_seed(1)
    real, fake = torch.randn(8, 3, 4, 4, generator=gen), torch.randn(8, 3, 4, 4, generator=gen)
    lin = torch.nn.Linear(48, 1)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(1, 48, generator=gen))
        lin.weight /= lin.weight.norm()

    def critic(z):
        return lin(z.flatten(1))

    assert float(gradient_penalty(critic, real, fake, generator=gen).detach()) == pytest.approx(0.0, abs=1e-10)
    with torch.no_grad():
        lin.weight *= 3.0  # |grad| = 3 everywhere -> penalty (3 - 1)^2 = 4
    gp = gradient_penalty(critic, real, fake, generator=gen)
    assert float(gp.detach()) == pytest.approx(4.0, rel=1e-5)
    gp.backward()  # differentiable w.r.t. the critic's parameters
    assert lin.weight.grad is not None and lin.weight.grad.abs().sum() > 0


def test_gradient_penalty_nonlinear_and_errors():
    # D(x) = |x|^2 / 2: grad = x_hat, so the penalty is the mean of (|x_hat| - 1)^2 with x_hat on the segment
    real = torch.tensor([[2.0, 0.0]])
    fake = torch.tensor([[2.0, 0.0]])
    gp = gradient_penalty(lambda z: 0.5 * (z**2).sum(1), real, fake)
    assert float(gp) == pytest.approx(1.0, abs=1e-6)
    with pytest.raises(ValueError, match="same shape"):
        gradient_penalty(lambda z: z.sum(1), torch.randn(4, 2), torch.randn(3, 2))
    with pytest.raises(ValueError, match="real"):
        gradient_penalty(lambda z: z.sum(), torch.randn(4), torch.randn(4))
