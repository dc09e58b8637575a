"""Warm starts (sinkhorn(init=...), SROTLoss(warm_start=True)) give the same solution in fewer iterations."""
import torch

import srot_fast


def _problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(80, 2, generator=g, dtype=torch.float64)
    y = torch.randn(70, 2, generator=g, dtype=torch.float64) + 1.5
    return x, y


def test_sinkhorn_init_same_solution_fewer_iterations():
    x, y = _problem()
    kw = dict(p=1, eps=0.05, penalty="kl", tau=1.0, tol=1e-10, max_iter=5000)
    cold = srot_fast.sinkhorn(x, y, **kw)
    warm = srot_fast.sinkhorn(x + 1e-3, y, init=(cold.f, cold.g), **kw)
    ref = srot_fast.sinkhorn(x + 1e-3, y, **kw)
    assert warm.n_iter < ref.n_iter
    torch.testing.assert_close(warm.value, ref.value, atol=1e-9, rtol=1e-8)
    torch.testing.assert_close(warm.f, ref.f, atol=1e-7, rtol=1e-7)


def test_loss_warm_start_flow_matches_cold_flow():
    x, y0 = _problem(1)
    values, iters = {}, {}
    for ws in (False, True):
        # value_tol=None: each step solved to the marginal tolerance, so that the gradients (whose error is
        # first order in the marginal error) and hence the two flows agree
        loss = srot_fast.SROTLoss(p=1, blur=0.1, tol=1e-9, max_iter=5000, warm_start=ws, debias=False,
                                  value_tol=None)
        y = y0.clone().requires_grad_()
        its = 0
        for _ in range(5):
            v = loss(x, y)
            (g,) = torch.autograd.grad(v, y)
            its += loss.last_result.n_iter
            with torch.no_grad():
                y -= 0.5 * y.shape[0] * g
        values[ws], iters[ws] = loss(x, y.detach()).item(), its
    assert abs(values[True] - values[False]) < 1e-7 * abs(values[False])
    assert iters[True] < iters[False]


def test_warm_start_ignores_mismatched_shapes_and_reset():
    x, y = _problem(2)
    loss = srot_fast.SROTLoss(p=2, blur=0.1, warm_start=True, tol=1e-9, max_iter=5000, debias=False)
    loss(x, y)
    v_other = loss(x[:50], y)  # shapes changed: cold start, no error
    ref = srot_fast.SROTLoss(p=2, blur=0.1, tol=1e-9, max_iter=5000, debias=False)(x[:50], y)
    torch.testing.assert_close(v_other, ref, atol=1e-9, rtol=1e-8)
    loss.reset()
    assert loss._warm is None


def test_loss_warm_start_covers_the_debiasing_terms():
    """With debias (the default), warm_start also starts the two self-transport solves from the previous call's:
    the same flow in far fewer debiasing updates."""
    x, y0 = _problem(3)
    values, iters = {}, {}
    for ws in (False, True):
        loss = srot_fast.SROTLoss(p=2, blur=0.1, tol=1e-9, max_iter=5000, warm_start=ws, value_tol=None)
        debias_updates = []
        solve = loss._solve

        def spy(x, y, *args, solve=solve, record=debias_updates, **kw):
            res = solve(x, y, *args, **kw)
            if x is y:  # a debiasing term
                record.append(int(res.n_iter))
            return res

        loss._solve = spy
        y = y0.clone().requires_grad_()
        for _ in range(5):
            (g,) = torch.autograd.grad(loss(x, y), y)
            with torch.no_grad():
                y -= 0.5 * y.shape[0] * g
        values[ws], iters[ws] = loss(x, y.detach()).item(), sum(debias_updates[2:])  # after the first call
        assert len(debias_updates) == 12
    assert abs(values[True] - values[False]) < 1e-7 * abs(values[False])
    assert iters[True] < 0.5 * iters[False], iters
    loss.reset()
    assert loss._warm is None and loss._warm_debias is None
