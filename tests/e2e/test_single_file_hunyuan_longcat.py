"""`--transformer-weights` for HunyuanImage 2.1 and LongCat-Image: single files in the layouts published
for them load into the same DiT as the folder's `transformer/` weights.

- HunyuanImage 2.1: Tencent's original names (the released `dit/hunyuanimage2.1*.safetensors`: q, k, v
  apart, `linear2.fc`; and the fused HunyuanVideo layout Tencent's code also reads: `img_attn_qkv`,
  `linear1`, `linear2`), in ComfyUI's `model.diffusion_model.` prefix, and Diffusers' names.
- LongCat-Image: FLUX.1's BFL names (ComfyUI's / Comfy-Org's files) and Diffusers' names (Meituan's).

The original-name files are written here from Diffusers' conversion scripts' mapping, inverted by hand
(not from diffserve's plans), so the loader is checked against an independent statement of the layout.
A file of the other family, or one missing a tensor, is a `ModelLoadError` naming the keys.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from diffserve import DiffGenerator
from diffserve.errors import ModelLoadError
from diffserve.families.hunyuan_image.tiny import TinyHunyuanImageSpec, build_tiny_hunyuan_image
from diffserve.families.longcat_image.tiny import TinyLongCatImageSpec, build_tiny_longcat_image
from diffserve.loader.single_file import dequantized_at_load, load_transformer_weights_file
from diffserve.models.dits.hunyuan_image import HunyuanImageTransformer2DModel
from diffserve.models.dits.longcat_image import LongCatImageTransformer2DModel
from diffserve.registry import DIT_FACTS
from diffserve.testing.tiny_single_file import original_state_dict, write_gguf

COMFY = "model.diffusion_model."
REQUEST = dict(prompt="a red fox in the snow", seed=7, height=64, width=64, num_inference_steps=2)


class _Used(dict):
    """A Diffusers state dict that records which names an inverse reads (all must be read)."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__(state)
        self.used: set[str] = set()

    def __getitem__(self, key: str) -> torch.Tensor:
        self.used.add(key)
        return super().__getitem__(key)

    def check_all_used(self) -> None:
        left = sorted(set(self) - self.used)
        assert not left, f"the test's inverse forgot: {left}"


def _indices(sd: dict, prefix: str) -> list[int]:
    return sorted({int(k[len(prefix) :].split(".")[0]) for k in sd if k.startswith(prefix)})


def _params(out: dict, sd: dict, diffusers: str, original: str) -> None:
    for param in ("weight", "bias"):
        if f"{diffusers}.{param}" in sd:
            out[f"{original}.{param}"] = sd[f"{diffusers}.{param}"]


def _cat(out: dict, sd: dict, parts: list[str], original: str) -> None:
    for param in ("weight", "bias"):
        if f"{parts[0]}.{param}" in sd:
            out[f"{original}.{param}"] = torch.cat([sd[f"{p}.{param}"] for p in parts])


def _swapped(t: torch.Tensor) -> torch.Tensor:
    scale, shift = t.chunk(2)
    return torch.cat([shift, scale])


# --------------------------------------------------------------------------- the inverses


