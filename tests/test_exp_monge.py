"""``srot-fast monge --quick``: files, metrics.json structure and the paper's claims (SROT maps land on the clean
MNIST-M-like measure; OT and partial OT transport all of the MNIST outliers) with the numbers the quick run gives.

Quick setting: alpha = 255 MNIST-M-like + 45 MNIST outliers, beta = 255 MNIST, 12x12x3, detector 8 epochs, map
100 Adam steps. The MLP map is under-trained at 100 steps, so the test checks W(alpha_c, .) on the barycentric
projection (the map's regression target); the full run's table reports both. About 20 s of CPU per seed on 1
thread. Measured numbers are in the module docstring of srot_fast/experiments/monge.py and in the asserts' comments.
"""

import pytest

from srot_fast.cli import main

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("seed", [0, 1])
def test_monge_quick(run_quick, seed):
    metrics = run_quick("monge", seed, ("monge_samples.png", "monge_w.png"))
    cfg = metrics["config"]
    assert cfg["quick"] is True and cfg["seed"] == seed and cfg["n_outliers"] == 45
    for k in ("backend", "device", "eps", "gamma", "partial_masses", "soft_mass"):
        assert k in cfg
    res = metrics["results"]
    det = res["detection"]
    assert det["recall"] >= 0.9 and det["clean_flagged"] <= 0.15
    r = res["methods"]
    assert set(r) == {"OT", "partial 0.85", "SROT hard", "SROT soft"}
    share = 45 / 300
    # OT and partial OT move all of the outliers' mass (15 % of alpha), SROT none of it
    assert r["OT"]["outlier_mass_share"] == pytest.approx(share, abs=0.01)
    assert r["partial 0.85"]["outlier_mass_share"] >= share
    assert r["SROT hard"]["outlier_mass_share"] <= 1e-3
    assert r["SROT soft"]["outlier_mass_share"] <= 0.03
    # the barycentric projection of the SROT plans is closer to the clean measure than OT's and partial OT's
    w = {m: r[m]["W_alpha_c_bary"] for m in r}
    assert w["SROT hard"] < 0.95 * min(w["OT"], w["partial 0.85"])
    assert w["SROT soft"] < 0.95 * min(w["OT"], w["partial 0.85"])
    for m in r:
        assert 0 < r[m]["W_alpha_c_T_beta"] < res["W_alpha_c_beta_identity"]   # every map moves towards alpha
    assert all(set(c) == {"claim", "passed", "detail"} for c in metrics["claims"])
    assert "total_s" in metrics["timing"]


def test_monge_bad_option(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:   # out of the option's range: argparse's usage error
        main(["monge", "--quick", "--outlier-rate", "1.5", "--out", str(tmp_path), "--no-progress"])
    assert exit_info.value.code == 2
    assert "--outlier-rate" in capsys.readouterr().err


def test_mnist_m_like_shapes():
    import torch

    from srot_fast.experiments.monge import build_data

    alpha, is_out, beta = build_data(20, 5, 15, 12, seed=0)
    assert alpha.shape == (25, 3, 12, 12) and beta.shape == (15, 3, 12, 12) and is_out.sum() == 5
    assert bool(is_out[:5].all()) and not bool(is_out[5:].any())
    grey = lambda t: (t.std(dim=1).mean(dim=(1, 2)))   # noqa: E731
    assert torch.all(grey(alpha[:5]) < 1e-6) and torch.all(grey(beta) < 1e-6)      # outliers and beta are grey
    assert torch.all(grey(alpha[5:]) > 1e-3)                                        # MNIST-M-like is coloured
    assert float(alpha.min()) >= 0 and float(alpha.max()) <= 1
