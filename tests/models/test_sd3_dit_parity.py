"""Native SD3 / SD3.5 DiT against Diffusers' `SD3Transformer2DModel` on the same tiny random weights (fp32)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from diffserve.models.dits.sd3 import SD3Transformer2DModel, SD3TransformerConfig
from diffserve.testing.parity import (
    assert_parity,
    assert_same_state_dict_layout,
    native_from_reference,
    parity_pair,
)

diffusers = pytest.importorskip("diffusers")
from diffusers import SD3Transformer2DModel as DiffusersSD3  # noqa: E402

SD3_MEDIUM_LIKE: dict[str, Any] = {
    "sample_size": 16,
    "patch_size": 2,
    "in_channels": 16,
    "num_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,
    "caption_projection_dim": 32,
    "pooled_projection_dim": 48,
    "out_channels": 16,
    "pos_embed_max_size": 16,
    "dual_attention_layers": (),
    "qk_norm": None,
}
SD35_LIKE: dict[str, Any] = {**SD3_MEDIUM_LIKE, "qk_norm": "rms_norm", "dual_attention_layers": (0,)}


def _pair(config: dict[str, Any]) -> tuple[torch.nn.Module, SD3Transformer2DModel]:
    """A seeded Diffusers model and the native model loaded from its state dict through the meta device.
    Every parameter is perturbed (QK-norm weights start at one, adaLN at Diffusers' init) so no term is
    trivial; the position table (a buffer) is left as Diffusers computed it."""
    return parity_pair(DiffusersSD3, SD3Transformer2DModel, config)


def _inputs(config: dict[str, Any], batch: int, h: int, w: int, timestep: list[float], txt: int = 7) -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "hidden_states": torch.randn(batch, config["in_channels"], h, w, generator=g),
        "encoder_hidden_states": torch.randn(batch, txt, config["joint_attention_dim"], generator=g),
        "pooled_projections": torch.randn(batch, config["pooled_projection_dim"], generator=g),
        "timestep": torch.tensor(timestep),
    }


def _compare(
    ref: torch.nn.Module, ours: SD3Transformer2DModel, label: str, atol: float = 1e-4, **inputs: Any
) -> None:
    with torch.no_grad():
        expected = ref(**inputs, return_dict=False)[0].float()
        out = ours(**inputs).float()
    assert_parity(out, expected, f"sd3 parity {label}", max_abs=atol, min_cos=0.9999)


@pytest.mark.parametrize("config", [SD3_MEDIUM_LIKE, SD35_LIKE], ids=["sd3-medium", "sd3.5"])
def test_state_dict_keys_and_shapes_match_diffusers(config: dict[str, Any]) -> None:
    ref = DiffusersSD3(**config)
    with torch.device("meta"):
        ours = SD3Transformer2DModel(SD3TransformerConfig(**config))
    assert_same_state_dict_layout(ours, ref)
    # Built off the meta device, the position table equals the one Diffusers computes.
    table = SD3Transformer2DModel(SD3TransformerConfig(**config)).pos_embed.pos_embed
    torch.testing.assert_close(table, ref.pos_embed.pos_embed, rtol=0, atol=1e-6)


@pytest.mark.parametrize("config", [SD3_MEDIUM_LIKE, SD35_LIKE], ids=["sd3-medium", "sd3.5"])
def test_parity_batch2_per_sample_timesteps(config: dict[str, Any]) -> None:
    ref, ours = _pair(config)
    inputs = _inputs(config, 2, 8, 8, [900.0, 250.0])
    _compare(ref, ours, f"{config['qk_norm']} b=2", **inputs)
    # Batching must not mix samples: each row equals the same sample run alone.
    with torch.no_grad():
        batched = ours(**inputs)
        for i in range(2):
            single = {k: v[i : i + 1] for k, v in inputs.items()}
            torch.testing.assert_close(ours(**single), batched[i : i + 1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("config", [SD3_MEDIUM_LIKE, SD35_LIKE], ids=["sd3-medium", "sd3.5"])
def test_parity_non_square_latent(config: dict[str, Any]) -> None:
    ref, ours = _pair(config)
    _compare(ref, ours, f"{config['qk_norm']} 16x8", **_inputs(config, 1, 16, 8, [500.0], txt=5))


def test_from_config_rejects_unknown_keys() -> None:
    with pytest.raises(ValueError, match="SD3Transformer2DModel config has unknown keys"):
        SD3Transformer2DModel.from_config({**SD3_MEDIUM_LIKE, "num_single_layers": 3})


def test_latent_larger_than_position_table_is_an_error() -> None:
    with torch.device("meta"):
        ours = SD3Transformer2DModel(SD3TransformerConfig(**SD3_MEDIUM_LIKE))
    with pytest.raises(ValueError, match="pos_embed_max_size"):
        ours.pos_embed.position_table(17, 4, torch.device("meta"))


def test_parity_bf16() -> None:
    """Half precision follows Diffusers' rounding (same op order and layouts); bit-identical on CPU today."""
    ref, _ = _pair(SD35_LIKE)
    ref = ref.to(torch.bfloat16)
    ours = native_from_reference(SD3Transformer2DModel, ref)
    inputs = {k: v.to(torch.bfloat16) for k, v in _inputs(SD35_LIKE, 2, 16, 8, [900.0, 3.0]).items()}
    _compare(ref, ours, "rms_norm bf16 b=2 16x8", atol=2e-2, **inputs)
