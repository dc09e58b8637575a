"""Power-iteration steps of VAT (srot_fast.vat): the fused jvp/vjp step against the finite-difference
reference and an exact Hessian-vector product, the frozen batch-norm statistics, per-sample detection and the
half-precision refusal."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from srot_fast import nets, vat


def _cos(a, b):
    """Per-sample cosine (no eps clamp: tiny but exact vectors must not read as misaligned)."""
    a, b = a.flatten(1), b.flatten(1)
    return (a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1))


def _smooth_net(dim=5, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(dim, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)).double()


def _kl_sum(fn, z, p):
    def kl(r):
        lq = fn(z + r)
        return -(p * F.logsigmoid(lq) + (1 - p) * F.logsigmoid(-lq)).sum()
    return kl


def test_fused_matches_fd_and_exact_hvp_float64():
    """Target: cosine >= 0.99 with the finite-difference reference in float64 on a smooth network; the fused
    product is the exact Hessian-vector product of the KL at r = 0 (compared with autograd's hvp)."""
    net = _smooth_net()

    def fn(x):
        return net(x).squeeze(-1)
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(40, 5, generator=gen, dtype=torch.float64)
    d = torch.randn(40, 5, generator=gen, dtype=torch.float64)
    logit, hd = vat.gauss_newton_product(fn, z, d, per_sample=False)
    _, hd_ps = vat.gauss_newton_product(fn, z, d, per_sample=True)
    fd = vat.fd_product(fn, z, d, xi=1e-6)
    assert torch.allclose(logit, fn(z))
    assert float(_cos(hd, fd).min()) >= 0.99
    assert float(_cos(hd, fd).min()) > 1 - 1e-9        # in fact equal to rounding
    assert torch.allclose(hd, hd_ps, rtol=1e-10, atol=1e-14)
    p = torch.sigmoid(fn(z)).detach()
    exact = torch.autograd.functional.hvp(_kl_sum(fn, z, p), torch.zeros_like(z), d)[1]
    assert torch.allclose(hd, exact, rtol=1e-9, atol=1e-14)
    step = vat.power_step(fn, z, d)                      # unit-free direction, same per-sample orientation
    assert float(_cos(step, hd).min()) > 1 - 1e-12
    step_fd = vat.power_step(fn, z, d, method="fd", p=p)
    assert float(_cos(step_fd, hd).min()) >= 0.99


def test_float32_fused_is_exact_and_fd_underflows():
    """float32: the fused step equals the float64 exact direction; the reference's finite difference
    sigma(l + xi Jd) - p is at the rounding level, so some rows come out exactly zero (and others with a
    random sign; for one logit per sample the nonzero rows are still along +-grad logit)."""
    net = _smooth_net(seed=3)
    gen = torch.Generator().manual_seed(4)
    z = torch.randn(64, 5, generator=gen, dtype=torch.float64)
    d = torch.randn(64, 5, generator=gen, dtype=torch.float64)
    exact = vat.power_step(lambda x: net(x).squeeze(-1), z, d)
    net32 = net.float()
    fused = vat.power_step(lambda x: net32(x).squeeze(-1), z.float(), d.float())
    fd = vat.power_step(lambda x: net32(x).squeeze(-1), z.float(), d.float(), method="fd")
    assert float(_cos(fused.double(), exact).min()) > 1 - 1e-6
    zero = fd.norm(dim=1) == 0            # the detector falls back to the random direction on these rows
    assert bool(zero.any())
    assert float(_cos(fd[~zero].double(), exact[~zero]).abs().min()) > 1 - 1e-5


def _convnet64(seed=0):
    torch.manual_seed(seed)
    return nets.ConvNet(3, widths=(4, 4, 8, 8, 8, 8), generator=torch.Generator().manual_seed(seed)).double()


def test_frozen_batch_norm():
    cn = _convnet64().train()
    with torch.no_grad():
        cn.head.weight.normal_()         # the ConvNet starts with a zero head
    bn = cn.features[1]
    fb = vat.FrozenBatchNorm(cn)
    gen = torch.Generator().manual_seed(2)
    z = torch.randn(10, 3, 9, 7, generator=gen, dtype=torch.float64)
    d = torch.randn(10, 3, 9, 7, generator=gen, dtype=torch.float64)
    with fb.record():
        clean = cn(z)
    assert int(bn.num_batches_tracked) == 1
    state = {k: v.clone() for k, v in cn.state_dict().items()}
    # perturbed passes: clean logits reproduced at r = 0, running statistics untouched, per-sample logits
    assert torch.allclose(fb.fn(z), clean, atol=1e-12)
    assert torch.allclose(fb.fn(z, attached=True), clean, atol=1e-12)
    assert vat.is_per_sample(fb.fn, z)
    _, hd = vat.gauss_newton_product(fb.fn, z, d, per_sample=False)
    _, hd_ps = vat.gauss_newton_product(fb.fn, z, d, per_sample=True)
    fd = vat.fd_product(fb.fn, z, d, torch.sigmoid(clean.detach()), xi=1e-6)
    assert float(_cos(hd, hd_ps).min()) > 1 - 1e-9 and float(_cos(hd, fd).min()) >= 0.99
    w = cn.features[0].weight
    g_const, = torch.autograd.grad(fb.fn(z + 0.1 * d).sum(), w)
    loss = fb.fn(z + 0.1 * d, attached=True).sum()
    loss.backward()
    for k, v in cn.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert cn.training and all(m.training for m in cn.modules())
    assert "forward" not in vars(bn)                       # the temporary forward was removed
    # attached statistics: the loss is invariant to scaling the weights before a batch-norm (up to its eps),
    # so its gradient is orthogonal to them; with constant statistics it is not, and VAT training degenerates
    assert abs(float((w.grad * w).sum())) < 1e-3 * float(w.grad.norm() * w.norm())
    assert abs(float((g_const * w).sum())) > 1e-2 * float(g_const.norm() * w.norm())
    assert not vat.is_per_sample(lambda x: cn(x), z)     # train-mode batch-norm couples the samples


def test_is_per_sample_restores_rng_and_handles_one_sample():
    drop = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.5), nn.Linear(8, 1))
    state = torch.get_rng_state()
    assert not vat.is_per_sample(lambda x: drop(x).squeeze(-1), torch.randn(8, 3, generator=torch.Generator()))
    assert torch.equal(torch.get_rng_state(), state)
    assert vat.is_per_sample(lambda x: drop(x).squeeze(-1), torch.randn(1, 3))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_refused(dtype):
    lin = nn.Linear(3, 1).to(dtype)
    z = torch.randn(4, 3, dtype=dtype)
    for method in ("fused", "fd"):
        with pytest.raises(TypeError, match="float32"):
            vat.power_step(lambda x: lin(x).squeeze(-1), z, torch.randn_like(z), method=method)
    with pytest.raises(TypeError, match="model.float"):
        vat.check_power_dtype(dtype)


def test_autocast_disabled_inside_the_step():
    lin = nn.Linear(3, 1)
    z = torch.randn(6, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = vat.power_step(lambda x: lin(x).squeeze(-1), z, torch.randn_like(z))
    assert out.dtype == torch.float32
    assert torch.allclose(out.abs(), lin.weight.detach().abs().expand(6, 3))


def test_bad_arguments():
    lin = nn.Linear(3, 2)
    z = torch.randn(4, 3)
    with pytest.raises(ValueError, match="method"):
        vat.power_step(lambda x: lin(x)[:, 0], z, z, method="exact")
    for per_sample in (True, False):
        with pytest.raises(ValueError, match=r"\(4,\) logits"):
            vat.gauss_newton_product(lin, z, z, per_sample=per_sample)
    with pytest.raises(ValueError, match=r"\(4,\) logits"):
        vat.fd_product(lin, z, z, torch.full((4,), 0.5))
