"""Generated 2-D data of the paper (srot_fast.datasets): shapes, supports, masks, determinism, validation."""
import pytest
import torch

from srot_fast.datasets import Flow2D, Toy2D, make_flow_2d, make_toy_2d


def _in_box(p, lo, hi):
    lo = torch.tensor(lo, dtype=p.dtype)
    hi = torch.tensor(hi, dtype=p.dtype)
    return bool(((p >= lo) & (p <= hi)).all())


def test_toy_shapes_masks_and_dtype():
    d = make_toy_2d()
    assert isinstance(d, Toy2D)
    assert d.x.shape == (75, 2) and d.y.shape == (75, 2)
    assert d.x.dtype == torch.float32 and d.y.dtype == torch.float32
    for m in (d.x_type1, d.x_type2, d.y_type1, d.y_type2):
        assert m.dtype == torch.bool and m.shape == (75,)
    assert int(d.x_type1.sum()) == 6 and int(d.y_type1.sum()) == 6
    assert int(d.x_type2.sum()) == 4 and int(d.y_type2.sum()) == 4
    assert not (d.x_type1 & d.x_type2).any() and not (d.y_type1 & d.y_type2).any()
    d64 = make_toy_2d(n=20, n_type1=2, n_type2=3, seed=5, dtype=torch.float64)
    assert d64.x.dtype == torch.float64 and d64.x.shape == (20, 2)
    assert int(d64.x_type1.sum()) == 2 and int(d64.y_type2.sum()) == 3
    d32 = make_toy_2d(n=20, n_type1=2, n_type2=3, seed=5)
    assert torch.equal(d64.x.float(), d32.x) and torch.equal(d64.y.float(), d32.y)


def test_toy_supports():
    d = make_toy_2d(n=300, n_type1=40, n_type2=30, seed=3)
    xc = ~(d.x_type1 | d.x_type2)
    yc = ~(d.y_type1 | d.y_type2)
    assert _in_box(d.x[xc], (0, 0), (1, 1)) and _in_box(d.y[yc], (2, 0), (3, 1))
    assert _in_box(d.x[d.x_type2], (2, 0), (3, 1)) and _in_box(d.y[d.y_type2], (0, 0), (1, 1))
    assert _in_box(d.x[d.x_type1], (1, 3), (2, 4)) and _in_box(d.y[d.y_type1], (1, -4), (2, -3))
    # uniform: clean source mean near the square centre (std of the mean ~ 0.29 / sqrt(230) ~ 0.02)
    assert torch.allclose(d.x[xc].mean(0), torch.tensor([0.5, 0.5]), atol=0.08)


def test_toy_outlier_types_by_distance():
    d = make_toy_2d(seed=1)
    xc = ~(d.x_type1 | d.x_type2)
    yc = ~(d.y_type1 | d.y_type2)
    dist_to_yc = torch.cdist(d.x, d.y[yc]).mean(1)     # (n,) mean distance to the clean target
    dist_to_xc = torch.cdist(d.y, d.x[xc]).mean(1)
    # type II: nearer the other measure than the clean points are (here by far: ~0.5 vs ~2)
    assert dist_to_yc[d.x_type2].mean() < 0.5 * dist_to_yc[xc].mean()
    assert dist_to_xc[d.y_type2].mean() < 0.5 * dist_to_xc[yc].mean()
    # type I: farther from the other measure than the clean points and far from their own measure
    assert dist_to_yc[d.x_type1].min() > dist_to_yc[xc].max()
    assert torch.cdist(d.x[d.x_type1], d.x[xc]).min() > 2.0
    assert torch.cdist(d.y[d.y_type1], d.y[yc]).min() > 2.0


def test_toy_determinism_and_global_rng():
    state = torch.get_rng_state()
    a, b = make_toy_2d(seed=7), make_toy_2d(seed=7)
    assert torch.equal(torch.get_rng_state(), state)
    for u, v in zip(a, b):
        assert torch.equal(u, v)
    c = make_toy_2d(seed=8)
    assert not torch.equal(a.x, c.x)


