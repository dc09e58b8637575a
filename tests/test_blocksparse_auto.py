"""``backend="auto"`` on CPU picks ``blocksparse`` by the rule of srot_fast/backends.py (resolve_backend)."""
from __future__ import annotations

import pytest
import torch
from srot_fast.kernels import cpu_ops

from srot_fast import backends, sinkhorn

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="needs the compiled cpu kernel")
BIG = 40_000  # N = M: N M = 1.6e9 >= SPARSE_PAIRS


def _pts(d, n=200, side=1.0):
    g = torch.Generator().manual_seed(d)
    return torch.rand(n, d, generator=g) * side, torch.rand(n, d, generator=g) * side


@pytest.mark.parametrize("d", [1, 2, 3])
def test_picks_blocksparse_at_small_blur(d):
    x, y = _pts(d)
    diam = float(torch.cat([x, y]).amax(0).sub(torch.cat([x, y]).amin(0)).norm())
    for p in (1, 2):
        blur = 0.9 * backends.SPARSE_BLUR[p] * diam
        assert backends.resolve_backend("auto", BIG, BIG, "cpu", points=(x, y), eps=blur**p, p=p) == "blocksparse"
        blur = 1.1 * backends.SPARSE_BLUR[p] * diam
        assert backends.resolve_backend("auto", BIG, BIG, "cpu", points=(x, y), eps=blur**p, p=p) == "cpu"


def test_keeps_cpu_otherwise():
    x, y = _pts(2)
    small = dict(points=(x, y), eps=1e-6, p=2)
    assert backends.resolve_backend("auto", 1000, 1000, "cpu", **small) == "cpu"  # N M too small
    assert backends.resolve_backend("auto", BIG, BIG, "cpu") == "cpu"  # no points given
    x4, y4 = _pts(4)
    assert backends.resolve_backend("auto", BIG, BIG, "cpu", points=(x4, y4), eps=1e-6, p=2) == "cpu"  # d > 3
    assert backends.resolve_backend("auto", BIG, BIG, "cpu", points=(x, y), eps=0.5, p=2) == "cpu"  # large blur
    tiny = "cpu" if cpu_ops.available() else "tensorized"  # N M < 4096: the dense reference without the kernel
    assert backends.resolve_backend("auto", 10, 10, "cpu", **small) == tiny


@pytest.mark.filterwarnings("ignore:Sinkhorn stopped at max_iter")
def test_sinkhorn_auto_reports_blocksparse(monkeypatch):
    """Through the solver (the pair threshold lowered so that a small problem qualifies)."""
    monkeypatch.setattr(backends, "SPARSE_PAIRS", 1)
    x, y = _pts(2, 300)
    assert sinkhorn(x, y, p=2, eps=0.02**2, max_iter=5, backend="auto").backend == "blocksparse"
    assert sinkhorn(x, y, p=2, eps=0.5**2, max_iter=5, backend="auto").backend == "cpu"
