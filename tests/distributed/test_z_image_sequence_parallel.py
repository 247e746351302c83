"""Z-Image's DiT split over sequence-parallel ranks (Ulysses, Ring, both) equals its one-device forward.

Each rank builds the same random-weight Z-Image transformer (a seeded init) and the same inputs, runs the
forward inside `parallel_scope` of a ParallelState with the degrees under test, and returns its outputs;
the test compares every rank's outputs with the plain forward. All three streams are split: the captions
(context refiner), the image tokens (noise refiner) and the unified [image; caption] sequence (main
layers). The batch has a CFG-like pair (one latent, a 40- and a 5-token caption, one timestep) and a
sample with another image size, caption length and timestep, so every stream carries batch padding
masked per sample and per-sample RoPE tables. Z-Image pads every stream to a multiple of 32 tokens, so
degrees 2 and 4 always divide them; the 3-rank case cuts them unevenly (shard padding, masked too). The
3 heads do not divide the Ulysses degree 2 (heads padded).
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from diffserve.distributed.config import ParallelConfig
from diffserve.distributed.state import build_parallel_state, parallel_scope
from diffserve.models.dits.z_image import ZImageTransformer2DModel, ZImageTransformerConfig
from diffserve.testing.distributed import run_distributed

CAP_DIM, CHANNELS = 24, 4
#: (latent (C, F, H, W), caption tokens, t) per row: a CFG-like pair, then another size.
ROWS = (((1, 8, 12), 40, 0.3), ((1, 8, 12), 5, 0.3), ((1, 10, 14), 20, 0.7))


def tiny_z_image() -> ZImageTransformer2DModel:
    torch.manual_seed(0)
    config = ZImageTransformerConfig(
        in_channels=CHANNELS, dim=48, n_layers=2, n_refiner_layers=1, n_heads=3, n_kv_heads=3,
        cap_feat_dim=CAP_DIM, axes_dims=(4, 6, 6), axes_lens=(256, 64, 64),
    )  # fmt: skip
    model = ZImageTransformer2DModel(config)
    for p in model.parameters():  # larger than the init's zeros/tiny values, so every block matters
        torch.nn.init.normal_(p, std=0.2)
    return model.eval()


def forward(model: ZImageTransformer2DModel) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    latents = [torch.randn(CHANNELS, *size, generator=g) for size, _, _ in ROWS]
    latents[1] = latents[0]  # the CFG pair denoises one latent
    captions = [torch.randn(n, CAP_DIM, generator=g) for _, n, _ in ROWS]
    t = torch.tensor([t for _, _, t in ROWS])
    return model(latents, t, cap_feats=captions)


def forward_on_rank(rank: int, world_size: int, ulysses: int, ring: int) -> list[torch.Tensor]:
    config = ParallelConfig(num_gpus=world_size, ulysses_degree=ulysses, ring_degree=ring)
    state = build_parallel_state(config, local_rank=rank, control_timeout=timedelta(seconds=60))
    model = tiny_z_image()
    with torch.no_grad(), parallel_scope(state):
        return forward(model)


@pytest.fixture(scope="module")
def expected() -> list[torch.Tensor]:
    with torch.no_grad():
        return forward(tiny_z_image())


# Ulysses and ring alone (2 and 4 ranks) are checked at the attention level in test_sequence_parallel.py and
# on FLUX's DiT; per family, the 2x2 mesh runs both through this DiT's own sequence split.
@pytest.mark.parametrize(
    ("world_size", "ulysses", "ring"),
    [(4, 2, 2), (3, 3, 1)],
    ids=["ulysses2xring2", "ulysses3-uneven"],
)
def test_split_forward_equals_one_device(expected, world_size: int, ulysses: int, ring: int) -> None:
    outputs = run_distributed(forward_on_rank, world_size, ulysses, ring, timeout_s=120)
    scale = max(e.abs().max().item() for e in expected)
    for rank, outs in enumerate(outputs):
        assert [o.shape for o in outs] == [e.shape for e in expected]
        error = max((o - e).abs().max().item() for o, e in zip(outs, expected, strict=True))
        print(
            f"ulysses {ulysses} x ring {ring}, rank {rank}: max abs error {error:.2e} (max |out| {scale:.1f})"
        )
        # fp32: Ulysses reorders no sum (exact up to SDPA's blocking); Ring merges blocks by log-sum-exp.
        assert error < 1e-4 * scale, error