def hunyuan_original(state: dict[str, torch.Tensor], fused: bool = False) -> dict[str, torch.Tensor]:
    """Diffusers' `HunyuanImageTransformer2DModel` names -> Tencent's (the inverse of Diffusers'
    `convert_hunyuan_image_transformer_checkpoint_to_diffusers`); `fused`: the HunyuanVideo layout."""
    sd, out = _Used(state), {}
    top = [
        ("x_embedder.proj", "img_in.proj"),
        ("context_embedder.proj_in", "txt_in.input_embedder"),
        ("context_embedder.time_text_embed.timestep_embedder.linear_1", "txt_in.t_embedder.mlp.0"),
        ("context_embedder.time_text_embed.timestep_embedder.linear_2", "txt_in.t_embedder.mlp.2"),
        ("context_embedder.time_text_embed.text_embedder.linear_1", "txt_in.c_embedder.linear_1"),
        ("context_embedder.time_text_embed.text_embedder.linear_2", "txt_in.c_embedder.linear_2"),
        ("context_embedder_2.norm", "byt5_in.layernorm"),
        ("context_embedder_2.linear_1", "byt5_in.fc1"),
        ("context_embedder_2.linear_2", "byt5_in.fc2"),
        ("context_embedder_2.linear_3", "byt5_in.fc3"),
        ("time_guidance_embed.timestep_embedder.linear_1", "time_in.mlp.0"),
        ("time_guidance_embed.timestep_embedder.linear_2", "time_in.mlp.2"),
        ("time_guidance_embed.timestep_embedder_r.linear_1", "time_r_in.mlp.0"),
        ("time_guidance_embed.timestep_embedder_r.linear_2", "time_r_in.mlp.2"),
        ("time_guidance_embed.guidance_embedder.linear_1", "guidance_in.mlp.0"),
        ("time_guidance_embed.guidance_embedder.linear_2", "guidance_in.mlp.2"),
        ("proj_out", "final_layer.linear"),
    ]
    for diffusers, original in top:
        _params(out, sd, diffusers, original)
    for param in ("weight", "bias"):
        out[f"final_layer.adaLN_modulation.1.{param}"] = _swapped(sd[f"norm_out.linear.{param}"])

    refiner = "context_embedder.token_refiner.refiner_blocks."
    for i in _indices(sd, refiner):
        d, o = f"{refiner}{i}.", f"txt_in.individual_token_refiner.blocks.{i}."
        for diffusers, original in [
            ("norm1", "norm1"),
            ("norm2", "norm2"),
            ("attn.to_out.0", "self_attn_proj"),
            ("ff.net.0.proj", "mlp.fc1"),
            ("ff.net.2", "mlp.fc2"),
            ("norm_out.linear", "adaLN_modulation.1"),
        ]:
            _params(out, sd, d + diffusers, o + original)
        _cat(out, sd, [f"{d}attn.to_{x}" for x in "qkv"], f"{o}self_attn_qkv")

    for i in _indices(sd, "transformer_blocks."):
        d, o = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        for diffusers, original in [
            ("norm1.linear", "img_mod.linear"),
            ("norm1_context.linear", "txt_mod.linear"),
            ("attn.norm_q", "img_attn_q_norm"),
            ("attn.norm_k", "img_attn_k_norm"),
            ("attn.norm_added_q", "txt_attn_q_norm"),
            ("attn.norm_added_k", "txt_attn_k_norm"),
            ("attn.to_out.0", "img_attn_proj"),
            ("attn.to_add_out", "txt_attn_proj"),
            ("ff.net.0.proj", "img_mlp.fc1"),
            ("ff.net.2", "img_mlp.fc2"),
            ("ff_context.net.0.proj", "txt_mlp.fc1"),
            ("ff_context.net.2", "txt_mlp.fc2"),
        ]:
            _params(out, sd, d + diffusers, o + original)
        image = [f"{d}attn.to_{x}" for x in "qkv"]
        text = [f"{d}attn.add_{x}_proj" for x in "qkv"]
        if fused:
            _cat(out, sd, image, f"{o}img_attn_qkv")
            _cat(out, sd, text, f"{o}txt_attn_qkv")
        else:
            for x, i_part, t_part in zip("qkv", image, text, strict=True):
                _params(out, sd, i_part, f"{o}img_attn_{x}")
                _params(out, sd, t_part, f"{o}txt_attn_{x}")

    for i in _indices(sd, "single_transformer_blocks."):
        d, o = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        _params(out, sd, f"{d}norm.linear", f"{o}modulation.linear")
        _params(out, sd, f"{d}attn.norm_q", f"{o}q_norm")
        _params(out, sd, f"{d}attn.norm_k", f"{o}k_norm")
        parts = [f"{d}attn.to_{x}" for x in "qkv"] + [f"{d}proj_mlp"]
        if fused:
            _cat(out, sd, parts, f"{o}linear1")
            _params(out, sd, f"{d}proj_out", f"{o}linear2")
        else:
            for part, suffix in zip(parts, ("q", "k", "v", "mlp"), strict=True):
                _params(out, sd, part, f"{o}linear1_{suffix}")
            _params(out, sd, f"{d}proj_out", f"{o}linear2.fc")
    sd.check_all_used()
    return out


