"""Qwen-Image's DiT split over sequence-parallel ranks (Ulysses, Ring, both) equals the one-device forward.

Each rank builds the same random-weight DiTs (a seeded init) and the same inputs, runs the forwards inside
`parallel_scope` of a ParallelState with the degrees under test, and returns the outputs; the test compares
every rank's outputs with the plain forwards. Two models:

- text to image: a 6x5 grid (30 image tokens), one shared RoPE table;
- edit (Edit-2511 style, `zero_cond_t`): the generated 6x5 image followed by a conditioning image of 12
  tokens whose grid differs per sample (4x3 and 3x4), so the RoPE tables are per sample and the
  conditioning-token flags must follow the image tokens onto their ranks.

The batch is a CFG-like pair (one latent and timestep, two prompts) with a text padding mask: the second
prompt has 4 real tokens of 7. No length divides the degrees (7 text tokens; 30 and 42 image tokens).
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from diffserve.distributed.config import ParallelConfig
from diffserve.distributed.state import build_parallel_state, parallel_scope
from diffserve.models.dits.qwen_image import QwenImageTransformer2DModel, QwenImageTransformerConfig
from diffserve.testing.distributed import run_distributed

TEXT_LEN, REAL_TEXT, BATCH = 7, (7, 4), 2
VARIANTS = {
    "t2i": {"zero_cond_t": False, "img_shapes": [[(1, 6, 5)]] * BATCH},
    "edit": {"zero_cond_t": True, "img_shapes": [[(1, 6, 5), (1, 4, 3)], [(1, 6, 5), (1, 3, 4)]]},
}


def tiny_qwen_image(variant: str) -> QwenImageTransformer2DModel:
    torch.manual_seed(0)
    config = QwenImageTransformerConfig(
        patch_size=2, in_channels=16, out_channels=4, num_layers=3, attention_head_dim=16,
        num_attention_heads=4, joint_attention_dim=24, axes_dims_rope=(4, 6, 6),
        zero_cond_t=VARIANTS[variant]["zero_cond_t"],
    )  # fmt: skip
    model = QwenImageTransformer2DModel(config)
    with torch.no_grad():  # larger than the init's zeros/tiny values, so every block matters
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.2)
    return model.eval()


def inputs(variant: str) -> dict[str, object]:
    img_shapes = VARIANTS[variant]["img_shapes"]
    img_seq = sum(f * h * w for f, h, w in img_shapes[0])
    g = torch.Generator().manual_seed(1)
    mask = torch.arange(TEXT_LEN)[None, :] < torch.tensor(REAL_TEXT)[:, None]
    return {
        "hidden_states": torch.randn(1, img_seq, 16, generator=g).expand(BATCH, -1, -1),
        "encoder_hidden_states": torch.randn(BATCH, TEXT_LEN, 24, generator=g),
        "encoder_hidden_states_mask": mask,
        "timestep": torch.tensor([0.7]),
        "img_shapes": img_shapes,
    }


def forward_all() -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return {variant: tiny_qwen_image(variant)(**inputs(variant)) for variant in VARIANTS}


def forward_on_rank(rank: int, world_size: int, ulysses: int, ring: int) -> dict[str, torch.Tensor]:
    config = ParallelConfig(num_gpus=world_size, ulysses_degree=ulysses, ring_degree=ring)
    state = build_parallel_state(config, local_rank=rank, control_timeout=timedelta(seconds=60))
    with parallel_scope(state):
        return forward_all()


@pytest.fixture(scope="module")
def expected() -> dict[str, torch.Tensor]:
    return forward_all()


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


def test_inputs_exercise_masks_and_per_sample_positions(expected: dict[str, torch.Tensor]) -> None:
    """What the parity test relies on: the padded prompt's masked keys matter (unmasked, the output
    changes), the prompts reach the image (the CFG rows differ), and the edit model's tables are per sample."""
    for variant, out in expected.items():
        assert (out[0] - out[1]).abs().max() > 1e-2 * out.abs().max(), variant
        unmasked = dict(inputs(variant), encoder_hidden_states_mask=None)
        with torch.no_grad():
            changed = tiny_qwen_image(variant)(**unmasked)
        assert (changed[1] - out[1]).abs().max() > 1e-3 * out.abs().max(), variant
    cos, _ = tiny_qwen_image("edit").rope_tables(
        VARIANTS["edit"]["img_shapes"], TEXT_LEN, torch.device("cpu"), BATCH
    )
    assert cos.shape[0] == BATCH * (TEXT_LEN + 42)
