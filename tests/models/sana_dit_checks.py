"""What the SANA and SANA-Video DiT parity files (test_sana_dit_parity.py, test_sana_video_dit_parity.py)
share: a batch of two latents with one row's text padding masked, the same weights in half precision on
both sides, the checks that text embedded once per request and a row run on its unpadded text give the same
output, and the refusal of the options the native DiT does not take."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
from torch import nn


def masked_batch_inputs(
    latent_shape: Sequence[int], caption_channels: int, guidance: bool, text_len: int = 7
) -> dict[str, torch.Tensor]:
    """Two rows of latents (`latent_shape` each) at timesteps 999 and 250.5, the second prompt 4 tokens
    padded to `text_len` and masked; with `guidance`, a guidance scale per row."""
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(2, text_len, dtype=torch.long)
    mask[1, 4:] = 0  # the second prompt is 4 tokens, padded to 7
    inputs = {
        "hidden_states": torch.randn(2, *latent_shape, generator=g),
        "encoder_hidden_states": torch.randn(2, text_len, caption_channels, generator=g),
        "encoder_attention_mask": mask,
        "timestep": torch.tensor([999.0, 250.5]),
    }
    if guidance:
        inputs["guidance"] = torch.tensor([4.5, 3.0]) * 0.1
    return inputs


def half_precision_outputs(
    ref: nn.Module, ours: nn.Module, inputs: dict[str, torch.Tensor], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both models and the float inputs cast to `dtype`: (ours, Diffusers') outputs, both in `dtype`."""
    ref, ours = ref.to(dtype), ours.to(dtype)
    for key in ("hidden_states", "encoder_hidden_states"):
        inputs[key] = inputs[key].to(dtype)
    want = ref(**inputs, return_dict=False)[0]
    got = ours(**inputs)
    assert got.dtype == want.dtype == dtype
    return got, want


def assert_embedded_context_is_exact(
    ours: nn.Module, inputs: dict[str, torch.Tensor], got: torch.Tensor
) -> None:
    """Text embedded once per request (`embed_context`, passed as `context`) gives `got` bit for bit."""
    context = ours.embed_context(inputs["encoder_hidden_states"])
    again = ours(**{**inputs, "encoder_hidden_states": None, "context": context})
    torch.testing.assert_close(again, got, rtol=0, atol=0)


def second_row_unpadded(ours: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The masked second row of `masked_batch_inputs` run alone on its 4 unpadded text tokens."""
    return ours(
        hidden_states=inputs["hidden_states"][1:],
        encoder_hidden_states=inputs["encoder_hidden_states"][1:, :4],
        encoder_attention_mask=None,
        timestep=inputs["timestep"][1:],
    )


def assert_unsupported_options_refused(config_cls: Callable[..., object], model_cls: type) -> None:
    """A layer-norm QK-norm, no cross-attention width and an unknown config key are refused by name."""
    with pytest.raises(ValueError, match="qk_norm='layer_norm'"):
        config_cls(qk_norm="layer_norm")
    with pytest.raises(ValueError, match="cross_attention_dim"):
        config_cls(cross_attention_dim=None)
    with pytest.raises(ValueError, match="unknown keys.*not_a_key"):
        model_cls.from_config({"not_a_key": 1})
