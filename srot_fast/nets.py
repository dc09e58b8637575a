r"""Classifiers for the outlier detector (paper §3 and its appendix; docs/DESIGN.md, Detector): each maps a
batch of inputs to (B,) logits, f(x) = sigmoid(logit) = P(target | x).

- :class:`MLP`: ReLU MLP for low-dimensional points (B, D).
- :class:`ConvNet`: the paper's convolutional classifier for images (B, C, H, W) of any size and channel
  count: six 3x3 convolutions of widths 32, 32, 64, 64, 128, 128, each followed by batch-norm and ReLU,
  then one linear layer to the logit (the sigmoid is applied by the loss / :meth:`predict_proba`).

Both are initialised from a private ``torch.Generator`` when one is given (PyTorch's default uniform ranges,
no draw from the global RNG), so a seeded detector is reproducible and leaves the global RNG untouched.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch import nn

__all__ = ["MLP", "ConvNet", "PAPER_CONV_WIDTHS"]

PAPER_CONV_WIDTHS = (32, 32, 64, 64, 128, 128)


def _uniform_init_(layer: nn.Module, generator: Optional[torch.Generator]) -> None:
    """PyTorch's default Linear/Conv init range U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weight and bias,
    drawn from ``generator`` (the global RNG when None)."""
    fan_in = layer.weight[0].numel()
    bound = 1.0 / math.sqrt(fan_in)
    with torch.no_grad():
        layer.weight.uniform_(-bound, bound, generator=generator)
        if layer.bias is not None:
            layer.bias.uniform_(-bound, bound, generator=generator)


class MLP(nn.Module):
    """ReLU MLP (B, D) -> (B,) logits with hidden widths ``hidden``."""

    def __init__(self, dim: int, hidden: Sequence[int] = (64, 64), generator: Optional[torch.Generator] = None):
        super().__init__()
        sizes = [int(dim), *[int(h) for h in hidden], 1]
        layers = []
        for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            lin = nn.utils.skip_init(nn.Linear, fan_in, fan_out)  # no global-RNG draw
            _uniform_init_(lin, generator)
            layers.append(lin)
            if i < len(sizes) - 2:
                layers.append(nn.ReLU())
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)


class ConvNet(nn.Module):
    r"""The paper's image classifier: (B, C, H, W) -> (B,) logits.

    Six 3x3 convolutions (``widths``, paper: 32, 32, 64, 64, 128, 128), padding 1, each followed by
    batch-norm and ReLU; the 2nd, 4th and 6th have stride 2 (the paper does not say how it downsamples);
    then a global average over the remaining positions and one linear layer to a single logit. The average
    makes the net accept any image size (H, W >= 1) and ``in_channels`` any channel count.

    The linear layer starts at zero (logit 0 for every input). With batch-norm the hidden features have unit
    scale from the start, so a random head would give logits that already vary by O(1) between inputs; the
    VAT consistency term, which pulls f(x + r) towards the current f(x), would then reinforce that random
    labelling while the CE term (weight omega: 1e-3 in the paper) is too weak to correct it (measured: inverted or
    collapsed classifiers on the real-image settings of docs/DETECTOR.md). A zero head starts flat, where the
    KL term and its gradient vanish and the CE term sets the sign of the classifier first.

    Args:
        in_channels: C.
        widths: output channels of the six (or any number of) convolutions.
        batch_norm: batch-norm after each convolution (paper: yes).
        generator: private generator for the initial weights (None: the global RNG).
    """

    def __init__(self, in_channels: int = 1, widths: Sequence[int] = PAPER_CONV_WIDTHS, batch_norm: bool = True,
                 generator: Optional[torch.Generator] = None):
        super().__init__()
        widths = tuple(int(w) for w in widths)
        if int(in_channels) < 1 or not widths or min(widths) < 1:
            raise ValueError(f"in_channels and widths must be positive, got {in_channels!r}, {widths!r}")
        layers = []
        c_in = int(in_channels)
        for i, c_out in enumerate(widths):
            conv = nn.utils.skip_init(nn.Conv2d, c_in, c_out, 3, stride=2 if i % 2 else 1, padding=1,
                                      bias=not batch_norm)
            _uniform_init_(conv, generator)
            layers.append(conv)
            if batch_norm:
                layers.append(nn.BatchNorm2d(c_out))
            layers.append(nn.ReLU())
            c_in = c_out
        self.features = nn.Sequential(*layers)
        self.head = nn.utils.skip_init(nn.Linear, c_in, 1)
        with torch.no_grad():       # zero logit at init: see the class docstring
            self.head.weight.zero_()
            self.head.bias.zero_()
        self.in_channels, self.widths, self.batch_norm = int(in_channels), widths, bool(batch_norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.features(x).mean(dim=(-2, -1))     # (B, widths[-1])
        return self.head(h).squeeze(-1)
