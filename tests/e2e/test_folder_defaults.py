"""A model folder's diffserve.json sets sampling defaults (the demo model uses it); request values still win."""

from __future__ import annotations

import json
import shutil

import pytest

from diffserve import DiffGenerator
from diffserve.errors import ModelLoadError


@pytest.fixture(scope="module")
def folder_with_defaults(tiny_flux_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("with-defaults") / "model"
    shutil.copytree(tiny_flux_dir, root)
    (root / "diffserve.json").write_text(
        json.dumps(
            {
                "sampling_defaults": {
                    "height": 32,
                    "width": 48,
                    "num_inference_steps": 2,
                    "guidance_scale": None,
                }
            }
        )
    )
    return root


def test_folder_defaults_apply_and_request_overrides_them(folder_with_defaults) -> None:
    gen = DiffGenerator.from_pretrained(folder_with_defaults, device="cpu", show_progress=False)
    out = gen.generate(prompt="a fox", seed=1)
    assert out.images[0].size == (48, 32)
    assert len(out.step_times) == 2
    assert out.params.guidance_scale == 3.5, "a null default keeps the family's default"
    out = gen.generate(prompt="a fox", seed=1, height=16, num_inference_steps=1)
    assert out.images[0].size == (48, 16) and len(out.step_times) == 1


def test_unknown_default_key_is_refused(folder_with_defaults, tmp_path) -> None:
    root = tmp_path / "bad"
    shutil.copytree(folder_with_defaults, root)
    (root / "diffserve.json").write_text(json.dumps({"sampling_defaults": {"hieght": 32}}))
    with pytest.raises(ModelLoadError, match="unknown sampling_defaults keys"):
        DiffGenerator.from_pretrained(root, device="cpu", show_progress=False)
