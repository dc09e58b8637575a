"""``srot-fast <command> --help`` renders every help string as written: no doubled "%%" (argparse %-formats
argument and sub-command help, not descriptions) in any sub-command's help or in the top-level one."""
import pytest

from srot_fast.cli import build_parser

NAMES = ["demo", "flow2d", "flow-images", "monge", "label-prop", "gan", "cloud3d"]


@pytest.mark.parametrize("name", NAMES)
def test_subcommand_help_has_no_doubled_percent(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([name, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--quick" in out and "%%" not in out, out


def test_top_level_help_has_no_doubled_percent(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    assert "flow2d" in out and "%%" not in out, out
