"""LoRA on the command line (issue 19): `diffserve generate --lora PATH:SCALE` applies the adapter to the
image; a missing or corrupt file is one `error:` line with exit code 2; `serve`'s LoRA flags make the
EngineArgs the engine starts with, and bad values are errors naming the flag."""

from __future__ import annotations

import json

import numpy as np
import pytest
from cli_request_args import request_args
from PIL import Image

from diffserve.cli.engine_flags import engine_args_from
from diffserve.cli.lora_flags import parse_lora_spec, parse_size
from diffserve.cli.main import build_parser, main
from diffserve.errors import UserError

GENERATE = [*request_args("a red fox", steps=3), "--seed", "5"]


@pytest.fixture(scope="module")
def lora_file(tiny_flux_dir, tmp_path_factory):
    from diffserve.testing.tiny_lora import write_random_lora

    # std 0.2: a visible change on the tiny model.
    return write_random_lora(
        tiny_flux_dir, tmp_path_factory.mktemp("lora") / "ink.safetensors", rank=4, std=0.2
    )


def generate(tiny_flux_dir, out_dir, capfd, *extra: str) -> tuple[int, str]:
    code = main(
        ["generate", "--model-path", str(tiny_flux_dir), *GENERATE, "--output-path", str(out_dir), *extra]
    )
    return code, capfd.readouterr().err


def only_image(folder) -> tuple[np.ndarray, dict]:
    [path] = list(folder.glob("*.png"))
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB")).astype(int), json.loads(image.text["parameters"])


def test_generate_with_a_lora_changes_the_image(tiny_flux_dir, lora_file, tmp_path, capfd) -> None:
    code, err = generate(tiny_flux_dir, tmp_path / "base", capfd)
    assert code == 0, err
    code, err = generate(tiny_flux_dir, tmp_path / "lora", capfd, "--lora", f"{lora_file}:0.7")
    assert code == 0, err
    base, _ = only_image(tmp_path / "base")
    styled, params = only_image(tmp_path / "lora")
    diff = np.abs(styled - base)
    print(f"--lora ink:0.7 vs base: max abs pixel diff {diff.max()}, mean {diff.mean():.2f}")
    assert diff.max() > 8
    assert params["loras"] == [{"name": "ink", "scale": 0.7}]  # the file records what made it


def assert_one_error_line(code: int, err: str, *parts: str) -> None:
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for part in parts:
        assert part in lines[0], err


def test_a_missing_lora_file_is_one_error_line(tiny_flux_dir, tmp_path, capfd) -> None:
    missing = tmp_path / "nope.safetensors"
    assert_one_error_line(
        *generate(tiny_flux_dir, tmp_path, capfd, "--lora", f"{missing}:0.7"), "--lora", "does not exist"
    )
    assert not list(tmp_path.glob("*.png"))


def test_a_corrupt_lora_file_ends_the_run_with_its_error(tiny_flux_dir, tmp_path, capfd) -> None:
    corrupt = tmp_path / "broken.safetensors"
    corrupt.write_bytes(b"\x40\x00\x00\x00\x00\x00\x00\x00{")
    code, err = generate(tiny_flux_dir, tmp_path, capfd, "--lora", str(corrupt))
    assert code == 2 and "Traceback" not in err, err
    last = [line for line in err.splitlines() if line.strip()][-1]
    assert last.startswith("error: ") and "broken.safetensors" in last, err


def test_lora_spec_forms(tmp_path) -> None:
    path = tmp_path / "my-style.safetensors"
    path.write_bytes(b"")
    assert parse_lora_spec(str(path)).name == "my-style" and parse_lora_spec(str(path)).scale == 1.0
    spec = parse_lora_spec(f"ink={path}:-0.5")
    assert (spec.name, spec.path, spec.scale) == ("ink", str(path), -0.5)
    with pytest.raises(UserError, match="--lora .*SCALE 'strong' is not a number"):
        parse_lora_spec(f"{path}:strong")
    with pytest.raises(UserError, match="is a directory"):
        parse_lora_spec(str(tmp_path))
    assert parse_size("512MiB", "--max-lora-memory") == 512 * 2**20
    assert parse_size("2GiB", "--max-lora-memory") == parse_size("2g", "--max-lora-memory") == 2 * 2**30
    assert parse_size("1.5GB", "--max-lora-memory") == 1_500_000_000 and parse_size("4096", "-") == 4096
    for bad in ("lots", "-1", "2 parsecs", "0"):
        with pytest.raises(UserError, match="--max-lora-memory"):
            parse_size(bad, "--max-lora-memory")


def test_serve_lora_flags_make_the_engine_args(tmp_path) -> None:
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    a.write_bytes(b"")
    b.write_bytes(b"")
    parser = build_parser()

    def args(*flags: str):
        return engine_args_from(parser.parse_args(["serve", "--model-path", "/m", *flags]))

    engine = args(
        "--lora", str(a), "--lora", f"bee={b}:0.5", "--lora-dir", str(tmp_path), "--max-lora-memory", "256MiB"
    )
    assert [(s.name, s.scale) for s in engine.loras] == [("a", 1.0), ("bee", 0.5)]
    assert (
        engine.lora_dir == str(tmp_path) and engine.max_lora_memory == 256 * 2**20 and not engine.lora_merge
    )
    assert args().loras == [] and args().max_lora_memory == 2 * 2**30 and args().lora_dir is None
    assert args("--lora", str(a), "--lora-merge").lora_merge
    for flags, words in (
        (["--lora-merge"], "--lora-merge"),
        (["--lora", str(a), "--lora-merge", "--lora-dir", str(tmp_path)], "--lora-dir"),
        (["--lora-dir", str(a)], "--lora-dir"),
        (["--lora", str(a), "--lora", f"a={b}"], "two adapters are named 'a'"),
        (["--max-lora-memory", "huge"], "--max-lora-memory"),
    ):
        with pytest.raises(UserError, match=words):
            args(*flags)
    # calibrate-cache has no LoRA flags: its EngineArgs have none.
    calibrate = parser.parse_args(["calibrate-cache", "--model-path", "/m"])
    assert engine_args_from(calibrate).loras == []
