"""The ``srot-fast`` command line: every experiment is a sub-command with the common options, help
renders, and user errors exit with code 2 and a message (no traceback)."""
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
