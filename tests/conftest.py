"""Shared test settings: Triton runs under its CPU interpreter when no GPU is present (set before
any import of triton), float64 by default for reference comparisons, dtype -> tolerance table."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# dtype -> (atol, rtol) for kernel-vs-reference comparisons
TOL = {torch.float64: (1e-10, 1e-9), torch.float32: (1e-4, 1e-4)}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
