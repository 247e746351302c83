"""Native LTX-2 audio-video DiT against Diffusers' `LTX2VideoTransformer3DModel` on the same tiny random
weights (fp32), one tiny config per checkpoint family:

* LTX20: LTX-2.0 (split RoPE, caption projections in the DiT); LTX20_INTERLEAVED: the interleaved layout;
* LTX23: LTX-2.3 (gated attention, cross-attention adaLN, STG-perturbable attention, no caption
  projection), with more video heads than audio heads so the audio<->video RoPE groups differ from the
  attention heads, as Diffusers builds them;
* LTX25: LTX-2.5 (bias-free video FFN, static text K/V modulation, keyframe embedding), with affine norms.

Video latents are 3 x 2 x 4 tokens (non-square), 7 audio frames, 8 text tokens of which sample 0 has 5
(left padding), batch 2. Parity is reported in dB (signal / error energy) and must reach 80 dB.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from diffserve.models.dits.ltx2 import LTX2VideoTransformer3DModel, LTX2VideoTransformerConfig
from diffserve.testing.parity import assert_parity, assert_same_state_dict_layout, parity_pair

diffusers = pytest.importorskip("diffusers")
from diffusers import LTX2VideoTransformer3DModel as DiffusersLTX2  # noqa: E402

LTX20: dict[str, Any] = {
    "in_channels": 8,
    "out_channels": 8,
    "patch_size": 1,
    "patch_size_t": 1,
    "num_attention_heads": 2,
    "attention_head_dim": 8,  # width 16: 3-axis RoPE has 2 padded pairs
    "cross_attention_dim": 16,
    "vae_scale_factors": (8, 32, 32),
    "pos_embed_max_pos": 20,
    "base_height": 2048,
    "base_width": 2048,
    "gated_attn": False,
    "cross_attn_mod": False,
    "audio_in_channels": 6,
    "audio_out_channels": 6,
    "audio_patch_size": 1,
    "audio_patch_size_t": 1,
    "audio_num_attention_heads": 2,
    "audio_attention_head_dim": 6,
    "audio_cross_attention_dim": 12,
    "audio_scale_factor": 4,
    "audio_pos_embed_max_pos": 20,
    "audio_sampling_rate": 16000,
    "audio_hop_length": 160,
    "audio_gated_attn": False,
    "audio_cross_attn_mod": False,
    "num_layers": 2,
    "activation_fn": "gelu-approximate",
    "qk_norm": "rms_norm_across_heads",
    "norm_elementwise_affine": False,
    "norm_eps": 1e-6,
    "caption_channels": 12,
    "attention_bias": True,
    "attention_out_bias": True,
    "rope_theta": 10000.0,
    "rope_double_precision": True,
    "causal_offset": 1,
    "timestep_scale_multiplier": 1000,
    "cross_attn_timestep_scale_multiplier": 1000,
    "rope_type": "split",
    "use_prompt_embeddings": True,
    "perturbed_attn": False,
}
LTX20_INTERLEAVED: dict[str, Any] = {
    **LTX20,
    "rope_type": "interleaved",
    "cross_attn_timestep_scale_multiplier": 1,
}
LTX23: dict[str, Any] = {
    **LTX20,
    "num_attention_heads": 4,
    "attention_head_dim": 4,
    "audio_attention_head_dim": 8,
    "audio_cross_attention_dim": 16,
    "gated_attn": True,
    "cross_attn_mod": True,
    "audio_gated_attn": True,
    "audio_cross_attn_mod": True,
    "use_prompt_embeddings": False,
    "perturbed_attn": True,
    "num_layers": 3,
}
LTX25: dict[str, Any] = {
    **LTX23,
    "ff_bias": False,
    "use_prompt_adaln_single": False,
    "use_keyframes_abs_pos_embedding": True,
    "norm_elementwise_affine": True,
}
CONFIGS = {"ltx20": LTX20, "ltx20-interleaved": LTX20_INTERLEAVED, "ltx23": LTX23, "ltx25": LTX25}
GRID = (3, 2, 4)  # latent frames, height, width
AUDIO_FRAMES = 7
TEXT_LEN = 8
MIN_DB = 80.0


def _pair(config: dict[str, Any]) -> tuple[torch.nn.Module, LTX2VideoTransformer3DModel]:
    """A seeded Diffusers model (every tensor perturbed, so no gate or norm is trivial) and the native model
    loaded from its state dict through the meta device."""
    return parity_pair(DiffusersLTX2, LTX2VideoTransformer3DModel, config, perturb=0.1)


def _inputs(ref: torch.nn.Module, config: dict[str, Any], fps: float = 24.0) -> dict[str, Any]:
    """The pipelines' call: per-sample timesteps (sigma = timestep), one mask for both modalities,
    RoPE coordinates from the model's own builders."""
    g = torch.Generator().manual_seed(1)
    batch, (frames, height, width) = 2, GRID
    text_dim = (
        config["caption_channels"] if config["use_prompt_embeddings"] else config["cross_attention_dim"]
    )
    audio_text_dim = (
        config["caption_channels"] if config["use_prompt_embeddings"] else config["audio_cross_attention_dim"]
    )
    mask = torch.ones(batch, TEXT_LEN, dtype=torch.int64)
    mask[0, :3] = 0  # left padding, as the Gemma tokenizer pads
    timestep = torch.tensor([700.0, 250.0])
    return {
        "hidden_states": torch.randn(batch, frames * height * width, config["in_channels"], generator=g),
        "audio_hidden_states": torch.randn(batch, AUDIO_FRAMES, config["audio_in_channels"], generator=g),
        "encoder_hidden_states": torch.randn(batch, TEXT_LEN, text_dim, generator=g),
        "audio_encoder_hidden_states": torch.randn(batch, TEXT_LEN, audio_text_dim, generator=g),
        "timestep": timestep,
        "sigma": timestep,
        "encoder_attention_mask": mask,
        "audio_encoder_attention_mask": mask,
        "num_frames": frames,
        "height": height,
        "width": width,
        "fps": fps,
        "audio_num_frames": AUDIO_FRAMES,
        "video_coords": ref.rope.prepare_video_coords(
            batch, frames, height, width, torch.device("cpu"), fps=fps
        ),
        "audio_coords": ref.audio_rope.prepare_audio_coords(batch, AUDIO_FRAMES, torch.device("cpu")),
    }


