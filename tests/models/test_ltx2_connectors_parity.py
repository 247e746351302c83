"""Native LTX-2 text connectors against Diffusers' `LTX2TextConnectors` on the same tiny random weights (fp32).

Configs: LTX-2.0-style (shared bias-free projection, masked mean/range features, split RoPE, registers),
LTX-2.3-style (per-modality projections with bias, per-token RMS features, gated attention, different
video/audio widths) and one without registers (the padding mask then reaches the attention), interleaved
RoPE. Batch 2, 8 text tokens, sample 0 padded to 5 tokens on the tokenizer's side. Parity must reach 80 dB.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from diffserve.models.dits.ltx2_connectors import LTX2TextConnectors, LTX2TextConnectorsConfig
from diffserve.testing.parity import assert_parity, assert_same_state_dict_layout, parity_pair

diffusers = pytest.importorskip("diffusers")
from diffusers.pipelines.ltx2 import LTX2TextConnectors as DiffusersConnectors  # noqa: E402

CONNECTORS_20: dict[str, Any] = {
    "caption_channels": 12,
    "text_proj_in_factor": 3,
    "video_connector_num_attention_heads": 2,
    "video_connector_attention_head_dim": 6,
    "video_connector_num_layers": 2,
    "video_connector_num_learnable_registers": 4,
    "video_gated_attn": False,
    "audio_connector_num_attention_heads": 2,
    "audio_connector_attention_head_dim": 6,
    "audio_connector_num_layers": 2,
    "audio_connector_num_learnable_registers": 4,
    "audio_gated_attn": False,
    "connector_rope_base_seq_len": 32,
    "rope_theta": 10000.0,
    "rope_double_precision": True,
    "causal_temporal_positioning": False,
    "rope_type": "split",
    "per_modality_projections": False,
    "proj_bias": False,
}
CONNECTORS_23: dict[str, Any] = {
    **CONNECTORS_20,
    "video_connector_num_attention_heads": 4,
    "video_connector_attention_head_dim": 4,
    "audio_connector_attention_head_dim": 8,
    "video_gated_attn": True,
    "audio_gated_attn": True,
    "per_modality_projections": True,
    "video_hidden_dim": 16,
    "audio_hidden_dim": 16,
    "proj_bias": True,
}
NO_REGISTERS: dict[str, Any] = {
    **CONNECTORS_20,
    "video_connector_num_learnable_registers": None,
    "audio_connector_num_learnable_registers": None,
    "rope_type": "interleaved",
    "rope_double_precision": False,
}
CONFIGS = {"ltx20": CONNECTORS_20, "ltx23": CONNECTORS_23, "no-registers": NO_REGISTERS}
TEXT_LEN = 8
MIN_DB = 80.0


def _pair(config: dict[str, Any]) -> tuple[torch.nn.Module, LTX2TextConnectors]:
    return parity_pair(DiffusersConnectors, LTX2TextConnectors, config, perturb=0.1)


def _inputs(config: dict[str, Any], padding_side: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    states = (
        torch.randn(2, TEXT_LEN, config["caption_channels"], config["text_proj_in_factor"], generator=g) * 3
    )
    mask = torch.ones(2, TEXT_LEN, dtype=torch.int64)
    if padding_side == "left":
        mask[0, :3] = 0
    else:
        mask[0, 5:] = 0
    states = (
        states * mask[:, :, None, None]
    )  # padded positions of a real encoder are arbitrary; zero is typical
    states[0, 0 if padding_side == "left" else -1] = 7.0  # ... but must not leak into the result
    return states, mask


@pytest.mark.parametrize("name", list(CONFIGS))
def test_state_dict_keys_and_shapes_match_diffusers(name: str) -> None:
    ref = DiffusersConnectors(**CONFIGS[name])
    with torch.device("meta"):
        ours = LTX2TextConnectors(LTX2TextConnectorsConfig(**CONFIGS[name]))
    assert_same_state_dict_layout(ours, ref)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_parity(name: str, padding_side: str) -> None:
    ref, ours = _pair(CONFIGS[name])
    states, mask = _inputs(CONFIGS[name], padding_side)
    for label, text in (("4d", states), ("flat", states.flatten(2))):
        with torch.no_grad():
            expected = ref(text, mask, padding_side=padding_side)
            got = ours(text, mask, padding_side=padding_side)
        torch.testing.assert_close(got[2], expected[2], rtol=0, atol=0)
        assert got[2].dtype == torch.int64
        for part, out, exp in zip(("video", "audio"), got[:2], expected[:2], strict=True):
            assert_parity(out, exp, f"ltx2 connectors {name} {padding_side} {label} {part}", min_db=MIN_DB)
    # Diffusers' mask conversion keeps every token, with or without registers (see the connectors' docstring).
    assert bool(got[2].all())


def test_config_and_input_errors() -> None:
    with pytest.raises(ValueError, match="unknown keys"):
        LTX2TextConnectors.from_config({**CONNECTORS_20, "video_hidden_size": 4})
    with pytest.raises(ValueError, match="caption_channels"):
        LTX2TextConnectorsConfig(**{**CONNECTORS_20, "video_connector_attention_head_dim": 4})
    assert LTX2TextConnectors.diffusers_class_name == DiffusersConnectors.__name__
    with torch.device("meta"):
        ours = LTX2TextConnectors(LTX2TextConnectorsConfig(**CONNECTORS_20))
    states, mask = _inputs(CONNECTORS_20, "left")
    with pytest.raises(ValueError, match="padding_side"):
        ours(states, mask, padding_side="middle")
    with pytest.raises(ValueError, match="text_encoder_hidden_states"):
        ours(states[..., :2], mask)
