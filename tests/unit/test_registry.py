"""The family registry (`diffserve.registry`): one record per family, read by the loader and `make-tiny`."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from diffserve.cli.main import main
from diffserve.errors import ModelLoadError, UserError
from diffserve.registry import FAMILIES, REGISTRY, family_by_name, family_names, resolve_family


def test_names_and_pipelines_are_unique_and_aliases_resolve_to_one_family() -> None:
    names = family_names()
    assert len(set(names)) == len(names) == len(FAMILIES) == len(REGISTRY)
    spellings = [spelling for family in FAMILIES for spelling in (family.name, *family.aliases)]
    assert len(set(spellings)) == len(spellings)
    assert family_by_name("zimage") is family_by_name("z_image") is family_by_name("z-image")
    assert family_by_name("z-image") is resolve_family("ZImagePipeline")
    with pytest.raises(
        UserError, match="unknown model family .kandinsky.; families: flux, flux-kontext, flux-fill, sd3"
    ):
        family_by_name("kandinsky")


@pytest.mark.parametrize("family", FAMILIES, ids=lambda family: family.name)
def test_native_classes_are_keyed_by_the_diffusers_name_each_class_declares(family) -> None:
    tables = (family.native_classes.models, family.native_classes.schedulers)
    for table in tables:
        for class_name, cls in table.items():
            assert cls.diffusers_class_name == class_name
    # A DiT and a VAE; LTX-2 adds its text connectors, audio VAE and vocoders; SANA-Video takes Wan 2.1's
    # VAE (480p folders) or LTX-2's (720p).
    models = {"sana-video": 3}.get(family.name, 6 if family.name.startswith("ltx2") else 2)
    assert len(family.native_classes.models) == models
    assert family.native_classes.schedulers
    assert family.step_cache_policies is family.pipeline_cls.step_cache_policies


def test_a_component_class_the_family_does_not_implement_is_refused_before_loading(
    tiny_flux_dir: Path, tmp_path: Path
) -> None:
    from diffserve import DiffGenerator

    root = tmp_path / "flux"
    shutil.copytree(tiny_flux_dir, root)
    index = json.loads((root / "model_index.json").read_text())
    index["vae"] = ["diffusers", "AutoencoderKLWan"]  # a Wan VAE: natively implemented, but not FLUX's
    (root / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(
        ModelLoadError, match=r"FluxPipeline does not support: 'vae' \(diffusers.AutoencoderKLWan\)"
    ):
        DiffGenerator.from_pretrained(root, device="cpu", show_progress=False)


def test_make_tiny_takes_the_alias_and_writes_the_family_folder(tmp_path: Path) -> None:
    old_umask = os.umask(0o022)
    try:
        assert main(["make-tiny", "zimage", str(tmp_path / "tiny")]) == 0
    finally:
        os.umask(old_umask)
    index = json.loads((tmp_path / "tiny" / "model_index.json").read_text())
    assert index["_class_name"] == family_by_name("z-image").diffusers_pipeline
    # Weights readable by others as every other file (safetensors alone would write them 0600).
    modes = {path.relative_to(tmp_path).as_posix(): path.stat().st_mode & 0o777
             for path in (tmp_path / "tiny").rglob("*") if path.is_file()}  # fmt: skip
    assert modes["tiny/transformer/diffusion_pytorch_model.safetensors"] == 0o644
    assert set(modes.values()) == {0o644}, modes
