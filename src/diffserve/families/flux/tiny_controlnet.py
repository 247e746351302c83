"""Builder of small random-weight FLUX.1 ControlNets in the Diffusers `FluxControlNetModel` layout (a model
folder: config.json and diffusion_pytorch_model.safetensors), matching a tiny FLUX folder's DiT
(`families/flux/tiny.py`). Its zero-initialised parts (the residual heads, the control embedder) are random
here, so that the control image changes the output. Used by the tests and `diffserve make-tiny
flux-controlnet`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from diffserve.families.flux.tiny import TinyFluxSpec, build_tiny_flux
from diffserve.models.controlnets.flux import FluxControlNetModel
from diffserve.testing.tiny_writing import save_diffusers_model, write_json

#: Factor on the control embedder's random weights.
CONTROL_GAIN = 4.0
#: Factor on an XLabs hint encoder's convolutions (all but the last).
HINT_GAIN = 3.0


@dataclass
class TinyFluxControlNetSpec:
    """A tiny ControlNet for the tiny FLUX DiT of `flux`: its own block counts, `num_mode` for Union, and
    `xlabs` for XLabs' layout."""

    flux: TinyFluxSpec
    num_layers: int = 1
    num_single_layers: int = 1
    num_mode: int | None = None
    #: XLabs' layout: a pixel-space hint encoder (`conditioning_embedding_channels`) and 2x2 patches.
    xlabs: bool = False
    seed: int = 0


def build_tiny_flux_controlnet(out_dir: str | Path, spec: TinyFluxControlNetSpec) -> Path:
    """Write a random-weight `FluxControlNetModel` folder to `out_dir` and return its path."""
    flux = spec.flux
    config = {
        "patch_size": 1,
        "in_channels": flux.latent_channels * 4,
        "num_layers": spec.num_layers,
        "num_single_layers": spec.num_single_layers,
        "attention_head_dim": flux.attention_head_dim,
        "num_attention_heads": flux.num_attention_heads,
        "joint_attention_dim": flux.text_hidden_size,
        "pooled_projection_dim": flux.text_hidden_size,
        "guidance_embeds": flux.guidance_embeds,
        "axes_dims_rope": list(flux.axes_dims_rope),
        "num_mode": spec.num_mode,
        "conditioning_embedding_channels": None,
    }
    if spec.xlabs:  # the hint's channels x 2x2 patches fill a token, as the latents' do
        config.update(patch_size=2, conditioning_embedding_channels=flux.latent_channels)
    torch.manual_seed(spec.seed)
    model = FluxControlNetModel.from_config(config)
    with torch.no_grad():  # a stronger control embedding, so that the control image clearly matters
        model.controlnet_x_embedder.weight.mul_(CONTROL_GAIN)
        if model.input_hint_block is not None:  # its default init all but erases the image
            for conv in (model.input_hint_block.conv_in, *model.input_hint_block.blocks):
                conv.weight.mul_(HINT_GAIN)
    root = Path(out_dir)
    save_diffusers_model(model, root, "FluxControlNetModel", config)
    return root


def build_tiny_flux_controlnet_for(out_dir: str | Path, flux: TinyFluxSpec) -> Path:
    """`diffserve make-tiny flux-controlnet DIR`: a ControlNet for the tiny FLUX.1 folder that `make-tiny
    flux` writes with the same options (its DiT's shapes and guidance embedding), seeded by `flux.seed`."""
    return build_tiny_flux_controlnet(out_dir, TinyFluxControlNetSpec(flux, seed=flux.seed))


def build_tiny_flux_controlnet_pipeline(out_dir: str | Path, spec: TinyFluxControlNetSpec) -> Path:
    """Write a random-weight `FluxControlNetPipeline` folder (a tiny FLUX.1 folder with a `controlnet`
    component) to `out_dir` and return its path."""
    root = build_tiny_flux(out_dir, spec.flux)
    build_tiny_flux_controlnet(root / "controlnet", spec)
    index = json.loads((root / "model_index.json").read_text())
    index["_class_name"] = "FluxControlNetPipeline"
    index["controlnet"] = ["diffusers", "FluxControlNetModel"]
    write_json(root / "model_index.json", index)
    return root
