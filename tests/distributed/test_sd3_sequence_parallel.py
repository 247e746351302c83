"""SD3's and SD3.5's DiT split over sequence-parallel ranks (Ulysses, Ring, both) equals the one-device forward.

Each rank builds the same random-weight DiTs (a seeded init) and the same inputs, runs the forwards inside
`parallel_scope` of a ParallelState with the degrees under test, and returns the outputs; the test compares
every rank's outputs with the plain forwards. Two models: SD3 (joint attention over [image; text], no
QK-norm) and SD3.5-medium-like (RMS QK-norm, dual-attention blocks whose image-only `attn2` is split too).
Both end with the `context_pre_only` block. Lengths do not divide the degrees (7 text tokens, a 6x5 grid
of 30 image tokens), 3 heads do not divide the Ulysses degree (padded), and the batch is a CFG pair: the
same latents and timestep with two different prompts.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from diffserve.distributed.config import ParallelConfig
from diffserve.distributed.state import build_parallel_state, parallel_scope
from diffserve.models.dits.sd3 import SD3Transformer2DModel, SD3TransformerConfig
from diffserve.testing.distributed import run_distributed

TEXT_LEN, LATENT_H, LATENT_W, BATCH = 7, 12, 10, 2  # patch 2: a 6x5 grid of image tokens
VARIANTS = {
    "sd3": {"dual_attention_layers": (), "qk_norm": None},
    "sd3.5": {"dual_attention_layers": (0, 1), "qk_norm": "rms_norm"},
}


def tiny_sd3(variant: str) -> SD3Transformer2DModel:
    torch.manual_seed(0)
    config = SD3TransformerConfig(
        sample_size=8, patch_size=2, in_channels=4, num_layers=3, attention_head_dim=8,
        num_attention_heads=3, joint_attention_dim=16, caption_projection_dim=24,
        pooled_projection_dim=12, out_channels=4, pos_embed_max_size=16, **VARIANTS[variant],
    )  # fmt: skip
    model = SD3Transformer2DModel(config)
    with torch.no_grad():  # larger than the init's zeros/tiny values, so every block matters
        for name, p in model.named_parameters():
            if name != "pos_embed.pos_embed":
                torch.nn.init.normal_(p, std=0.2)
    return model.eval()


def inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(1, 4, LATENT_H, LATENT_W, generator=g)
    return {
        "hidden_states": latents.expand(BATCH, -1, -1, -1),  # CFG: one latent, two prompts
        "encoder_hidden_states": torch.randn(BATCH, TEXT_LEN, 16, generator=g),
        "pooled_projections": torch.randn(BATCH, 12, generator=g),
        "timestep": torch.tensor([700.0]),
    }


def forward_all(variants: list[str]) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return {variant: tiny_sd3(variant)(**inputs()) for variant in variants}


def forward_on_rank(rank: int, world_size: int, ulysses: int, ring: int) -> dict[str, torch.Tensor]:
    config = ParallelConfig(num_gpus=world_size, ulysses_degree=ulysses, ring_degree=ring)
    state = build_parallel_state(config, local_rank=rank, control_timeout=timedelta(seconds=60))
    with parallel_scope(state):
        return forward_all(list(VARIANTS))


@pytest.fixture(scope="module")
def expected() -> dict[str, torch.Tensor]:
    return forward_all(list(VARIANTS))


# Ulysses and ring alone (2 and 4 ranks) are checked at the attention level in test_sequence_parallel.py and
# on FLUX's DiT; per family, the 2x2 mesh runs both through this DiT's own sequence split.
@pytest.mark.parametrize(
    ("world_size", "ulysses", "ring"),
    [(4, 2, 2)],
    ids=["ulysses2xring2"],
)
def test_split_forward_equals_one_device(
    expected: dict[str, torch.Tensor], world_size: int, ulysses: int, ring: int
) -> None:
    outputs = run_distributed(forward_on_rank, world_size, ulysses, ring, timeout_s=120)
    for rank, out in enumerate(outputs):
        for variant, want in expected.items():
            error = (out[variant] - want).abs().max().item()
            print(f"{variant} ulysses {ulysses} x ring {ring}, rank {rank}: max abs error {error:.2e}")
            assert out[variant].shape == want.shape
            # fp32: Ulysses reorders no sum (exact up to SDPA's blocking); Ring merges blocks by log-sum-exp.
            assert error < 1e-4 * want.abs().max().item(), (variant, error)


def test_cfg_rows_differ(expected: dict[str, torch.Tensor]) -> None:
    """The two prompts reach the image: a split that lost the text keys could not pass the parity test."""
    for variant, out in expected.items():
        assert (out[0] - out[1]).abs().max() > 1e-2 * out.abs().max(), variant
