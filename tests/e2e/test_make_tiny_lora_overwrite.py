"""Issue 31 item 1: `make-tiny` and `make-lora` never write over what is there (a model folder's weights, a
LoRA file) unless `--force`: one `error:` line naming what is there, exit code 2, nothing touched; and
`make-lora` writes its file with the user's umask (safetensors alone writes 0600)."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from diffserve.cli.main import main

PRECIOUS = b"precious"


@pytest.fixture
def run_cli(capfd):
    def run(*args: str) -> tuple[int, str]:
        code = main(list(args))
        return code, capfd.readouterr().err

    return run


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def flux_folder(root: Path) -> Path:
    """What the issue's reproduction makes: a FLUX folder with its (precious) DiT weights."""
    (root / "transformer").mkdir(parents=True)
    (root / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    (root / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(PRECIOUS)
    return root


def one_error_line(code: int, err: str) -> str:
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.mark.parametrize("family", ["flux", "sd3"])  # the same family, and another one over it
def test_make_tiny_refuses_a_model_folder(tmp_path, run_cli, family: str) -> None:
    folder = flux_folder(tmp_path / "D")
    line = one_error_line(*run_cli("make-tiny", family, str(folder)))
    assert "is not empty" in line and "FluxPipeline model folder" in line, line
    assert "model_index.json" in line and "transformer" in line and "--force" in line, line
    assert (folder / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes() == PRECIOUS
    assert json.loads((folder / "model_index.json").read_text()) == {"_class_name": "FluxPipeline"}
    assert sorted(p.name for p in folder.iterdir()) == ["model_index.json", "transformer"]


def test_make_tiny_refuses_any_non_empty_folder_and_a_file(tmp_path, run_cli) -> None:
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "todo.txt").write_text("x")
    line = one_error_line(*run_cli("make-tiny", "flux", str(folder)))
    assert "is not empty: it holds todo.txt;" in line, line
    a_file = tmp_path / "file"
    a_file.write_text("x")
    line = one_error_line(*run_cli("make-tiny", "flux", str(a_file)))
    assert "exists and is not a folder" in line and a_file.read_text() == "x", line


def test_make_tiny_writes_into_an_empty_folder_and_over_one_with_force(tmp_path, run_cli, umask_022) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    code, err = run_cli("make-tiny", "flux", str(empty), "--no-guidance-embeds")
    assert code == 0, err
    assert json.loads((empty / "model_index.json").read_text())["_class_name"] == "FluxPipeline"

    folder = flux_folder(tmp_path / "D")
    (folder / "mine.txt").write_text("kept")
    (folder / "mine.txt").chmod(0o600)
    code, err = run_cli("make-tiny", "flux", str(folder), "--no-guidance-embeds", "--force")
    assert code == 0, err
    weights = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    assert weights.read_bytes() != PRECIOUS and weights.stat().st_size > 1000
    assert stat.S_IMODE(weights.stat().st_mode) == 0o644
    # a file of the folder that the build did not write keeps its mode
    assert stat.S_IMODE((folder / "mine.txt").stat().st_mode) == 0o600


def test_make_lora_refuses_an_existing_file(tmp_path, run_cli) -> None:
    out = tmp_path / "existing.safetensors"
    out.write_bytes(PRECIOUS)
    line = one_error_line(*run_cli("make-lora", str(out)))
    assert "exists (8 bytes)" in line and "--force" in line and str(out) in line, line
    assert out.read_bytes() == PRECIOUS


def test_make_lora_with_force_replaces_it_with_the_umask_mode(tmp_path, run_cli, umask_022) -> None:
    out = tmp_path / "existing.safetensors"
    out.write_bytes(PRECIOUS)
    code, err = run_cli("make-lora", str(out), "--force")
    assert code == 0, err
    assert out.read_bytes() != PRECIOUS
    assert stat.S_IMODE(out.stat().st_mode) == 0o644
    fresh = tmp_path / "loras" / "fresh.safetensors"
    code, err = run_cli("make-lora", str(fresh), "--seed", "1")
    assert code == 0, err
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o644