# --------------------------------------------------------------------------- folders and loading

BUILDERS = {
    # The distilled variant: its MeanFlow and guidance embedders are in the file too.
    "hunyuan": (
        HunyuanImageTransformer2DModel,
        lambda p: build_tiny_hunyuan_image(p, TinyHunyuanImageSpec(distilled=True)),
    ),
    "longcat": (
        LongCatImageTransformer2DModel,
        lambda p: build_tiny_longcat_image(p, TinyLongCatImageSpec()),
    ),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hunyuan-longcat")
    return {name: build(root / name) for name, (_, build) in BUILDERS.items()}


def _state(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "transformer" / "diffusion_pytorch_model.safetensors"))


def _save(state: dict[str, torch.Tensor], path: Path) -> Path:
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    return path


def _load(name: str, folder: Path, path: Path) -> dict[str, torch.Tensor]:
    dit_class = BUILDERS[name][0]
    config = json.loads((folder / "transformer" / "config.json").read_text())
    with torch.device("meta"):
        module = dit_class.from_config(config)
    load_transformer_weights_file(
        module, path, dit_class.diffusers_class_name, torch.device("cpu"), torch.float32, DIT_FACTS
    )
    return module.state_dict()


def _assert_same(loaded: dict[str, torch.Tensor], folder: dict[str, torch.Tensor]) -> None:
    assert loaded.keys() == folder.keys()
    different = [k for k in folder if not torch.equal(loaded[k], folder[k])]
    assert not different, f"tensors differ from the folder's: {different}"


def _image(folder: Path, weights: Path | None = None) -> np.ndarray:
    gen = DiffGenerator.from_pretrained(
        folder, device="cpu", show_progress=False, transformer_weights=weights
    )
    return np.stack([np.asarray(im) for im in gen.generate(**REQUEST).images])


# --------------------------------------------------------------------------- tests

LAYOUTS = {
    ("hunyuan", "tencent"): lambda sd: hunyuan_original(sd),
    ("hunyuan", "tencent-fused"): lambda sd: hunyuan_original(sd, fused=True),
    ("hunyuan", "diffusers"): dict,
    ("longcat", "bfl"): lambda sd: original_state_dict("LongCatImageTransformer2DModel", sd),
    ("longcat", "diffusers"): dict,
}


@pytest.mark.parametrize(("name", "layout"), list(LAYOUTS))
@pytest.mark.parametrize("prefix", ["", COMFY])
def test_single_file_gives_the_folder_state_dict(folders, tmp_path, name, layout, prefix) -> None:
    state = _state(folders[name])
    stored = {prefix + k: v for k, v in LAYOUTS[name, layout](state).items()}
    if prefix:  # an all-in-one ComfyUI file: the VAE's tensors are not the DiT's
        stored["first_stage_model.decoder.conv_in.weight"] = torch.zeros(4, 4)
    _assert_same(_load(name, folders[name], _save(stored, tmp_path / "dit.safetensors")), state)


@pytest.mark.parametrize(("name", "layout"), [("hunyuan", "tencent"), ("longcat", "bfl")])
def test_original_names_give_the_folder_image(folders, tmp_path, name, layout) -> None:
    folder = folders[name]
    stored = {COMFY + k: v for k, v in LAYOUTS[name, layout](_state(folder)).items()}
    reference = _image(folder)
    assert reference.std() > 5, "the reference image is flat; the comparison would prove nothing"
    assert np.array_equal(_image(folder, _save(stored, tmp_path / "dit.safetensors")), reference)


