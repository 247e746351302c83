"""XLabs' original single-file FLUX.1 ControlNets (`--controlnet NAME=FILE.safetensors`, x-flux's names): the
tiny XLabs ControlNet of `test_flux_xlabs_controlnet_parity.py`, its weights rewritten here into XLabs'
names (fused `qkv`, `pos_embed_input`, the hint encoder as an `nn.Sequential`'s even indices) as one file,
loads as the same `FluxControlNetModel` with the same state dict as its Diffusers folder, and a request
applying it generates exactly the folder ControlNet's image (same seed). A truncated or foreign file, or
one missing a tensor or with a tensor of another shape, is a `ModelLoadError` naming the key; a family
without single-file layouts refuses the file, naming itself.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from diffserve import DiffGenerator
from diffserve.configs.engine_args import ControlNetSpec, controlnet_specs
from diffserve.errors import ModelLoadError, UserError
from diffserve.families.flux.tiny import TinyFluxSpec, build_tiny_flux
from diffserve.families.flux.tiny_controlnet import TinyFluxControlNetSpec, build_tiny_flux_controlnet
from diffserve.families.qwen_image.pipeline import QwenImagePipeline
from diffserve.families.sd3.pipeline import SD3Pipeline
from diffserve.loader.controlnets import load_controlnets
from diffserve.testing.parity import smooth_random_image, stack_uint8

PROMPT = "a fox in the snow"
HEIGHT, WIDTH = 48, 80
KW = dict(num_inference_steps=2, max_sequence_length=16, guidance_scale=3.5)
EDGES = smooth_random_image(WIDTH, HEIGHT, seed=11)

#: Diffusers double-block module -> x-flux `DoubleStreamBlock` module (the un-fused ones).
_DOUBLE = {
    "attn.to_out.0": "img_attn.proj",
    "attn.to_add_out": "txt_attn.proj",
    "ff.net.0.proj": "img_mlp.0",
    "ff.net.2": "img_mlp.2",
    "ff_context.net.0.proj": "txt_mlp.0",
    "ff_context.net.2": "txt_mlp.2",
    "norm1.linear": "img_mod.lin",
    "norm1_context.linear": "txt_mod.lin",
}
#: Diffusers QK RMSNorm -> x-flux's (a `scale` parameter).
_NORMS = {
    "attn.norm_q": "img_attn.norm.query_norm",
    "attn.norm_k": "img_attn.norm.key_norm",
    "attn.norm_added_q": "txt_attn.norm.query_norm",
    "attn.norm_added_k": "txt_attn.norm.key_norm",
}
#: Diffusers `time_text_embed` embedder -> x-flux `MLPEmbedder`.
_EMBEDDERS = {
    "timestep_embedder": "time_in",
    "text_embedder": "vector_in",
    "guidance_embedder": "guidance_in",
}
#: `ControlNetConditioningEmbedding`'s convs in order; x-flux's Sequential puts a SiLU after each but the last.
_HINT_CONVS = ["conv_in", *(f"blocks.{k}" for k in range(6)), "conv_out"]


def to_xlabs(diffusers_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Diffusers-layout XLabs ControlNet's state dict in XLabs' original names (every tensor used)."""
    state = dict(diffusers_state)
    out: dict[str, torch.Tensor] = {}

    def move(ours: str, theirs: str) -> None:
        for param in ("weight", "bias"):
            if f"{ours}.{param}" in state:
                out[f"{theirs}.{param}"] = state.pop(f"{ours}.{param}")

    def fuse(ours: list[str], theirs: str) -> None:
        for param in ("weight", "bias"):
            out[f"{theirs}.{param}"] = torch.cat([state.pop(f"{name}.{param}") for name in ours])

    move("x_embedder", "img_in")
    move("context_embedder", "txt_in")
    for ours, theirs in _EMBEDDERS.items():
        move(f"time_text_embed.{ours}.linear_1", f"{theirs}.in_layer")
        move(f"time_text_embed.{ours}.linear_2", f"{theirs}.out_layer")
    block = 0
    while f"transformer_blocks.{block}.attn.to_q.weight" in state:
        ours, theirs = f"transformer_blocks.{block}", f"double_blocks.{block}"
        fuse([f"{ours}.attn.to_{p}" for p in "qkv"], f"{theirs}.img_attn.qkv")
        fuse([f"{ours}.attn.add_{p}_proj" for p in "qkv"], f"{theirs}.txt_attn.qkv")
        for mine, xflux in _DOUBLE.items():
            move(f"{ours}.{mine}", f"{theirs}.{xflux}")
        for mine, xflux in _NORMS.items():
            out[f"{theirs}.{xflux}.scale"] = state.pop(f"{ours}.{mine}.weight")
        move(f"controlnet_blocks.{block}", f"controlnet_blocks.{block}")
        block += 1
    move("controlnet_x_embedder", "pos_embed_input")
    for position, conv in enumerate(_HINT_CONVS):
        move(f"input_hint_block.{conv}", f"input_hint_block.{2 * position}")
    assert not state, f"left unconverted: {sorted(state)}"
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-flux-xlabs-single-file")
    flux = TinyFluxSpec(seed=0)
    folder = build_tiny_flux(root / "flux", flux)
    xlabs = build_tiny_flux_controlnet(
        root / "xlabs", TinyFluxControlNetSpec(flux, num_layers=2, num_single_layers=0, xlabs=True, seed=3)
    )
    original = to_xlabs(load_file(str(xlabs / "diffusion_pytorch_model.safetensors")))
    file = root / "flux-canny-controlnet.safetensors"
    save_file(original, str(file))
    ours = DiffGenerator.from_pretrained(
        folder, device="cpu", show_progress=False, controlnets=[f"x={file}", f"folder={xlabs}"]
    )
    return ours, original, root