def _compare(ref: torch.nn.Module, ours: LTX2VideoTransformer3DModel, label: str, **inputs: Any) -> None:
    with torch.no_grad():
        expected = ref(**inputs, return_dict=False)
        got = ours(**inputs, return_dict=False)
    for name, out, exp in zip(("video", "audio"), got, expected, strict=True):
        assert_parity(out, exp, f"ltx2 dit {label} {name}", min_db=MIN_DB)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_state_dict_keys_and_shapes_match_diffusers(name: str) -> None:
    ref = DiffusersLTX2(**CONFIGS[name])
    with torch.device("meta"):
        ours = LTX2VideoTransformer3DModel(LTX2VideoTransformerConfig(**CONFIGS[name]))
    assert_same_state_dict_layout(ours, ref)


def test_rope_coordinates_match_diffusers() -> None:
    ref = DiffusersLTX2(**LTX23)
    with torch.device("meta"):
        ours = LTX2VideoTransformer3DModel(LTX2VideoTransformerConfig(**LTX23))
    cpu = torch.device("cpu")
    for fps in (24.0, 25.0):
        torch.testing.assert_close(
            ours.rope.prepare_video_coords(2, 3, 2, 4, cpu, fps=fps),
            ref.rope.prepare_video_coords(2, 3, 2, 4, cpu, fps=fps),
            rtol=0,
            atol=0,
        )
    for shift in (0, 3):
        torch.testing.assert_close(
            ours.audio_rope.prepare_audio_coords(2, 7, cpu, shift=shift),
            ref.audio_rope.prepare_audio_coords(2, 7, cpu, shift=shift),
            rtol=0,
            atol=0,
        )


@pytest.mark.parametrize("name", list(CONFIGS))
def test_parity_batch2_padded_text(name: str) -> None:
    """The text-to-video call: per-sample timesteps, padded text; LTX-2.3/2.5 also with use_cross_timestep
    and separate audio sigma."""
    ref, ours = _pair(CONFIGS[name])
    inputs = _inputs(ref, CONFIGS[name], fps=25.0)
    _compare(ref, ours, f"{name} t2v", **inputs)
    if CONFIGS[name]["cross_attn_mod"]:
        inputs.update(use_cross_timestep=True, audio_sigma=torch.tensor([400.0, 900.0]))
        _compare(ref, ours, f"{name} cross-timestep", **inputs)


