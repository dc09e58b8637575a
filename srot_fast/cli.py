"""Command line ``srot-fast``: the paper's experiments as sub-commands, writing PNG figures and metrics tables.

    srot-fast {demo,flow2d,flow-images,monge,label-prop,gan,cloud3d} [--out DIR] [--quick] [--seed S] [--backend B]
              [--device D] [--threads T] [--no-progress] [experiment options]

The experiments live in ``srot_fast/experiments/<module>.py`` (listed in ``experiments.MODULES``); each
defines ``NAME``, ``HELP``, ``add_arguments(parser)`` and ``run(args) -> dict`` (and optionally
``DEFAULT_DEVICE``, the ``--device`` default).
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence


def _import_matplotlib_agg():
    """Import matplotlib with the non-interactive Agg backend; clear error when it is missing."""
    from .experiments._common import EXTRAS_HINT

    try:
        import matplotlib
    except ImportError as err:
        raise ImportError(f"srot-fast experiments need matplotlib: {EXTRAS_HINT}") from err
    matplotlib.use("Agg")
    return matplotlib


def _run_experiment(module):
    def run(args) -> int:
        _import_matplotlib_agg()
        from .experiments import _common

        with _common.threads(args.threads):
            metrics = module.run(args)
        print(f"wrote {args.out}/ (figures, metrics.json, metrics.md)")
        failed = [c for c in metrics.get("claims", []) if not c["passed"]]
        if failed:
            print(f"note: {len(failed)} claim(s) not met, see the Claims table of metrics.md", file=sys.stderr)
        return 0

    return run


def _add_experiments(sub):
    import importlib

    from .experiments import MODULES, _common

    for name in MODULES:
        module = importlib.import_module(f".experiments.{name}", __package__)
        # argparse %-formats the short help of a sub-command, not its description
        p = sub.add_parser(module.NAME, help=module.HELP.replace("%", "%%"), description=module.HELP)
        _common.add_common(p, f"srot_{module.NAME.replace('-', '_')}_out", getattr(module, "DEFAULT_DEVICE", None))
        module.add_arguments(p)
        p.set_defaults(func=_run_experiment(module))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="srot-fast", description="SROT: OT robust to type-I and type-II outliers.")
    from . import __version__

    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_experiments(sub)
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
        from .experiments._common import EXTRAS_HINT

        if EXTRAS_HINT not in str(err):
            raise
        print(f"srot-fast: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
