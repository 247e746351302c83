"""Streaming safetensors into meta-built modules: single files, sharded indexes, and loud failures."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from diffserve.errors import ModelLoadError
from diffserve.loader.model_index import read_model_index
from diffserve.loader.safetensors_weights import find_weight_files, load_safetensors_into


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(3, 2, bias=False)


def _reference_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.detach().clone() for k, v in Toy().state_dict().items()}


def _meta_toy() -> Toy:
    with torch.device("meta"):
        return Toy()


def test_single_file_loads_every_tensor(tmp_path) -> None:
    state = _reference_state()
    save_file(state, str(tmp_path / "diffusion_pytorch_model.safetensors"))
    module = _meta_toy()
    n_bytes = load_safetensors_into(module, find_weight_files(tmp_path), torch.device("cpu"), torch.float32)
    assert n_bytes == sum(t.numel() * 4 for t in state.values())
    for key, value in module.state_dict().items():
        assert torch.equal(value, state[key])


def test_sharded_index_loads_and_casts_dtype(tmp_path) -> None:
    state = _reference_state()
    save_file(
        {"a.weight": state["a.weight"], "a.bias": state["a.bias"]},
        str(tmp_path / "m-00001-of-00002.safetensors"),
    )
    save_file({"b.weight": state["b.weight"]}, str(tmp_path / "m-00002-of-00002.safetensors"))
    weight_map = {
        "a.weight": "m-00001-of-00002.safetensors",
        "a.bias": "m-00001-of-00002.safetensors",
        "b.weight": "m-00002-of-00002.safetensors",
    }
    (tmp_path / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"weight_map": weight_map})
    )
    files = find_weight_files(tmp_path)
    assert [f.name for f in files] == ["m-00001-of-00002.safetensors", "m-00002-of-00002.safetensors"]
    module = _meta_toy()
    load_safetensors_into(module, files, torch.device("cpu"), torch.bfloat16)
    assert module.b.weight.dtype == torch.bfloat16
    assert torch.equal(module.b.weight, state["b.weight"].to(torch.bfloat16))


def test_missing_and_unexpected_keys_are_named(tmp_path) -> None:
    state = _reference_state()
    del state["b.weight"]
    state["c.weight"] = torch.zeros(1)
    save_file(state, str(tmp_path / "diffusion_pytorch_model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing keys: b\.weight.*unexpected keys: c\.weight"):
        load_safetensors_into(_meta_toy(), find_weight_files(tmp_path), torch.device("cpu"), torch.float32)


def test_shape_mismatch_names_the_tensor(tmp_path) -> None:
    state = _reference_state()
    state["a.weight"] = torch.zeros(5, 4)
    save_file(state, str(tmp_path / "diffusion_pytorch_model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"'a\.weight' has shape \(5, 4\).*expects \(3, 4\)"):
        load_safetensors_into(_meta_toy(), find_weight_files(tmp_path), torch.device("cpu"), torch.float32)


def test_truncated_file_is_reported(tmp_path) -> None:
    path = tmp_path / "diffusion_pytorch_model.safetensors"
    save_file(_reference_state(), str(path))
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        load_safetensors_into(_meta_toy(), find_weight_files(tmp_path), torch.device("cpu"), torch.float32)


def test_bin_only_folder_says_safetensors_needed(tmp_path) -> None:
    (tmp_path / "diffusion_pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="only .safetensors"):
        find_weight_files(tmp_path)


def test_missing_shard_is_named(tmp_path) -> None:
    (tmp_path / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a.weight": "gone.safetensors"}})
    )
    with pytest.raises(ModelLoadError, match="gone.safetensors"):
        find_weight_files(tmp_path)


def test_model_index_skips_null_components(tmp_path) -> None:
    (tmp_path / "model_index.json").write_text(
        json.dumps(
            {
                "_class_name": "FluxPipeline",
                "_diffusers_version": "0.30.0",
                "vae": ["diffusers", "AutoencoderKL"],
                "image_encoder": [None, None],
                "force_zeros_for_empty_prompt": True,
            }
        )
    )
    index = read_model_index(tmp_path)
    assert index.pipeline_class_name == "FluxPipeline"
    assert list(index.components) == ["vae"]


def test_model_index_errors(tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="not a directory"):
        read_model_index(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="no model_index.json"):
        read_model_index(tmp_path)
    (tmp_path / "model_index.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        read_model_index(tmp_path)