@pytest.mark.parametrize("name", ["ltx20", "ltx23"])
def test_parity_image_to_video_per_token_timesteps(name: str) -> None:
    """The image-to-video call: the first latent frame is clean (per-token video timestep 0), audio keeps
    the per-sample timestep."""
    ref, ours = _pair(CONFIGS[name])
    inputs = _inputs(ref, CONFIGS[name])
    conditioning = torch.zeros(2, math.prod(GRID))
    conditioning[:, : GRID[1] * GRID[2]] = 1.0
    t = inputs["timestep"]
    inputs.update(timestep=t.unsqueeze(-1) * (1 - conditioning), audio_timestep=t)
    _compare(ref, ours, f"{name} i2v", **inputs)


def test_parity_guidance_passes() -> None:
    """LTX-2.3's extra guidance passes: STG (all rows, and a per-row mask), modality isolation."""
    ref, ours = _pair(LTX23)
    inputs = _inputs(ref, LTX23)
    _compare(ref, ours, "ltx23 stg", **inputs, spatio_temporal_guidance_blocks=[1])
    _compare(
        ref,
        ours,
        "ltx23 stg-mask",
        **inputs,
        spatio_temporal_guidance_blocks=[0, 2],
        perturbation_mask=torch.tensor([1.0, 0.0]),
    )
    _compare(ref, ours, "ltx23 isolated", **inputs, isolate_modalities=True)


def test_parity_coords_from_grid_self_mask_and_keyframes() -> None:
    """RoPE coordinates built inside forward, IC-LoRA's video self-attention weights and LTX-2.5 keyframe tokens."""
    ref, ours = _pair(LTX25)
    inputs = _inputs(ref, LTX25, fps=30.0)
    del inputs["video_coords"], inputs["audio_coords"]
    g = torch.Generator().manual_seed(2)
    tokens = math.prod(GRID)
    self_mask = (torch.rand(2, tokens, tokens, generator=g) > 0.3).float()
    self_mask[:, :, :4] = 0.5
    keyframes = torch.zeros(2, tokens, 1)
    keyframes[1, :8] = 1.0
    _compare(
        ref,
        ours,
        "ltx25 self-mask",
        **inputs,
        video_self_attention_mask=self_mask,
        video_keyframes_mask=keyframes,
    )


def test_batch_rows_are_independent() -> None:
    ref, ours = _pair(LTX23)
    inputs = _inputs(ref, LTX23)
    with torch.no_grad():
        video, audio = ours(**inputs)
        for i in range(2):
            row = {k: v[i : i + 1] if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
            v1, a1 = ours(**row)
            torch.testing.assert_close(v1, video[i : i + 1], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(a1, audio[i : i + 1], rtol=1e-5, atol=1e-5)


def test_config_and_call_errors() -> None:
    with pytest.raises(ValueError, match="unknown keys"):
        LTX2VideoTransformer3DModel.from_config({**LTX20, "not_a_key": 1})
    with pytest.raises(ValueError, match="rope_type"):
        LTX2VideoTransformerConfig(**{**LTX20, "rope_type": "rotate"})
    with pytest.raises(ValueError, match="audio_cross_attention_dim"):
        LTX2VideoTransformerConfig(**{**LTX20, "audio_cross_attention_dim": 8})
    defaults = LTX2VideoTransformerConfig()
    assert (defaults.inner_dim, defaults.audio_inner_dim, defaults.rope_type) == (4096, 2048, "interleaved")
    ref, ours = _pair(LTX23)
    inputs = _inputs(ref, LTX23)
    with pytest.raises(ValueError, match="return_dict"):
        ours(**inputs, return_dict=True)
    with pytest.raises(ValueError, match="sigma"):
        ours(**{**inputs, "sigma": None})
    with pytest.raises(ValueError, match="timestep"):
        ours(**{**inputs, "timestep": torch.ones(3)})