def test_the_final_adaln_halves_matter(folders, tmp_path) -> None:
    """Calibration: a file whose final AdaLN is stored in Diffusers' order, not Tencent's, loads wrong."""
    state = _state(folders["hunyuan"])
    stored = hunyuan_original(state)
    stored["final_layer.adaLN_modulation.1.weight"] = state["norm_out.linear.weight"]
    loaded = _load("hunyuan", folders["hunyuan"], _save(stored, tmp_path / "dit.safetensors"))
    assert not torch.equal(loaded["norm_out.linear.weight"], state["norm_out.linear.weight"])


def test_a_file_of_the_other_family_names_the_keys(folders, tmp_path) -> None:
    hunyuan_file = _save(hunyuan_original(_state(folders["hunyuan"])), tmp_path / "hunyuan.safetensors")
    with pytest.raises(ModelLoadError) as info:
        _load("longcat", folders["longcat"], hunyuan_file)
    message = str(info.value)
    for part in (
        "LongCatImageTransformer2DModel",
        "looks like a HunyuanImage 2.1 checkpoint, not LongCat-Image",
        "missing keys: ",
        "unexpected keys: ",
        "byt5_in.",
    ):
        assert part in message

    longcat_file = _save(_state(folders["longcat"]), tmp_path / "longcat.safetensors")
    with pytest.raises(ModelLoadError) as info:
        _load("hunyuan", folders["hunyuan"], longcat_file)
    message = str(info.value)
    assert "looks like a LongCat-Image checkpoint, not HunyuanImage 2.1" in message
    assert "unexpected keys: context_embedder.bias, context_embedder.weight" in message


@pytest.mark.parametrize(
    ("name", "layout", "dropped", "named"),
    [
        (
            "hunyuan",
            "tencent",
            "single_blocks.0.linear1_mlp.weight",
            "single_transformer_blocks.0.proj_mlp.weight",
        ),
        (
            "hunyuan",
            "tencent-fused",
            "double_blocks.0.img_attn_qkv.bias",
            "transformer_blocks.0.attn.to_k.bias, transformer_blocks.0.attn.to_q.bias",
        ),
        ("hunyuan", "diffusers", "norm_out.linear.bias", "norm_out.linear.bias"),
        ("longcat", "bfl", "time_in.in_layer.weight", "time_embed.timestep_embedder.linear_1.weight"),
    ],
)
def test_a_missing_tensor_is_named(folders, tmp_path, name, layout, dropped, named) -> None:
    """The model tensor the file lacks is named (in Diffusers' names, as the loader reads every layout)."""
    stored = LAYOUTS[name, layout](_state(folders[name]))
    del stored[dropped]
    with pytest.raises(ModelLoadError, match="missing keys: " + re.escape(named)):
        _load(name, folders[name], _save(stored, tmp_path / "dit.safetensors"))


@pytest.mark.parametrize(
    ("name", "layout", "arch"), [("hunyuan", "tencent", "hyvid"), ("longcat", "bfl", "flux")]
)
def test_gguf_q8_0_in_original_names(folders, tmp_path, name, layout, arch) -> None:
    """A GGUF in city96's layout (original names; HunyuanImage's converted as "hyvid") loads, its Q8_0
    weights within Q8_0's rounding of the folder's."""
    pytest.importorskip("gguf", reason="the gguf package is needed for .gguf checkpoints")
    state = _state(folders[name])
    path = tmp_path / "dit.gguf"
    types = write_gguf(path, LAYOUTS[name, layout](state), "Q8_0", arch)
    assert "Q8_0" in types.values()
    with dequantized_at_load():
        loaded = _load(name, folders[name], path)
    assert loaded.keys() == state.keys()
    for key, want in state.items():
        error = (loaded[key] - want).abs().max() / want.abs().max().clamp_min(1e-12)
        assert error < 1e-2, f"{key}: relative error {error:.3g}"
