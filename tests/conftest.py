"""Shared test settings: Triton runs under its CPU interpreter when no GPU is present (set before
any import of triton), float64 by default for reference comparisons, dtype -> tolerance table."""
import json
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


@pytest.fixture
def run_quick(tmp_path):
    """``run(command, seed, files, *options)``: ``srot-fast <command> --quick`` into tmp_path on 1 thread; checks
    exit status 0, that each of ``files`` (and metrics.json / metrics.md) is a non-empty file listed in
    metrics.json, and metrics.json's top-level keys; returns the parsed metrics."""

    def run(command, seed, files, *options):
        from srot_fast.cli import main

        code = main([command, "--quick", "--seed", str(seed), *options, "--out", str(tmp_path), "--no-progress",
                     "--threads", "1"])
        assert code == 0
        metrics = json.loads((tmp_path / "metrics.json").read_text())
        for f in (*files, "metrics.json", "metrics.md"):
            assert (tmp_path / f).is_file() and (tmp_path / f).stat().st_size > 0
            assert f in metrics["files"]
        assert {"config", "results", "claims", "timing", "files"} <= set(metrics)
        return metrics

    return run
