"""`diffserve` top-level command line: --version, and an unknown flag reported in one line with the closest one."""

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
    ("argv", "line"),
    [
        (["generate", "--heigth", "64"], "error: unrecognized argument --heigth; did you mean --height?"),
        # a misspelled required flag: named as misspelled, not reported as `--prompt` missing
        (["generate", "--promt", "a fox"], "error: unrecognized argument --promt; did you mean --prompt?"),
        (["generate", "--prompt", "x", "--bogus"], "error: unrecognized argument --bogus; see `diffserve generate --help`"),
        (["serve", "--model-path", "m", "--prot", "1"], "error: unrecognized argument --prot; did you mean --port?"),
        (["make-tiny", "flux", "/tmp/out", "--forse"], "error: unrecognized argument --forse; did you mean --force?"),
        (["make-lora", "x.safetensors", "--rnak=8"], "error: unrecognized argument --rnak; did you mean --rank?"),
        (["calibrate-cache", "--modle-path", "m"], "error: unrecognized argument --modle-path; did you mean --model-path?"),
        (
            ["generate", "--promt", "x", "--widht", "64"],
            "error: unrecognized arguments --promt (did you mean --prompt?), --widht (did you mean --width?); "
            "see `diffserve generate --help`",
        ),
        (["make-tiny", "flux", "/tmp/out", "extra"], "error: unrecognized arguments: extra (see `diffserve make-tiny --help`)"),
    ],
)  # fmt: skip
def test_an_unknown_flag_is_one_line_with_the_closest_flag(
    argv, line, capsys: pytest.CaptureFixture[str]
) -> None:
    """No usage dump before the error (it was 41 lines for generate): one `error:` line, exit code 2."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines() == [line]


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--prompt", "x", "--seed", "-5", "--heig", "64", "--no-save-output", "--bogus"],
        ["generate", "--prompt=--heigth", "--bogus"],  # a flag's value given with = is not a flag
        ["generate", "--prompt", "a -x y", "--bogus"],  # text with spaces is a value
    ],
)
def test_values_and_abbreviations_are_not_taken_for_unknown_flags(
    argv, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(argv)
    assert capsys.readouterr().err.splitlines() == [
        "error: unrecognized argument --bogus; see `diffserve generate --help`"
    ]


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
