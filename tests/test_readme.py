"""README.md's "API in short" block runs as written (a newcomer pastes it)."""
from __future__ import annotations

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def test_api_in_short_runs():
    text = README.read_text(encoding="utf-8")
    section = text.split("## API in short", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    torch.manual_seed(0)
    ns: dict = {}
    exec(compile(code, "README.md (API in short)", "exec"), ns)
    x = ns["x"]
    assert x.grad is not None and x.grad.shape == x.shape and torch.isfinite(x.grad).all()
    assert torch.isfinite(ns["value"]) and ns["res"].value.isfinite()
