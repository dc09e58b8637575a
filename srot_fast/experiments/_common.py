"""Shared pieces of the experiment sub-commands: common options, device / thread set-up, metrics files."""
from __future__ import annotations

import argparse
import json
import math
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch

BACKENDS = ("auto", "tensorized", "cpu", "keops", "triton", "blocksparse")
EXTRAS_HINT = "pip install 'srot_fast[experiments]'"


class CliError(ValueError):
    """A user-facing error of an experiment (bad option, missing data): ``srot-fast`` prints it, exit code 2."""


def require(module: str):
    """Import an optional dependency of the experiments; ImportError with the install command when missing."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(f"srot-fast experiments need {module!r}: {EXTRAS_HINT}") from err


# argparse ``type=`` helpers: a value out of range is a usage error naming the option and the range, exit code 2
def _option_type(convert, ok, expected: str):
    """``convert(text)`` when it is ``ok``, else argparse's "argument --opt: must be <expected>, got <text>"."""
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"must be {expected}, got {text}")
        return value

    return parse


def int_at_least(lo: int):
    """Integers >= ``lo``."""
    expected = {0: "a non-negative integer", 1: "a positive integer"}.get(lo, f"an integer >= {lo}")
    return _option_type(int, lambda v: v >= lo, expected)


def int_in(lo: int, hi: int):
    """Integers in [lo, hi]."""
    return _option_type(int, lambda v: lo <= v <= hi, f"an integer in [{lo}, {hi}]")


def fraction(hi: float = 1.0, *, zero: bool = False):
    """Numbers in (0, hi), or [0, hi) with ``zero``."""
    return _option_type(float, lambda v: (v >= 0 if zero else v > 0) and v < hi,
                        f"a number in {'[' if zero else '('}0, {hi:g})")


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)
positive_float = _option_type(float, lambda v: 0 < v < math.inf, "a positive number")
non_negative_float = _option_type(float, lambda v: 0 <= v < math.inf, "a non-negative number")
# seeds: the detector takes no negative seed, and 32 bits keep the seeds the experiments derive (gan: seed * 1000
# + k) inside torch's 64-bit generator seeds
uint32 = int_in(0, 2**32 - 1)


def add_common(p: argparse.ArgumentParser, default_out: str, default_device: Optional[str] = None) -> None:
    """The options every experiment takes. ``default_device``: the ``--device`` default (``None``: cuda when
    available, else cpu)."""
    device_default = ("cuda when available, else cpu" if default_device is None else default_device)
    p.add_argument("--out", default=default_out, help=f"output folder for figures and metrics (default: {default_out})")
    p.add_argument("--quick", action="store_true", help="small, fast version (for tests and smoke checks)")
    p.add_argument("--seed", type=uint32, default=0, help="data, model and detector seed (default: 0)")
    p.add_argument("--backend", default="auto", choices=BACKENDS, help="Sinkhorn backend (default: auto)")
    p.add_argument("--device", default=default_device,
                   help=f"torch device, e.g. cpu or cuda (default: {device_default})")
    p.add_argument("--threads", type=non_negative_int, default=1,
                   help="torch CPU threads during the run (default: 1; 0 keeps torch's setting)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")


def resolve_device(name: Optional[str]) -> torch.device:
    """``None`` -> cuda when available, else cpu; a clear error for an unusable device."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as err:
        raise CliError(f"--device: not a torch device: {name!r}") from err
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CliError("--device cuda requested but torch sees no CUDA device")
    return dev


@contextmanager
def threads(n: Optional[int]):
    """Set torch's CPU thread count for the block (``None`` or 0: leave it), restore it after."""
    old = torch.get_num_threads()
    if n:
        torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(old)


class Timer:
    """Wall-clock and process CPU time since creation, in seconds (rounded to 0.01 s unless told)."""

    def __init__(self):
        self.t0, self.c0 = time.perf_counter(), time.process_time()

    def read(self, digits: int = 2) -> float:
        """Wall-clock seconds, rounded to ``digits`` decimals."""
        return round(time.perf_counter() - self.t0, digits)

    def cpu(self) -> float:
        """CPU seconds of this process (all threads)."""
        return round(time.process_time() - self.c0, 2)

    def both(self) -> dict:
        """{"wall_s": wall-clock seconds, "cpu_s": CPU seconds}."""
        return {"wall_s": self.read(), "cpu_s": self.cpu()}


def start(args) -> tuple:
    """(Timer, torch.device, output folder) of a command: ``--device`` resolved (CliError if unusable), then
    ``--out`` created."""
    timer = Timer()
    device = resolve_device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return timer, device, out


def _clean(obj):
    """JSON-safe copy: tensors -> lists / floats, NaN / inf -> None."""
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return _clean(obj.detach().cpu().tolist())
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, Path):
        return str(obj)
    return obj


def vat_scores(source: torch.Tensor, target: torch.Tensor, *, epochs: int, omega, seed: int, progress: bool,
               device) -> tuple:
    """VAT detector fitted on ``device`` (source = label 0, target = label 1): (detector, P(target | source)
    and P(target | target) on the CPU, source / target outlier masks by the paper's rule)."""
    from ..detector import OutlierDetector
    from ..weights import outlier_masks

    det = OutlierDetector(method="vat", epochs=epochs, omega=omega, seed=seed, progress=progress, device=device,
                          num_threads=None)
    det.fit(source.to(device), target.to(device))
    s_src = det.predict_proba(source.to(device)).cpu()
    s_tgt = det.predict_proba(target.to(device)).cpu()
    return (det, s_src, s_tgt, *outlier_masks(s_src, s_tgt))


def claim(text: str, passed: bool, detail: str) -> dict:
    """One entry of metrics.json's "claims": a comparison the paper makes, whether it holds here, the numbers."""
    return {"claim": text, "passed": bool(passed), "detail": detail}


def claims_table(claims: list) -> str:
    """The Markdown table of :func:`claim` entries."""
    return md_table(["claim", "passed", "detail"], [[c["claim"], "yes" if c["passed"] else "**NO**", c["detail"]]
                                                     for c in claims])


def md_table(header: list, rows: list) -> str:
    """A Markdown table; floats with 4 significant digits."""
    def cell(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_metrics(out: Path, metrics: dict, markdown: str) -> None:
    """Write ``metrics.json`` and ``metrics.md`` into ``out`` and print the Markdown."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(_clean(metrics), indent=1))
    (out / "metrics.md").write_text(markdown)
    print(markdown)


def savefig(fig, path: Path, dpi: int = 80) -> str:
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return str(path)
