"""The ``srot-fast`` command line: every experiment is a sub-command with the common options, help
renders, and user errors exit with code 2 and a message (no traceback)."""
import argparse
import subprocess
import sys

import pytest
import torch

from srot_fast.cli import build_parser, main
from srot_fast.experiments import MODULES

NAMES = ["demo", "flow2d", "flow-images", "monge", "label-prop", "gan", "cloud3d"]


def test_help_lists_every_subcommand():
    out = subprocess.run([sys.executable, "-m", "srot_fast.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    for name in NAMES:
        assert name in out.stdout
    assert len(MODULES) == len(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_common_options(name, capsys):
    parser = build_parser()
    args = parser.parse_args([name, "--quick", "--seed", "3", "--backend", "cpu", "--no-progress", "--out", "o"])
    assert args.quick and args.seed == 3 and args.backend == "cpu" and not args.progress and args.out == "o"
    with pytest.raises(SystemExit):
        parser.parse_args([name, "--help"])
    assert "--quick" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_device_without_cuda_is_a_clear_error(tmp_path, capsys):
    assert main(["flow2d", "--quick", "--device", "cuda", "--out", str(tmp_path)]) == 2
    assert "--device" in capsys.readouterr().err


def test_bad_device_name_is_a_clear_error(tmp_path, capsys):
    assert main(["flow2d", "--quick", "--device", "gpu0", "--out", str(tmp_path)]) == 2
    assert "--device" in capsys.readouterr().err


def test_no_subcommand_prints_help(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


# (command, option, value) out of the option's range: argparse's usage error, before anything runs
BAD_VALUES = [
    *[(name, opt, value) for name in NAMES
      for opt, value in [("--threads", "-1"), ("--seed", "-1"), ("--seed", str(2**32)), ("--seed", "1.5")]],
    ("flow2d", "--n", "19"), ("flow2d", "--steps", "0"), ("flow2d", "--lr", "0"), ("flow2d", "--lr", "nan"),
    ("flow2d", "--every", "0"), ("flow2d", "--w1-points", "9"), ("flow2d", "--detector-points", "0"),
    ("flow-images", "--size", "3"), ("flow-images", "--size", "65"), ("flow-images", "--n", "19"),
    ("flow-images", "--steps", "0"), ("flow-images", "--lr", "-1"), ("flow-images", "--every", "0"),
    ("flow-images", "--blur", "-1"), ("flow-images", "--blur", "inf"), ("flow-images", "--tol", "0"),
    ("flow-images", "--tol", "1"), ("flow-images", "--w-points", "9"), ("flow-images", "--detector-epochs", "0"),
    ("monge", "--n-clean", "9"), ("monge", "--outlier-rate", "1"), ("monge", "--outlier-rate", "-0.1"),
    ("monge", "--n-target", "9"), ("monge", "--size", "3"), ("monge", "--blur", "-1"), ("monge", "--blur", "0"),
    ("monge", "--map-steps", "0"), ("monge", "--map-hidden", "0"), ("monge", "--epochs", "0"),
    ("monge", "--omega", "0"),
    ("label-prop", "--n-per-class", "3"), ("label-prop", "--n-per-class", "143"), ("label-prop", "--size", "3"),
    ("label-prop", "--blur", "-1"), ("label-prop", "--epochs", "0"), ("label-prop", "--omega", "0"),
    ("gan", "--noise", "0.5"), ("gan", "--noise", "0.1,0"), ("gan", "--noise", ","), ("gan", "--iters", "0"),
    ("gan", "--lr", "0"), ("gan", "--batch", "1"), ("gan", "--n-critic", "0"), ("gan", "--size", "3"),
    ("gan", "--sigma", "0"), ("gan", "--delta", "1"), ("gan", "--delta", "-0.1"), ("gan", "--det-epochs", "0"),
    ("gan", "--n-eval", "9"),
    ("cloud3d", "--n", "19"), ("cloud3d", "--detector-points", "9"),
]


@pytest.mark.parametrize("name, option, value", BAD_VALUES)
def test_out_of_range_value_is_a_usage_error(name, option, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([name, "--quick", option, value])
    assert exit_info.value.code == 2
    assert f"argument {option}: must be" in capsys.readouterr().err


@pytest.mark.parametrize("option, value", [("--nproc", "0"), ("--threads", "0"), ("--points", "0"),
                                           ("--steps", "-1"), ("--lr", "0"), ("--blur", "-1"), ("--reach", "-1"),
                                           ("--seed", "-1")])
def test_sharded_flow_out_of_range_value_is_a_usage_error(option, value, capsys):
    from srot_fast.experiments import sharded_flow

    with pytest.raises(SystemExit) as exit_info:
        sharded_flow.build_parser().parse_args([option, value])
    assert exit_info.value.code == 2
    assert f"argument {option}: must be" in capsys.readouterr().err


def _parser(name):
    """The parser of sub-command ``name`` (or of ``python -m srot_fast.distributed`` for "sharded-flow")."""
    if name == "sharded-flow":
        from srot_fast.experiments import sharded_flow

        return sharded_flow.build_parser()
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


# values at the edge of their option's range that the experiments accept
EDGE_VALUES = {"flow2d": [("--threads", "0"), ("--seed", str(2**32 - 1)), ("--steps", "1")],
               "flow-images": [("--size", "4"), ("--size", "64")],
               "monge": [("--outlier-rate", "0"), ("--size", "4")],
               "label-prop": [("--n-per-class", "4"), ("--n-per-class", "142")],
               "gan": [("--delta", "0"), ("--noise", "0.05, 0.1 0.49"), ("--batch", "2")],
               "sharded-flow": [("--steps", "0"), ("--reach", "0")]}


@pytest.mark.parametrize("name", NAMES + ["sharded-flow"])
def test_defaults_and_edge_values_parse(name):
    """Every numeric default, passed explicitly, is inside its option's range; so are the edge values."""
    parser = _parser(name)
    numeric = [a for a in parser._actions if a.type is not None and isinstance(a.default, (int, float))]
    assert len(numeric) >= 2
    for a in numeric:
        assert getattr(parser.parse_args([a.option_strings[0], str(a.default)]), a.dest) == a.default
    for option, value in EDGE_VALUES.get(name, []):
        parser.parse_args([option, value])
