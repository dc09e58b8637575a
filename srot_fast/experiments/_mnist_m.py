"""MNIST -> MNIST-M-like data of ``srot-fast monge``: MNIST-M-like images are built as DANN builds MNIST-M,
|photo patch - digit|, from random crops of the two photos bundled with scikit-learn (china, flower); the
source measure alpha holds them plus plain MNIST digits (type-II outliers), the target beta plain digits."""
from __future__ import annotations

import torch

__all__ = ["build_data", "mnist_m_like"]


def _photos(size_hint: int):
    """The two scikit-learn sample photos as (3, H, W) float tensors in [0, 1], shrunk so that a size x size
    crop holds some texture (photos are 427 x 640)."""
    from sklearn.datasets import load_sample_images

    from ..data import resize

    out = []
    for img in load_sample_images().images:
        t = torch.from_numpy(img.copy()).permute(2, 0, 1)[None].float() / 255.0
        scale = max(size_hint * 6, 48) / min(t.shape[-2:])
        out.append(resize(t, (int(t.shape[-2] * scale), int(t.shape[-1] * scale)))[0])
    return out


def mnist_m_like(digits: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """(N, 1, s, s) digits in [0, 1] -> (N, 3, s, s) MNIST-M-like images |patch - digit| with a random crop of a
    random scikit-learn sample photo per image."""
    n, _, s, _ = digits.shape
    photos = _photos(s)
    which = torch.randint(len(photos), (n,), generator=gen)
    out = torch.empty(n, 3, s, s)
    for k in range(n):
        ph = photos[int(which[k])]
        i = int(torch.randint(ph.shape[1] - s + 1, (1,), generator=gen))
        j = int(torch.randint(ph.shape[2] - s + 1, (1,), generator=gen))
        out[k] = (ph[:, i:i + s, j:j + s] - digits[k]).abs()
    return out


def build_data(n_clean: int, n_out: int, n_target: int, size: int, seed: int):
    """alpha = n_clean MNIST-M-like + n_out grey MNIST (outliers first), beta = n_target grey MNIST; all
    (N, 3, size, size) in [0, 1]; three disjoint draws from the MNIST 5k subset."""
    from ..data import load_mnist_5k, resize

    mnist, labels = load_mnist_5k()
    need = n_clean + n_out + n_target
    if need > len(mnist):
        raise ValueError(f"n_clean + n_out + n_target = {need} exceeds the {len(mnist)} MNIST images")
    gen = torch.Generator().manual_seed(int(seed))
    perm = torch.randperm(len(mnist), generator=gen)
    small = resize(mnist[perm[:need]], size).clamp_(0, 1)
    base, outl, targ = small[:n_clean], small[n_clean:n_clean + n_out], small[n_clean + n_out:]
    clean = mnist_m_like(base, gen)
    alpha = torch.cat([outl.expand(-1, 3, -1, -1), clean])
    is_out = torch.cat([torch.ones(n_out, dtype=torch.bool), torch.zeros(n_clean, dtype=torch.bool)])
    beta = targ.expand(-1, 3, -1, -1).contiguous()
    return alpha.contiguous(), is_out, beta