def test_flow_shapes_supports_and_outliers():
    d = make_flow_2d()
    assert isinstance(d, Flow2D)
    assert d.alpha.shape == (1000, 2) and d.beta0.shape == (1000, 2) and d.alpha.dtype == torch.float32
    assert d.alpha_outlier.dtype == torch.bool and int(d.alpha_outlier.sum()) == 100
    r = d.alpha[~d.alpha_outlier].norm(dim=1)
    assert float(r.min()) >= 0.7 - 1e-6 and float(r.max()) <= 1.0 + 1e-6
    # uniform in area on the annulus: P(r < 0.85) = (0.85^2 - 0.49) / 0.51 ~ 0.456
    assert abs(float((r < 0.85).float().mean()) - 0.456) < 0.06
    assert torch.allclose(d.beta0.mean(0), torch.tensor([3.0, 0.0]), atol=0.05)
    assert torch.allclose(d.beta0.std(0), torch.tensor([0.3, 0.3]), atol=0.03)
    assert torch.allclose(d.alpha[d.alpha_outlier].mean(0), torch.tensor([3.0, 0.0]), atol=0.15)
    # type II: outliers are much nearer beta0 than the clean alpha points are
    dist = torch.cdist(d.alpha, d.beta0).mean(1)
    assert dist[d.alpha_outlier].mean() < 0.25 * dist[~d.alpha_outlier].mean()


def test_flow_counts_dtype_determinism():
    d = make_flow_2d(n=50, outlier_frac=0.23, seed=2, dtype=torch.float64)
    assert d.alpha.dtype == torch.float64 and int(d.alpha_outlier.sum()) == round(0.23 * 50)
    assert int(make_flow_2d(n=10, outlier_frac=0.0).alpha_outlier.sum()) == 0
    state = torch.get_rng_state()
    a, b = make_flow_2d(n=200, seed=4), make_flow_2d(n=200, seed=4)
    assert torch.equal(torch.get_rng_state(), state)
    for u, v in zip(a, b):
        assert torch.equal(u, v)
    assert not torch.equal(a.beta0, make_flow_2d(n=200, seed=5).beta0)


# Bad values raise ValueError, values of the wrong type TypeError; both name the argument.
@pytest.mark.parametrize("kwargs, error, name", [
    (dict(n=0), ValueError, "n"),
    (dict(n=7.5), TypeError, "n"),
    (dict(n_type1=-1), ValueError, "n_type1"),
    (dict(n_type2=-1), ValueError, "n_type2"),
    (dict(n_type2=True), TypeError, "n_type2"),
    (dict(n=10, n_type1=6, n_type2=4), ValueError, "n_type1 \\+ n_type2"),
    (dict(seed=-1), ValueError, "seed"),
    (dict(seed=1.5), TypeError, "seed"),
    (dict(dtype=torch.int64), ValueError, "dtype"),
    (dict(dtype="float32"), TypeError, "dtype"),
])
def test_toy_validation(kwargs, error, name):
    with pytest.raises(error, match=name):
        make_toy_2d(**kwargs)


@pytest.mark.parametrize("kwargs, error, name", [
    (dict(n=0), ValueError, "n"),
    (dict(outlier_frac=1.0), ValueError, "outlier_frac"),
    (dict(outlier_frac=-0.1), ValueError, "outlier_frac"),
    (dict(outlier_frac=float("nan")), ValueError, "outlier_frac"),
    (dict(outlier_frac=float("inf")), ValueError, "outlier_frac"),
    (dict(n=2, outlier_frac=0.9), ValueError, "outlier_frac"),
    (dict(outlier_frac="a"), TypeError, "outlier_frac"),
    (dict(outlier_frac="0.1"), TypeError, "outlier_frac"),
    (dict(outlier_frac=None), TypeError, "outlier_frac"),
    (dict(outlier_frac=False), TypeError, "outlier_frac"),
    (dict(seed=-3), ValueError, "seed"),
    (dict(dtype=torch.bool), ValueError, "dtype"),
])
def test_flow_validation(kwargs, error, name):
    with pytest.raises(error, match=name):
        make_flow_2d(**kwargs)


def test_fraction_accepts_real_numbers():
    """numpy scalars and one-element tensors are numbers: same data as the float."""
    import numpy as np

    want = make_flow_2d(n=20, outlier_frac=0.25, seed=1).alpha_outlier
    for frac in (np.float32(0.25), np.float64(0.25), torch.tensor(0.25)):
        assert torch.equal(make_flow_2d(n=20, outlier_frac=frac, seed=1).alpha_outlier, want)


def test_fraction_checks_agree_with_rot_delta():
    """make_flow_2d's outlier_frac and rot_critic_loss's delta apply one rule for [0, 1) numbers."""
    from srot_fast.partners import rot_critic_loss

    dr, df = torch.randn(4), torch.randn(3)
    for bad in (1.0, -0.1, float("nan"), "0.1", None, True):
        errors = []
        with pytest.raises((TypeError, ValueError), match="outlier_frac") as exc:
            make_flow_2d(n=10, outlier_frac=bad)
        errors.append(exc.type)
        with pytest.raises((TypeError, ValueError), match="delta") as exc:
            rot_critic_loss(dr, df, delta=bad)
        errors.append(exc.type)
        assert errors[0] is errors[1], (bad, errors)
