"""Tiny random-weight DiTs and their call inputs, keyed by the DiT's Diffusers class name: what the
breakable-CUDA-graph tests (tests/unit/test_cuda_graph_*.py, on the CPU with the dry-run backend;
tests/gpu/, on a GPU) and `tools/gpu/bench_gpu.py --dry-run` run. The configs are those of the families'
tiny checkpoints (`diffserve make-tiny`), so these are the DiTs the pipeline tests load."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from diffserve.models.dits.flux import FluxTransformer2DModel
from diffserve.models.dits.longcat_image import LongCatImageTransformer2DModel
from diffserve.models.dits.qwen_image import QwenImageTransformer2DModel
from diffserve.models.dits.z_image import ZImageTransformer2DModel
from diffserve.testing.tiny_writing import random_native_module

QWEN_IMAGE = "QwenImageTransformer2DModel"
Z_IMAGE = "ZImageTransformer2DModel"
FLUX = "FluxTransformer2DModel"
LONGCAT_IMAGE = "LongCatImageTransformer2DModel"

#: The DiT configs of the tiny checkpoints (`families/*/tiny.py` defaults).
TINY_CONFIGS: dict[str, tuple[type[nn.Module], dict[str, Any]]] = {
    QWEN_IMAGE: (
        QwenImageTransformer2DModel,
        {
            "patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 2, "attention_head_dim": 16,
            "num_attention_heads": 2, "joint_attention_dim": 32, "guidance_embeds": False,
            "axes_dims_rope": [4, 6, 6], "zero_cond_t": False, "use_additional_t_cond": False,
            "use_layer3d_rope": False,
        },
    ),
    Z_IMAGE: (
        ZImageTransformer2DModel,
        {
            "all_patch_size": [2], "all_f_patch_size": [1], "in_channels": 16, "dim": 32, "n_layers": 2,
            "n_refiner_layers": 1, "n_heads": 2, "n_kv_heads": 2, "norm_eps": 1e-5, "qk_norm": True,
            "cap_feat_dim": 32, "rope_theta": 256.0, "t_scale": 1000.0, "axes_dims": [4, 6, 6],
            "axes_lens": [1536, 512, 512],
        },
    ),
    FLUX: (
        FluxTransformer2DModel,
        {
            "patch_size": 1, "in_channels": 64, "out_channels": None, "num_layers": 1, "num_single_layers": 2,
            "attention_head_dim": 16, "num_attention_heads": 2, "joint_attention_dim": 32,
            "pooled_projection_dim": 32, "guidance_embeds": True, "axes_dims_rope": [4, 6, 6],
        },
    ),
    LONGCAT_IMAGE: (
        LongCatImageTransformer2DModel,
        {
            "patch_size": 1, "in_channels": 64, "num_layers": 1, "num_single_layers": 2, "attention_head_dim": 16,
            "num_attention_heads": 2, "joint_attention_dim": 32, "pooled_projection_dim": 32,
            "axes_dims_rope": [4, 6, 6],
        },
    ),
}  # fmt: skip


def tiny_dit(
    name: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 10
) -> nn.Module:
    """The tiny DiT `name` with random weights (noise on every parameter, so text matters), in eval mode;
    FLUX's projections fused as the loader fuses them."""
    cls, config = TINY_CONFIGS[name]
    module = random_native_module(cls, config, seed, weight_noise=0.2).to(device=device, dtype=dtype).eval()
    fuse = getattr(module, "fuse_for_inference", None)
    if fuse is not None:
        fuse()
    return module


def _qwen_inputs(g: torch.Generator, batch: int, text: int, ragged: bool, device, dtype) -> dict[str, Any]:
    mask = None
    if ragged:  # row 0's prompt is 3 tokens shorter, as a padded batch of two prompts
        mask = torch.ones(batch, text, dtype=torch.long)
        mask[0, text - 3 :] = 0
        mask = mask.to(device)
    return {
        "hidden_states": torch.randn(batch, 16, 64, generator=g).to(device, dtype),
        "encoder_hidden_states": torch.randn(batch, text, 32, generator=g).to(device, dtype),
        "encoder_hidden_states_mask": mask,
        "timestep": torch.rand(batch, generator=g).to(device),
        "img_shapes": [[(1, 4, 4)]] * batch,
    }


def _zimage_inputs(g: torch.Generator, batch: int, text: int, ragged: bool, device, dtype) -> dict[str, Any]:
    lengths = [text - 3 * (ragged and i == 0) for i in range(batch)]
    return {
        "x": [torch.randn(16, 1, 8, 8, generator=g).to(device, dtype) for _ in range(batch)],
        "t": torch.rand(batch, generator=g).to(device),
        "cap_feats": [torch.randn(n, 32, generator=g).to(device, dtype) for n in lengths],
    }


def _flux_inputs(g: torch.Generator, batch: int, text: int, ragged: bool, device, dtype) -> dict[str, Any]:
    return {
        "hidden_states": torch.randn(batch, 16, 64, generator=g).to(device, dtype),
        "encoder_hidden_states": torch.randn(batch, text, 32, generator=g).to(device, dtype),
        "pooled_projections": torch.randn(batch, 32, generator=g).to(device, dtype),
        "timestep": torch.rand(batch, generator=g).to(device),
        "img_ids": torch.stack(
            torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0), indexing="ij"), -1
        )
        .reshape(16, 3)
        .to(device),
        "txt_ids": torch.zeros(text, 3, device=device),
        "guidance": torch.full((batch,), 3.5, device=device),
    }


def _longcat_image_inputs(
    g: torch.Generator, batch: int, text: int, ragged: bool, device, dtype
) -> dict[str, Any]:
    """FLUX's call without pooled text or guidance; text ids (0, i, i), image ids (1, text + row, text + col)."""
    inputs = _flux_inputs(g, batch, text, ragged, device, dtype)
    del inputs["pooled_projections"], inputs["guidance"]
    index = torch.arange(float(text), device=device)
    inputs["txt_ids"] = torch.stack([torch.zeros_like(index), index, index], dim=-1)
    inputs["img_ids"] = inputs["img_ids"] + torch.tensor([1.0, text, text], device=device)
    return inputs


_INPUTS: dict[str, Callable[..., dict[str, Any]]] = {
    QWEN_IMAGE: _qwen_inputs,
    Z_IMAGE: _zimage_inputs,
    FLUX: _flux_inputs,
    LONGCAT_IMAGE: _longcat_image_inputs,
}


def tiny_dit_inputs(
    name: str,
    batch: int = 1,
    text: int = 7,
    ragged: bool = False,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """One call of the tiny DiT `name`: `batch` rows, `text` text tokens (`ragged`: row 0's prompt is 3
    tokens shorter: a key mask for Qwen-Image, a shorter caption for Z-Image; FLUX's text length is fixed
    by its pipeline, so `ragged` changes nothing there)."""
    g = torch.Generator().manual_seed(seed)
    return _INPUTS[name](g, batch, text, ragged, torch.device(device), dtype)
