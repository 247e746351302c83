"""`diffserve` top-level command line: --version, and errors reported with the subcommand's usage."""

from __future__ import annotations

import pytest

import diffserve
from diffserve.cli.main import main


def test_version_prints_the_version_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"diffserve {diffserve.__version__}"


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--prompt", "x", "--bogus"],
        ["serve", "--model-path", "m", "--bogus", "1"],
        ["make-tiny", "flux", "/tmp/out", "--no-such-flag"],
    ],
)
def test_unknown_argument_prints_the_subcommands_usage(argv, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    command = argv[0]
    assert f"usage: diffserve {command}" in err
    assert f"diffserve {command}: error: unrecognized arguments: " in err


def test_missing_subcommand_still_prints_the_top_level_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2
    assert "usage: diffserve [-h] [--version]" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["generate", "serve", "calibrate-cache"])
def test_log_level_help_names_the_choices(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())  # argparse wraps the help over lines
    assert "--log-level LEVEL log verbosity: debug, info, warning, error;" in help_text
    assert "(default: info)" in help_text
