"""Builder of small random-weight SD3 ControlNets in the Diffusers `SD3ControlNetModel` layout (a model folder:
config.json and diffusion_pytorch_model.safetensors), matching a tiny SD3 folder's DiT
(`families/sd3/tiny.py`). Its zero-initialised parts (the residual heads, the control patch embedder) are
random here, so that the control image changes the output. Used by the tests."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from diffserve.families.sd3.tiny import TinySD3Spec, build_tiny_sd3
from diffserve.models.controlnets.sd3 import SD3ControlNetModel
from diffserve.testing.tiny_writing import save_diffusers_model, write_json

#: Factor on the control patch embedder's random weights.
CONTROL_GAIN = 4.0


@dataclass
class TinySD3ControlNetSpec:
    """A tiny ControlNet for the tiny SD3 DiT of `sd3`: its own block count, and whether the pipeline hands
    it zeros for the pooled projection (InstantX's, and no VAE shift then)."""

    sd3: TinySD3Spec = field(default_factory=TinySD3Spec)
    num_layers: int = 1
    force_zeros_for_pooled_projection: bool = True
    #: SD3.5-Large's kind: single-stream blocks (no `joint_attention_dim`) on the DiT's positions.
    single_stream: bool = False
    #: The inpainting kind (alimama's): the mask as a 17th control channel (`extra_conditioning_channels`).
    inpainting: bool = False
    seed: int = 0


def build_tiny_sd3_controlnet(out_dir: str | Path, spec: TinySD3ControlNetSpec) -> Path:
    """Write a random-weight `SD3ControlNetModel` folder to `out_dir` and return its path."""
    sd3 = spec.sd3
    config = {
        "sample_size": sd3.sample_size,
        "patch_size": 2,
        "in_channels": 16,
        "num_layers": spec.num_layers,
        "attention_head_dim": sd3.attention_head_dim,
        "num_attention_heads": sd3.num_attention_heads,
        "joint_attention_dim": sd3.t5_hidden_size,
        "caption_projection_dim": sd3.attention_head_dim * sd3.num_attention_heads,
        "pooled_projection_dim": 2 * sd3.clip_hidden_size + 8,
        "out_channels": 16,
        "pos_embed_max_size": sd3.pos_embed_max_size,
        "extra_conditioning_channels": 1 if spec.inpainting else 0,
        "dual_attention_layers": list(sd3.dual_attention_layers),
        "qk_norm": sd3.qk_norm,
        "pos_embed_type": "sincos",
        "use_pos_embed": True,
        "force_zeros_for_pooled_projection": spec.force_zeros_for_pooled_projection,
    }
    if spec.single_stream:  # as Stability's SD3.5-Large ControlNets' configs
        config.update(joint_attention_dim=None, pos_embed_type=None, use_pos_embed=False, qk_norm=None)
        config["dual_attention_layers"] = []
    torch.manual_seed(spec.seed)
    model = SD3ControlNetModel.from_config(config)
    with torch.no_grad():  # a stronger control embedding, so that the control image clearly matters
        model.pos_embed_input.proj.weight.mul_(CONTROL_GAIN)
    root = Path(out_dir)
    save_diffusers_model(model, root, "SD3ControlNetModel", config)
    return root


def build_tiny_sd3_controlnet_pipeline(out_dir: str | Path, spec: TinySD3ControlNetSpec) -> Path:
    """Write a random-weight `StableDiffusion3ControlNetPipeline` folder (a tiny SD3 folder with a
    `controlnet` component) to `out_dir` and return its path."""
    root = build_tiny_sd3(out_dir, spec.sd3)
    build_tiny_sd3_controlnet(root / "controlnet", spec)
    index = json.loads((root / "model_index.json").read_text())
    index["_class_name"] = "StableDiffusion3ControlNetPipeline"
    index["controlnet"] = ["diffusers", "SD3ControlNetModel"]
    write_json(root / "model_index.json", index)
    return root
