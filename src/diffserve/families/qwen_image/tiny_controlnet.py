"""Builder of small random-weight Qwen-Image ControlNets in the Diffusers `QwenImageControlNetModel` layout (a
model folder: config.json and diffusion_pytorch_model.safetensors), matching a tiny Qwen-Image folder's DiT
(`families/qwen_image/tiny.py`). Its zero-initialised parts (the residual heads, the control embedder) are
random here, so that the control image changes the output. Used by the tests."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from diffserve.families.qwen_image.tiny import TinyQwenImageSpec, build_tiny_qwen_image
from diffserve.models.controlnets.qwen_image import QwenImageControlNetModel
from diffserve.testing.tiny_writing import random_native_module, save_diffusers_model, write_json

#: Factor on the control embedder's random weights.
CONTROL_GAIN = 4.0
#: `sharpen_vae_posterior`: the posterior's log-variance, and the factor on its mean's projection.
SHARP_LOGVAR = -12.0
MEAN_GAIN = 20.0
LATENT_CHANNELS = 16


@dataclass
class TinyQwenImageControlNetSpec:
    """A tiny ControlNet for the tiny Qwen-Image DiT of `qwen`: its own block count, and whether it is the
    inpainting kind (the packed mask's 4 extra control channels, as InstantX's inpainting ControlNet)."""

    qwen: TinyQwenImageSpec = field(default_factory=TinyQwenImageSpec)
    num_layers: int = 1
    inpainting: bool = False
    seed: int = 0


def build_tiny_qwen_image_controlnet(out_dir: str | Path, spec: TinyQwenImageControlNetSpec) -> Path:
    """Write a random-weight `QwenImageControlNetModel` folder to `out_dir` and return its path."""
    qwen = spec.qwen
    config = {
        "patch_size": 2,
        "in_channels": LATENT_CHANNELS * 4,
        "out_channels": LATENT_CHANNELS,
        "num_layers": spec.num_layers,
        "attention_head_dim": qwen.attention_head_dim,
        "num_attention_heads": qwen.num_attention_heads,
        "joint_attention_dim": qwen.text_hidden_size,
        "axes_dims_rope": list(qwen.axes_dims_rope),
        "extra_condition_channels": 4 if spec.inpainting else 0,
    }
    model = random_native_module(QwenImageControlNetModel, config, spec.seed + 30, weight_noise=0.2)
    with torch.no_grad():  # a stronger control embedding, so that the control image clearly matters
        model.controlnet_x_embedder.weight.mul_(CONTROL_GAIN)
    root = Path(out_dir)
    save_diffusers_model(model, root, "QwenImageControlNetModel", config)
    return root


def sharpen_vae_posterior(folder: str | Path) -> None:
    """Make the tiny Qwen-Image folder's random VAE encoder see its input: its posterior's noise (std ~1)
    otherwise dwarfs what the image changes in its mean (~0.1), and a ControlNet reads *sampled* latents,
    so the control image would barely matter. Rewrites `vae/`'s `quant_conv`: a log-variance of
    SHARP_LOGVAR everywhere, the mean's projection times MEAN_GAIN. The decoder is untouched."""
    path = next((Path(folder) / "vae").glob("*.safetensors"))
    state = load_file(path)
    weight, bias = state["quant_conv.weight"].clone(), state["quant_conv.bias"].clone()
    half = weight.shape[0] // 2
    weight[:half] *= MEAN_GAIN
    weight[half:] = 0.0
    bias[half:] = SHARP_LOGVAR
    state["quant_conv.weight"], state["quant_conv.bias"] = weight, bias
    save_file(state, path)


def build_tiny_qwen_image_controlnet_pipeline(out_dir: str | Path, spec: TinyQwenImageControlNetSpec) -> Path:
    """Write a random-weight `QwenImageControlNetPipeline` folder (a tiny Qwen-Image folder with a
    `controlnet` component) to `out_dir` and return its path."""
    root = build_tiny_qwen_image(out_dir, spec.qwen)
    sharpen_vae_posterior(root)
    build_tiny_qwen_image_controlnet(root / "controlnet", spec)
    index = json.loads((root / "model_index.json").read_text())
    index["_class_name"] = "QwenImageControlNetPipeline"
    index["controlnet"] = ["diffusers", "QwenImageControlNetModel"]
    write_json(root / "model_index.json", index)
    return root
