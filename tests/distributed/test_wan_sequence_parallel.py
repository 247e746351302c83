"""Wan 2.1's DiT split over sequence-parallel ranks (Ulysses, Ring, both) equals its one-device forward.

Each rank builds the same random-weight Wan transformers (a seeded init) and the same inputs, runs the
forwards inside `parallel_scope` of a ParallelState with the degrees under test, and returns their
outputs; the test compares every rank's outputs with the plain forwards. The video tokens are split
(a non-square 3 x 3 x 5 post-patch grid: 45 tokens, which neither 2 nor 4 divides) with the 3D RoPE
tables; the cross-attention reads the replicated text and (image-to-video) CLIP image tokens. Two
forwards per rank: an image-to-video model whose batch is a CFG-like pair (one latent, two texts, one
timestep) plus a row at another timestep, and a text-to-video model with one timestep per token (Wan
2.2 TI2V-style), which is split with the tokens. The 3 heads do not divide the Ulysses degree 2.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from diffserve.distributed.config import ParallelConfig
from diffserve.distributed.state import build_parallel_state, parallel_scope
from diffserve.models.dits.wan import WanTransformer3DModel, WanTransformerConfig
from diffserve.testing.distributed import run_distributed

BATCH, CHANNELS, TEXT_DIM, IMAGE_DIM = 3, 4, 16, 12
FRAMES, HEIGHT, WIDTH = 3, 6, 10  # post-patch grid 3 x 3 x 5 with patch (1, 2, 2)
TEXT_LEN, IMAGE_LEN = 7, 5


def tiny_wan(image_to_video: bool) -> WanTransformer3DModel:
    torch.manual_seed(0)
    config = WanTransformerConfig(
        num_attention_heads=3, attention_head_dim=12, in_channels=CHANNELS, out_channels=CHANNELS,
        text_dim=TEXT_DIM, freq_dim=16, ffn_dim=48, num_layers=2,
        image_dim=IMAGE_DIM if image_to_video else None, added_kv_proj_dim=36 if image_to_video else None,
    )  # fmt: skip
    model = WanTransformer3DModel(config)
    for p in model.parameters():  # larger than the init's zeros/tiny values, so every block matters
        torch.nn.init.normal_(p, std=0.2)
    return model.eval()


def forward() -> list[torch.Tensor]:
    """The image-to-video forward (per-sample timesteps), then the text-to-video one (per-token)."""
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(BATCH, CHANNELS, FRAMES, HEIGHT, WIDTH, generator=g)
    latents[1] = latents[0]  # the CFG pair denoises one latent
    text = torch.randn(BATCH, TEXT_LEN, TEXT_DIM, generator=g)
    image = torch.randn(BATCH, IMAGE_LEN, IMAGE_DIM, generator=g)
    per_token_t = torch.rand(BATCH, FRAMES * (HEIGHT // 2) * (WIDTH // 2), generator=g) * 1000
    return [
        tiny_wan(True)(latents, torch.tensor([700.0, 700.0, 250.0]), text, image),
        tiny_wan(False)(latents, per_token_t, text),
    ]


def forward_on_rank(rank: int, world_size: int, ulysses: int, ring: int) -> list[torch.Tensor]:
    config = ParallelConfig(num_gpus=world_size, ulysses_degree=ulysses, ring_degree=ring)
    state = build_parallel_state(config, local_rank=rank, control_timeout=timedelta(seconds=60))
    with torch.no_grad(), parallel_scope(state):
        return forward()


@pytest.fixture(scope="module")
def expected() -> list[torch.Tensor]:
    with torch.no_grad():
        return forward()


# Ulysses and ring alone (2 and 4 ranks) are checked at the attention level in test_sequence_parallel.py and
# on FLUX's DiT; per family, the 2x2 mesh runs both through this DiT's own sequence split.
@pytest.mark.parametrize(
    ("world_size", "ulysses", "ring"),
    [(4, 2, 2)],
    ids=["ulysses2xring2"],
)
def test_split_forward_equals_one_device(expected, world_size: int, ulysses: int, ring: int) -> None:
    outputs = run_distributed(forward_on_rank, world_size, ulysses, ring, timeout_s=120)
    for rank, outs in enumerate(outputs):
        for name, out, want in zip(("i2v", "t2v per-token t"), outs, expected, strict=True):
            error = (out - want).abs().max().item()
            print(f"ulysses {ulysses} x ring {ring}, rank {rank}, {name}: max abs error {error:.2e}")
            assert out.shape == want.shape
            # fp32: Ulysses reorders no sum (exact up to SDPA's blocking); Ring merges blocks by log-sum-exp.
            assert error < 1e-4 * want.abs().max().item(), error
