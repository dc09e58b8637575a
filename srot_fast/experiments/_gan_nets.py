"""The GANs of ``srot-fast gan``: an MLP generator and critic, the noise outliers built from the initialised
generator, and the training loop of the three critic losses (WGAN-GP, the ROT critic of Nietert et al.,
ROT with hard SROT weights on the real batch; :mod:`srot_fast.partners`)."""
from __future__ import annotations

import torch
from torch import nn

METHODS = ("wgan_gp", "rot", "rot_srot")
LABELS = {"wgan_gp": "WGAN-GP", "rot": "ROT (0.1)", "rot_srot": "ROT + SROT hard"}
GP_WEIGHT = 10.0
LATENT = 32


# ---------------------------------------------------------------------------------------------------- nets
class Generator(nn.Module):
    """z (B, LATENT) -> images (B, D) in [-1, 1]: MLP with two hidden ReLU layers and a tanh output."""

    def __init__(self, dim: int, hidden: int = 256):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(LATENT, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, dim), nn.Tanh())

    def forward(self, z):
        return self.net(z)


class Critic(nn.Module):
    """images (B, D) -> scores (B,): MLP with two hidden LeakyReLU(0.2) layers (no batch-norm: GP)."""

    def __init__(self, dim: int, hidden: int = 256):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, hidden),
                                 nn.LeakyReLU(0.2), nn.Linear(hidden, 1))

    def forward(self, x):
        return self.net(x)[:, 0]


def noise_images(g_init: nn.Module, n: int, sigma: float, gen: torch.Generator) -> torch.Tensor:
    """Outliers as in the paper's appendix: clamp(G_init(z) + sigma psi, -1, 1)."""
    with torch.no_grad():
        zg = g_init(torch.randn(n, LATENT, generator=gen))
        return (zg + sigma * torch.randn(zg.shape, generator=gen)).clamp(-1, 1)


# ---------------------------------------------------------------------------------------------------- training
def train_gan(method: str, real: torch.Tensor, weights, init_state: dict, *, iters: int, batch: int,
              n_critic: int, delta: float, seed: int, lr: float = 1e-4, progress: bool = False):
    """Train one GAN from the shared initial state; returns the generator and a loss history."""
    from ..partners import gradient_penalty, rot_critic_loss

    dim = real.shape[1]
    g, d = Generator(dim), Critic(dim)
    g.load_state_dict(init_state["g"])
    d.load_state_dict(init_state["d"])
    opt_g = torch.optim.Adam(g.parameters(), lr=lr, betas=(0.5, 0.9))
    opt_d = torch.optim.Adam(d.parameters(), lr=lr, betas=(0.5, 0.9))
    gen = torch.Generator().manual_seed(int(seed) + 1000)
    n = len(real)
    history = []
    bar = range(iters)
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(bar, desc=LABELS[method], leave=False)
    for it in bar:
        for _ in range(n_critic):
            idx = torch.randint(n, (batch,), generator=gen)
            xr = real[idx]
            w = None
            if weights is not None:
                w = weights[idx]
                while not w.sum() > 0:  # practically never: a batch of flagged points only
                    idx = torch.randint(n, (batch,), generator=gen)
                    xr, w = real[idx], weights[idx]
            with torch.no_grad():
                xf = g(torch.randn(batch, LATENT, generator=gen))
            dr, df = d(xr), d(xf)
            if method == "wgan_gp":
                loss = -dr.mean() + df.mean()
            else:
                loss = rot_critic_loss(dr, df, delta=delta, weights_real=w)
            loss = loss + GP_WEIGHT * gradient_penalty(d, xr, xf, generator=gen)
            opt_d.zero_grad(set_to_none=True)
            loss.backward()
            opt_d.step()
        xf = g(torch.randn(batch, LATENT, generator=gen))
        loss_g = -d(xf).mean()
        opt_g.zero_grad(set_to_none=True)
        loss_g.backward()
        opt_g.step()
        if it % 50 == 0 or it == iters - 1:
            history.append([it, float(loss.detach()), float(loss_g.detach())])
    return g, history
