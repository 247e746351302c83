"""Native SkyReels-V2 DiT against Diffusers' `SkyReelsV2Transformer3DModel` on the same tiny random weights
(fp32), in dB: T2V, I2V, the fps injection, diffusion forcing's per-frame timesteps and block-causal
attention (`num_frame_per_block > 1`).

Latents are (batch, C, F=3 or 4, H=6, W=4); 512 text tokens where the I2V attention splits image from text
context at "all but the last 512", as Diffusers' does.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from diffserve.models.dits.skyreels_v2 import SkyReelsV2Transformer3DModel, SkyReelsV2TransformerConfig
from diffserve.testing.parity import (
    assert_parity,
    assert_same_state_dict_layout,
    diffusers_init_defaults,
    parity_pair,
)

pytest.importorskip("diffusers")
from diffusers import SkyReelsV2Transformer3DModel as DiffusersSkyReelsV2  # noqa: E402

MIN_DB = 70.0
T2V: dict[str, Any] = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 2,
    "attention_head_dim": 16,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 32,
    "freq_dim": 32,
    "ffn_dim": 64,
    "num_layers": 2,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "image_dim": None,
    "added_kv_proj_dim": None,
    "rope_max_seq_len": 32,
    "pos_embed_seq_len": None,
    "inject_sample_info": False,
    "num_frame_per_block": 1,
}
I2V: dict[str, Any] = {
    **T2V,
    "attention_head_dim": 24,
    "in_channels": 36,
    "image_dim": 24,
    "added_kv_proj_dim": 48,
}
DF: dict[str, Any] = {**T2V, "inject_sample_info": True}
DF_CAUSAL: dict[str, Any] = {**DF, "num_frame_per_block": 2}
IMAGE_TOKENS = 5


def _inputs(
    config: dict[str, Any], batch: int, fhw: tuple[int, int, int] = (3, 6, 4)
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    inputs = {
        "hidden_states": torch.randn(batch, config["in_channels"], *fhw, generator=g),
        "encoder_hidden_states": torch.randn(batch, 512, config["text_dim"], generator=g),
    }
    if config["image_dim"] is not None:
        inputs["encoder_hidden_states_image"] = torch.randn(
            batch, IMAGE_TOKENS, config["image_dim"], generator=g
        )
    return inputs


def _compare(
    config: dict[str, Any], label: str, reference_only: dict[str, Any] | None = None, **inputs: Any
) -> None:
    ref, ours = parity_pair(DiffusersSkyReelsV2, SkyReelsV2Transformer3DModel, config)
    with torch.no_grad():
        expected = ref(**inputs, **(reference_only or {}), return_dict=False)[0]
        actual = ours(**inputs)
    assert_parity(actual, expected, f"skyreels-v2 {label}", min_db=MIN_DB, min_cos=0.99999)


@pytest.mark.parametrize("config", [T2V, I2V, DF, DF_CAUSAL], ids=["t2v", "i2v", "df", "df-causal"])
def test_state_dict_layout_matches_diffusers(config: dict[str, Any]) -> None:
    ref = DiffusersSkyReelsV2(**config)
    with torch.device("meta"):
        ours = SkyReelsV2Transformer3DModel(SkyReelsV2TransformerConfig(**config))
    assert_same_state_dict_layout(ours, ref)


def test_t2v_parity_per_sample_timesteps() -> None:
    _compare(T2V, "t2v b=2", timestep=torch.tensor([999.0, 137.25]), **_inputs(T2V, 2))


def test_t2v_parity_integer_timesteps() -> None:
    """The UniPC scheduler's int64 timesteps, as the pipeline passes them."""
    _compare(T2V, "t2v b=1 int", timestep=torch.tensor([961]), **_inputs(T2V, 1, (1, 4, 10)))


def test_i2v_parity() -> None:
    _compare(I2V, "i2v b=2", timestep=torch.tensor([875.0, 40.0]), **_inputs(I2V, 2))


@pytest.mark.parametrize("fps", [[0], [1]])
def test_fps_injection_parity(fps: list[int]) -> None:
    _compare(DF, f"fps={fps} b=2", timestep=torch.tensor([500.0, 20.0]), fps=fps, **_inputs(DF, 2))


@pytest.mark.parametrize("config", [DF, DF_CAUSAL], ids=["df", "df-causal"])
def test_diffusion_forcing_per_frame_timesteps_parity(config: dict[str, Any]) -> None:
    """(batch, frames) timesteps: each latent frame at its own timestep (Diffusers' enable_diffusion_forcing)."""
    timestep = torch.tensor([[0.0, 0.0, 333.0, 999.0], [10.0, 250.0, 600.0, 950.0]])
    label = f"diffusion forcing, {config['num_frame_per_block']} frame(s) a block, b=2 F4"
    _compare(
        config,
        label,
        reference_only={"enable_diffusion_forcing": True},
        timestep=timestep,
        fps=[1],
        **_inputs(config, 2, (4, 6, 4)),
    )


def test_block_causal_attention_without_forcing_parity() -> None:
    """`num_frame_per_block > 1` masks the self-attention whatever the timesteps' shape."""
    _compare(
        DF_CAUSAL,
        "block-causal, per-sample timesteps",
        timestep=torch.tensor([700.0]),
        fps=[0],
        **_inputs(DF, 1, (4, 6, 4)),
    )


def test_fps_is_required_when_injected() -> None:
    with torch.device("meta"):
        ours = SkyReelsV2Transformer3DModel(SkyReelsV2TransformerConfig(**DF))
    inputs = {k: v.to("meta") for k, v in _inputs(DF, 1).items()}
    with pytest.raises(ValueError, match="fps"):
        ours(**inputs, timestep=torch.tensor([1.0], device="meta"))


def test_config_defaults_are_diffusers() -> None:
    """A config.json without a key takes Diffusers' SkyReels-V2 default, not Wan's."""
    ours = SkyReelsV2TransformerConfig()
    defaults = diffusers_init_defaults(DiffusersSkyReelsV2)
    keys = ["num_attention_heads", "attention_head_dim", "ffn_dim", "num_layers", "text_dim", "eps"]
    keys += ["cross_attn_norm", "inject_sample_info", "num_frame_per_block", "rope_max_seq_len"]
    assert {k: getattr(ours, k) for k in keys} == {k: defaults[k] for k in keys}


def test_per_row_fps_and_frame_timesteps_batch_as_alone() -> None:
    """The engine batches requests (and CFG branches) at their own timesteps and fps: each row of a batch
    equals that row run alone."""
    _, ours = parity_pair(DiffusersSkyReelsV2, SkyReelsV2Transformer3DModel, DF_CAUSAL)
    inputs = _inputs(DF_CAUSAL, 2, (4, 6, 4))
    timestep = torch.tensor([[100.0, 100.0, 100.0, 100.0], [900.0, 900.0, 900.0, 900.0]])
    fps = torch.tensor([0, 1])
    with torch.no_grad():
        batched = ours(**inputs, timestep=timestep, fps=fps)
        for i in range(2):
            alone = ours(
                **{k: v[i : i + 1] for k, v in inputs.items()},
                timestep=timestep[i : i + 1],
                fps=fps[i : i + 1],
            )
            torch.testing.assert_close(batched[i : i + 1], alone, rtol=1e-5, atol=1e-5)
