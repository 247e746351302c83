"""What every tiny-checkpoint builder writes with: Diffusers config bodies, `save_pretrained`-style model
folders, randomly initialised native modules and the shared random VAE folders."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from diffserve.loader.native_classes import NativeModelClass
from diffserve.models.vaes.autoencoder_kl import AutoencoderKL

#: Written as `_diffusers_version` so diffusers recognises the files; not a runtime requirement.
DIFFUSERS_FORMAT_VERSION = "0.32.0"


#: Per-channel latent statistics of the released 16-channel Wan 2.1 VAE, which Qwen-Image ships too (facts
#: of the checkpoint, kept so the pipelines' (de)normalisation runs with realistic numbers).
VAE_16CH_LATENTS_MEAN = (
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
)  # fmt: skip
VAE_16CH_LATENTS_STD = (
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
)  # fmt: skip


def diffusers_config(class_name: str, config: dict) -> dict:
    """A Diffusers config.json body: the class and format version first, tuples written as lists."""
    out = {"_class_name": class_name, "_diffusers_version": DIFFUSERS_FORMAT_VERSION}
    out.update({k: list(v) if isinstance(v, tuple) else v for k, v in config.items()})
    return out


def save_diffusers_model(module: nn.Module, directory: Path, class_name: str, config: dict) -> None:
    """Write `config.json` and `diffusion_pytorch_model.safetensors` as Diffusers' save_pretrained does."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(diffusers_config(class_name, config), indent=2) + "\n")
    state = {k: v.detach().contiguous() for k, v in module.state_dict().items()}
    save_file(state, str(directory / "diffusion_pytorch_model.safetensors"))


def write_autoencoder_kl(
    directory: Path, block_out_channels: tuple[int, ...], latent_channels: int, norm_groups: int
) -> None:
    """A random `AutoencoderKL` with FLUX.1's scaling and shift (the VAE FLUX.1 and Z-Image folders ship)."""
    n_levels = len(block_out_channels)
    vae_config = {
        "in_channels": 3,
        "out_channels": 3,
        "down_block_types": ["DownEncoderBlock2D"] * n_levels,
        "up_block_types": ["UpDecoderBlock2D"] * n_levels,
        "block_out_channels": list(block_out_channels),
        "layers_per_block": 1,
        "act_fn": "silu",
        "latent_channels": latent_channels,
        "norm_num_groups": norm_groups,
        "sample_size": 64,
        "scaling_factor": 0.3611,
        "shift_factor": 0.1159,
        "use_quant_conv": False,
        "use_post_quant_conv": False,
        "force_upcast": True,
    }
    save_diffusers_model(AutoencoderKL.from_config(vae_config), directory, "AutoencoderKL", vae_config)


def random_native_module(
    cls: NativeModelClass, config: dict, seed: int, weight_noise: float = 0.0
) -> nn.Module:
    """The native module `cls` built from a Diffusers `config`, randomly initialised under `seed`.

    Parameters that start at zero get small noise, so learned pad tokens and zero-initialised
    projections are not hidden from parity tests. `weight_noise` adds N(0, weight_noise) to every
    parameter: a random DiT is otherwise nearly blind to its text, and CFG parity would prove little.
    """
    torch.manual_seed(seed)
    module = cls.from_config(config)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in module.parameters():
            if param.is_floating_point() and not param.any():
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
            if weight_noise:
                param.add_(torch.randn(param.shape, generator=gen) * weight_noise)
    return module
