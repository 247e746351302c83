"""Issue 17 item 13: `diffserve generate` checks its flags and paths before loading the model, and
reports each problem as one `error:` line with exit code 2 (never a traceback, never after the work).

The model path given does not exist: had the model been loaded first, the error would name it instead."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from diffserve.cli.main import main

MISSING_MODEL = "/nonexistent/diffserve-model"


@pytest.fixture
def run_cli(capfd):
    def run(*args: str) -> tuple[int, str]:
        code = main(["generate", "--model-path", MISSING_MODEL, *args])
        return code, capfd.readouterr().err

    return run


def assert_one_error_line(code: int, err: str, *parts: str) -> None:
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err and MISSING_MODEL not in err, err
    for part in parts:
        assert part in lines[0], err


def test_non_utf8_prompt_file(run_cli, tmp_path) -> None:
    path = tmp_path / "prompts.txt"
    path.write_bytes(b"a red fox\n\xff\xfe latin-1 \xe9\n")
    assert_one_error_line(*run_cli("--prompt-file", str(path)), "--prompt-file", "not UTF-8")


def test_output_path_that_is_a_file(run_cli, tmp_path) -> None:
    path = tmp_path / "a-file"
    path.write_text("x")
    assert_one_error_line(*run_cli("--prompt", "p", "--output-path", str(path)), "--output-path", "is a file")
    nested = path / "below"
    assert_one_error_line(
        *run_cli("--prompt", "p", "--output-path", str(nested)), "--output-path", "is a file"
    )


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root can write anywhere")
def test_output_path_not_writable(run_cli, tmp_path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        assert_one_error_line(
            *run_cli("--prompt", "p", "--output-path", str(locked / "out")), "--output-path", "not writable"
        )
    finally:
        locked.chmod(0o700)


def test_no_save_output_skips_the_output_path_check(run_cli, tmp_path) -> None:
    path = tmp_path / "a-file"
    path.write_text("x")
    code, err = run_cli("--prompt", "p", "--output-path", str(path), "--no-save-output")
    assert code == 2 and MISSING_MODEL in err  # it got as far as loading the (missing) model


@pytest.mark.parametrize(
    ("flags", "parts"),
    [
        (["--num-inference-steps", "0"], ["--num-inference-steps: num_inference_steps must be >= 1"]),
        (
            ["--num-inference-steps", "5000"],
            ["--num-inference-steps: num_inference_steps must be <= 1000", "--max-inference-steps"],
        ),
        (["--num-inference-steps", "20", "--max-inference-steps", "10"], ["<= 10"]),
        (["--height", "-64"], ["--height: height must be a positive integer"]),
        (["--width", "0"], ["--width: width must be a positive integer"]),
        (["--guidance-scale", "inf"], ["--guidance-scale: guidance_scale must be a finite number"]),
        (["--true-cfg-scale", "nan"], ["--true-cfg-scale: true_cfg_scale must be a finite number"]),
        (
            ["--num-outputs-per-prompt", "0"],
            ["--num-outputs-per-prompt: num_outputs_per_prompt must be >= 1"],
        ),
        (["--seed", "-1"], ["--seed: seed must be an integer"]),
        (["--num-frames", "0"], ["--num-frames: num_frames must be a positive integer"]),
        (["--max-inference-steps", "0"], ["--max-inference-steps must be >= 1"]),
        (["--revision", " "], ["--revision must not be empty"]),
    ],
)
def test_bad_parameters_fail_before_the_model_loads(run_cli, flags: list[str], parts: list[str]) -> None:
    assert_one_error_line(*run_cli("--prompt", "p", *flags), *parts)


def test_bad_prompts_fail_before_the_model_loads(run_cli, tmp_path) -> None:
    assert_one_error_line(
        *run_cli("--prompt", "x" * 10_001), "--prompt: prompt is 10001 characters long", "at most 10000"
    )
    assert_one_error_line(*run_cli("--prompt", "   "), "--prompt: prompt must be a non-empty string")
    long_line = tmp_path / "long.txt"
    long_line.write_text("short\n" + "y" * 20_000 + "\n")
    assert_one_error_line(
        *run_cli("--prompt-file", str(long_line)), "--prompt: prompt is 20000 characters long"
    )


def test_console_entry_prints_one_line_fast(tmp_path) -> None:
    """The real entry point, in a subprocess: exit 2, one `error:` line, no model work."""
    path = tmp_path / "prompts.txt"
    path.write_bytes(b"\xff\xff\n")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    result = subprocess.run(
        [sys.executable, "-m", "diffserve.cli.main", "generate", "--model-path", MISSING_MODEL, "--prompt-file", str(path)],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert_one_error_line(result.returncode, result.stderr, "not UTF-8")