def test_the_file_loads_as_the_folders_controlnet(setup) -> None:
    ours, _, _ = setup
    from_file, from_folder = ours.pipeline.controlnets["x"], ours.pipeline.controlnets["folder"]
    assert type(from_file) is type(from_folder)
    assert from_file.config == from_folder.config and from_file.config.reads_pixels
    file_state, folder_state = from_file.state_dict(), from_folder.state_dict()
    assert list(file_state) == list(folder_state)
    for key, value in folder_state.items():
        assert file_state[key].dtype == value.dtype and torch.equal(file_state[key], value), key


def test_a_request_applying_the_file_generates_the_folders_image(setup) -> None:
    ours, _, _ = setup

    def generate(**kwargs) -> np.ndarray:
        out = ours.generate(prompt=PROMPT, seed=5, height=HEIGHT, width=WIDTH, **KW, **kwargs)
        return stack_uint8(out.images)

    got = generate(controlnets=[{"name": "x", "image": EDGES, "scale": 0.9}])
    want = generate(controlnets=[{"name": "folder", "image": EDGES, "scale": 0.9}])
    np.testing.assert_array_equal(got, want)
    assert np.abs(got.astype(int) - generate().astype(int)).max() > 8  # the ControlNet acts


def _without(state: dict, prefix: str) -> dict:
    return {k: v for k, v in state.items() if not k.startswith(prefix)}


def _reshaped(state: dict, key: str) -> dict:
    rows, cols = state[key].shape
    return {**state, key: torch.zeros(rows, cols * 2)}


#: (case, how the file's tensors change, what the error must name).
BROKEN = [
    ("hint-conv-missing", lambda s: _without(s, "input_hint_block.6."), r"input_hint_block\.6\.bias, input_hint_block\.6\.weight"),
    ("last-hint-conv-missing", lambda s: _without(s, "input_hint_block.14."), r"missing key 'input_hint_block\.14\.weight'"),
    ("head-missing", lambda s: _without(s, "controlnet_blocks.1."), r"missing keys: controlnet_blocks\.1\.bias"),
    (
        "dit-part-only",  # what a BFL FLUX.1 DiT single file holds: no hint encoder
        lambda s: {k: v for k, v in s.items() if k.startswith(("img_in", "txt_in", "time_in", "vector_in", "double_blocks"))},
        r"this one lacks 'input_hint_block\.0\.weight'",
    ),
    ("unexpected", lambda s: {**s, "double_blocks.0.extra.weight": torch.zeros(2)}, r"unexpected keys: double_blocks\.0\.extra\.weight"),
    ("other-width", lambda s: _reshaped(s, "pos_embed_input.weight"), r"'controlnet_x_embedder\.weight' \(from 'pos_embed_input\.weight'\) has shape"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("change", "message"), [case[1:] for case in BROKEN], ids=[case[0] for case in BROKEN]
)
def test_a_file_that_does_not_fit_is_refused_naming_the_key(setup, tmp_path, change, message) -> None:
    ours, original, _ = setup
    file = tmp_path / "broken.safetensors"
    save_file(change(original), str(file))
    with pytest.raises(ModelLoadError, match=message):
        load_controlnets([ControlNetSpec("bad", str(file))], None, ours.pipeline, "flux", None, torch.float32)
    assert "bad" not in ours.pipeline.controlnets


def test_a_truncated_file_is_refused(setup, tmp_path) -> None:
    ours, _, root = setup
    data = (root / "flux-canny-controlnet.safetensors").read_bytes()
    file = tmp_path / "truncated.safetensors"
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        load_controlnets([ControlNetSpec("cut", str(file))], None, ours.pipeline, "flux", None, torch.float32)


@pytest.mark.parametrize(("pipeline", "family"), [(SD3Pipeline, "sd3"), (QwenImagePipeline, "qwen-image")])
def test_a_family_without_single_file_layouts_refuses_the_file(setup, pipeline, family) -> None:
    _, _, root = setup
    assert pipeline.controlnet_classes  # it takes ControlNet folders
    spec = ControlNetSpec("x", str(root / "flux-canny-controlnet.safetensors"))
    with pytest.raises(
        UserError, match=f"the {family} family loads ControlNets from Diffusers model folders only"
    ):
        load_controlnets(
            [spec], None, pipeline, family, None, torch.float32
        )  # (its class: no instance needed)


def test_the_option_takes_a_safetensors_file(setup, tmp_path: Path) -> None:
    _, _, root = setup
    file = root / "flux-canny-controlnet.safetensors"
    assert controlnet_specs([str(file)]) == [ControlNetSpec("flux-canny-controlnet", str(file))]
    other = tmp_path / "controlnet.bin"
    other.write_bytes(b"")
    with pytest.raises(UserError, match=r"neither a directory .* nor a \.safetensors file"):
        controlnet_specs([f"x={other}"])
