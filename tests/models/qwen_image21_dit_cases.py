"""What the Qwen-Image 2.1 DiT parity files (test_qwen_image21_dit_parity.py, ..._conditions_parity.py)
share: the tiny config and latent grid, the bar, Diffusers' prediction for the target image's tokens, and
the check that other inputs move the output."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

MIN_DB = 80.0
TINY: dict[str, Any] = {
    "in_channels": 8,
    "out_channels": 8,
    "num_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "context_in_dim": 24,
    "axes_dims_rope": (4, 6, 6),
}
GRID = (4, 6)  # latent rows, columns: non-square


def target_prediction(
    reference: nn.Module,
    hidden_states: torch.Tensor,
    text: torch.Tensor,
    t: torch.Tensor,
    img_shapes: list[list[tuple[int, int, int]]],
    img_mask: torch.Tensor,
) -> torch.Tensor:
    """Diffusers' prediction for the target image's tokens, the last of `hidden_states`."""
    h, w = GRID
    out = reference(
        hidden_states=hidden_states,
        encoder_hidden_states=text,
        timestep=t,
        img_shapes=img_shapes,
        img_mask=img_mask,
        return_dict=False,
    )[0]
    return out[:, -h * w :]


def text_only_prediction(
    reference: nn.Module, x: torch.Tensor, text: torch.Tensor, t: torch.Tensor
) -> torch.Tensor:
    """Diffusers' prediction for the target tokens (its pipeline's t2i call: text slots, then the image's)."""
    h, w = GRID
    batch, length = text.shape[:2]
    slots = torch.cat(
        [torch.zeros(batch, length, dtype=torch.bool), torch.ones(batch, h * w // 4, dtype=torch.bool)], 1
    )
    return target_prediction(reference, x, text, t, [[(1, h, w)]] * batch, slots)


def assert_moved(other: torch.Tensor, want: torch.Tensor, unused: str) -> None:
    """`other` (a run on other inputs) is more than 1% of `want`'s norm away from it, else `unused`."""
    assert torch.linalg.vector_norm(other - want) > 1e-2 * torch.linalg.vector_norm(want), unused
