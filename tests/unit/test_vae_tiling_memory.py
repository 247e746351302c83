"""VAE tiling in the memory model (runtime/memory.py): a tiled decode is costed by one tile's pixels, and on
one device a decode is tiled only when its untiled cost would not fit beside the running requests."""

from __future__ import annotations

from dataclasses import replace

import torch

from diffserve.models.vaes.autoencoder_kl_wan import AutoencoderKLWan
from diffserve.platforms.cpu import CpuPlatform
from diffserve.runtime.contract import PipelineFacts
from diffserve.runtime.memory import MemoryModel, RequestCost, estimated_memory_model, with_vae_tiling

GB = 2**30
WAN_FACTS = PipelineFacts(
    name="WanPipeline", pixel_multiple=16, dit_width=48, dtype=torch.float32, cfg_mode="classic",
    makes_video=True, temporal_factor=4, max_frames=81, max_fps=16,
)  # fmt: skip
TILE = 256 * 256  # Diffusers' Wan tile


def video(height: int = 720, width: int = 1280, frames: int = 17) -> RequestCost:
    return RequestCost(height=height, width=width, pixel_multiple=16, branches=2, outputs=1, frames=frames,
                       temporal_factor=4)  # fmt: skip


def model(budget: int | None, tile: int | None = TILE, forced: bool = False) -> MemoryModel:
    base = estimated_memory_model(WAN_FACTS, CpuPlatform(), 0.9)
    return replace(base, budget_bytes=budget, vae_tile_pixels=tile, vae_tiling_forced=forced)


def test_tiled_decode_costs_one_tile_of_activations() -> None:
    m, cost = model(None), video()
    untiled, tiled = m.decode_activation_bytes(cost, False), m.decode_activation_bytes(cost, True)
    per_pixel = m.bytes_per_pixel
    assert untiled == per_pixel * 720 * 1280 * 4
    assert tiled < untiled / 3
    # A frame smaller than a tile costs the frame, not the tile (plus the held tiles).
    small = video(128, 128)
    assert m.decode_activation_bytes(small, True) >= m.decode_activation_bytes(small, False)
    assert m.vae_tiling_mode == "auto" and model(None, forced=True).vae_tiling_mode == "on"
    assert model(None, tile=None).vae_tiling_mode == "off"


def test_automatic_tiling_only_when_the_untiled_decode_does_not_fit() -> None:
    cost = video()
    roomy = model(budget=200 * GB)
    assert not roomy.decode_tiled([], cost)
    need = roomy.denoise_bytes(cost) + roomy.decode_bytes(cost, tiled=False)
    tight = model(budget=int(need) - 1)
    assert tight.decode_tiled([], cost)
    assert tight.fits_alone(cost), "admission costs the tiled decode when it is the one that will run"
    assert not model(budget=int(need) - 1, tile=None).fits_alone(cost)
    # Other running requests' denoising counts: room alone, not beside them.
    just = model(budget=int(need) + 1)
    assert not just.decode_tiled([], cost) and just.decode_tiled([video(480, 832)], cost)
    assert model(budget=200 * GB, forced=True).decode_tiled([], cost)


def test_with_vae_tiling_reads_the_vae_tile() -> None:
    base = estimated_memory_model(WAN_FACTS, CpuPlatform(), 0.9)
    with torch.device("meta"):
        vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=(1, 2, 2, 2), num_res_blocks=1)
    assert with_vae_tiling(base, vae, forced=False, single_device=True).vae_tile_pixels == TILE
    assert with_vae_tiling(base, vae, forced=False, single_device=False) is base
    assert with_vae_tiling(base, vae, forced=True, single_device=False).vae_tiling_mode == "on"
    assert with_vae_tiling(base, object(), forced=True, single_device=True) is base
