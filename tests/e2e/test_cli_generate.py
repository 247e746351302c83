"""`diffserve generate` and `diffserve make-tiny` as a user runs them: files written, clear errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from cli_request_args import request_args
from PIL import Image

from diffserve.cli.main import main
from diffserve.outputs import output_file_name, prompt_slug, unique_path

#: The installed console entry point (`diffserve` next to this interpreter), as a shell runs it; the
#: documents' test runs its commands through a launcher instead (tests/e2e/test_docs_examples.py).
CLI = [str(Path(sys.executable).parent / "diffserve")]


@dataclass
class CliResult:
    returncode: int
    stderr: str


@pytest.fixture
def run_cli(capfd):
    """Run the CLI in this process (fast); one test below runs the real console entry in a subprocess."""

    def run(*args: str) -> CliResult:
        code = main(list(args))
        return CliResult(code, capfd.readouterr().err)

    return run


def run_cli_subprocess(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([*CLI, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=600)


def test_generate_writes_png_with_parameters(tiny_flux_dir, tmp_path) -> None:
    result = run_cli_subprocess(
        "generate",
        "--model-path",
        str(tiny_flux_dir),
        *request_args("a red fox", height=64, width=48, steps=3),
        "--seed",
        "42",
        "--save-output",
        "--output-path",
        str(tmp_path),
    )
    assert result.returncode == 0, result.stderr
    pngs = list(tmp_path.glob("*.png"))
    assert len(pngs) == 1
    assert pngs[0].name.startswith("a_red_fox_")
    with Image.open(pngs[0]) as image:
        assert image.size == (48, 64)
        params = json.loads(image.text["parameters"])
    assert params["seed"] == 42 and params["prompt"] == "a red fox" and params["num_inference_steps"] == 3
    log = result.stderr
    for expected in (
        "Resolved pipeline: FluxPipeline",
        "Loaded transformer",
        "Loaded vae",
        "Sampling params",
        "[DenoisingStage] average time per step",
        "[DecodingStage] finished in",
        "Peak memory",
        "Output saved to",
        "s/step",
    ):
        assert expected in log, f"missing {expected!r} in log"


def test_prompt_file_and_multiple_outputs(tiny_flux_dir, tmp_path, run_cli) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n\na dog\n")
    out_dir = tmp_path / "out"
    result = run_cli(
        "generate",
        "--model-path",
        str(tiny_flux_dir),
        "--prompt-file",
        str(prompts),
        *request_args(steps=1),
        "--num-outputs-per-prompt",
        "2",
        "--output-path",
        str(out_dir),
    )
    assert result.returncode == 0, result.stderr
    names = sorted(p.name for p in out_dir.glob("*.png"))
    assert len(names) == 4
    assert sum(n.startswith("a_cat_") for n in names) == 2


def test_no_seed_draws_a_random_seed_that_is_logged_and_saved(tiny_flux_dir, tmp_path, run_cli) -> None:
    """Like the server and diffusers: no --seed, a random one, named in the log (to repeat the run) and in
    the file's metadata; two runs draw different seeds (a false failure has odds of 1 in 2**32)."""
    seeds = []
    for run in ("first", "second"):
        out_dir = tmp_path / run
        result = run_cli(
            "generate", "--model-path", str(tiny_flux_dir), "--prompt", "x", "--height", "32", "--width", "32",
            "--num-inference-steps", "1", "--output-path", str(out_dir),
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        logged = re.search(r"No --seed given: using the random seed (\d+) \(pass --seed \1 ", result.stderr)
        assert logged is not None, result.stderr
        (png,) = out_dir.glob("*.png")
        with Image.open(png) as image:
            saved = json.loads(image.text["parameters"])["seed"]
        assert saved == int(logged.group(1)) and f"seed: {saved}" in result.stderr  # the parameters block
        seeds.append(saved)
    assert seeds[0] != seeds[1]


def test_no_save_output_writes_nothing(tiny_flux_dir, tmp_path, run_cli) -> None:
    result = run_cli(
        "generate",
        "--model-path",
        str(tiny_flux_dir),
        *request_args("x", steps=1),
        "--no-save-output",
        "--output-path",
        str(tmp_path / "o"),
    )
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--height", "50"], "height=50 is not a multiple of 16"),
        (["--width", "100"], "width=100 is not a multiple of 16"),
        (["--num-inference-steps", "0"], "num_inference_steps must be >= 1"),
        (["--prompt", "   "], "prompt must be a non-empty string"),
        (["--device", "nonsense"], "unknown device 'nonsense'"),
    ],
)
def test_bad_inputs_give_one_clear_line_and_exit_2(tiny_flux_dir, tmp_path, args, message, run_cli) -> None:
    base = [
        "generate",
        "--model-path",
        str(tiny_flux_dir),
        *request_args(steps=1),
        "--output-path",
        str(tmp_path),
    ]
    if "--prompt" not in args:
        base += ["--prompt", "a fox"]
    result = run_cli(*base, *args)
    assert result.returncode == 2
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and message in error_lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_folder_that_is_not_a_diffusers_model(tmp_path, run_cli) -> None:
    result = run_cli("generate", "--model-path", str(tmp_path), "--prompt", "x")
    assert result.returncode == 2
    assert "no model_index.json" in result.stderr and "Traceback" not in result.stderr


def test_unsupported_pipeline_lists_supported(tmp_path, run_cli) -> None:
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "KandinskyPipeline"}))
    result = run_cli("generate", "--model-path", str(tmp_path), "--prompt", "x")
    assert result.returncode == 2
    assert "'KandinskyPipeline' is not supported" in result.stderr and "FluxPipeline" in result.stderr


def test_truncated_safetensors_is_a_clear_error(tiny_flux_dir, tmp_path, run_cli) -> None:
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_flux_dir, broken)
    weights = broken / "transformer" / "diffusion_pytorch_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    result = run_cli(
        "generate", "--model-path", str(broken), "--prompt", "x", "--height", "32", "--width", "32"
    )
    assert result.returncode == 2
    assert "truncated or corrupt" in result.stderr and "Traceback" not in result.stderr


def test_debug_log_level_shows_traceback(tmp_path, run_cli) -> None:
    result = run_cli("generate", "--model-path", str(tmp_path), "--prompt", "x", "--log-level", "debug")
    assert result.returncode == 2
    assert "Traceback" in result.stderr


def test_make_tiny_writes_a_loadable_folder(tmp_path, run_cli) -> None:
    result = run_cli("make-tiny", "flux", str(tmp_path / "tiny"), "--no-guidance-embeds")
    assert result.returncode == 0, result.stderr
    index = json.loads((tmp_path / "tiny" / "model_index.json").read_text())
    assert index["_class_name"] == "FluxPipeline"
    config = json.loads((tmp_path / "tiny" / "transformer" / "config.json").read_text())
    assert config["guidance_embeds"] is False


def test_output_names_are_slugged_and_collision_free(tmp_path) -> None:
    assert prompt_slug("A red fox! (in snow)") == "A_red_fox_in_snow"
    name = output_file_name("a red fox", "req-1", 0, "png")
    parts = name[: -len(".png")].split("_")
    assert parts[:3] == ["a", "red", "fox"] and len(parts[-1]) == 8 and len(parts[-2]) == 15
    first = unique_path(tmp_path, name)
    first.write_bytes(b"x")
    assert unique_path(tmp_path, name) != first
