"""Command line ``srot-fast``: the paper's experiments as sub-commands, writing PNG figures and metrics tables.

    srot-fast demo [--out DIR] [--quick] [--seed S] [--backend auto] [--threads 1] [--no-progress]
    srot-fast {flow2d,flow-images,monge,label-prop,gan} [--out DIR] [--quick] [--seed S] [--backend B]
              [--device D] [--threads T] [--no-progress] [experiment options]

The experiments live in ``srot_fast/experiments/<module>.py`` (listed in ``experiments.MODULES``); each
defines ``NAME``, ``HELP``, ``add_arguments(parser)`` and ``run(args) -> dict``.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

EXTRAS_HINT = "pip install 'srot_fast[experiments]'"


def _import_matplotlib_agg():
    """Import matplotlib with the non-interactive Agg backend; clear error when it is missing."""
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError(f"srot-fast experiments need matplotlib: {EXTRAS_HINT}") from err
    matplotlib.use("Agg")
    return matplotlib


def _common(p: argparse.ArgumentParser, default_out: str):
    p.add_argument("--out", default=default_out, help=f"output folder for figures and metrics (default: {default_out})")
    p.add_argument("--quick", action="store_true", help="small, fast version (for tests and smoke checks)")
    p.add_argument("--seed", type=int, default=0, help="data and detector seed (default: 0)")
    p.add_argument("--backend", default="auto", choices=("auto", "tensorized", "cpu", "keops", "triton"),
                   help="Sinkhorn backend (default: auto)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads during the run (default: 1; 0 keeps torch's setting)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")


def _run_demo(args) -> int:
    _import_matplotlib_agg()
    from .demo import run

    metrics = run(args.out, quick=args.quick, seed=args.seed, backend=args.backend, progress=args.progress,
                  num_threads=args.threads or None)
    failed = [c for c in metrics["claims"] if not c["passed"]]
    print(f"wrote {args.out}/: toy_plans.png, toy_boundaries.png, flow2d.png, flow_w.png, metrics.json, metrics.md")
    if failed:
        print(f"note: {len(failed)} claim(s) not met, see the Claims table", file=sys.stderr)
    return 0


def _add_demo(sub):
    p = sub.add_parser("demo", help="2-D story of the paper: toy plans (Figs. 1-2) and the 2-D gradient flow (§4)",
                       description="Toy OT / UOT / partial / SROT plans and the 2-D gradient flow; writes PNG "
                                   "figures, metrics.json and metrics.md, and prints the metrics table.")
    _common(p, "srot_demo_out")
    p.set_defaults(func=_run_demo)


def _run_experiment(module):
    def run(args) -> int:
        _import_matplotlib_agg()
        from .experiments import _common

        with _common.threads(args.threads):
            module.run(args)
        print(f"wrote {args.out}/ (figures, metrics.json, metrics.md)")
        return 0

    return run


def _add_experiments(sub):
    import importlib

    from .experiments import MODULES, _common

    for name in MODULES:
        module = importlib.import_module(f".experiments.{name}", __package__)
        # argparse %-formats the short help of a sub-command, not its description
        p = sub.add_parser(module.NAME, help=module.HELP.replace("%", "%%"), description=module.HELP)
        _common.add_common(p, f"srot_{module.NAME.replace('-', '_')}_out")
        module.add_arguments(p)
        p.set_defaults(func=_run_experiment(module))


_SUBCOMMANDS = [_add_demo, _add_experiments]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="srot-fast", description="SROT: OT robust to type-I and type-II outliers.")
    from . import __version__

    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in _SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``srot-fast``; returns the exit code (0 ok, 1 error, 2 usage / missing extras)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    from .data import DataUnavailableError
    from .experiments._common import CliError

    try:
        return int(args.func(args))
    except (CliError, DataUnavailableError) as err:
        print(f"srot-fast {args.command}: {err}", file=sys.stderr)
        return 2
    except ImportError as err:
        if EXTRAS_HINT not in str(err):
            raise
        print(f"srot-fast: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
