"""Native CogVideoX DiT against Diffusers' `CogVideoXTransformer3DModel` on the same tiny random weights, in
each position scheme the released checkpoints use: CogVideoX 1.0 sin-cos (2B), 1.0 RoPE (5B), 1.0 RoPE with
learned positions (5B-I2V, 32 input channels), 1.5 RoPE with temporal patches (5B) and with the ofs
embedding (5B-I2V). Diffusers' rotary tables come from its pipeline's own `_prepare_rotary_positional_embeddings`.
Two requests share each forward, at different timesteps."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from diffserve.models.dits.cogvideox import CogVideoXTransformer3DModel, CogVideoXTransformerConfig
from diffserve.testing.parity import (
    assert_parity,
    assert_same_state_dict_layout,
    diffusers_init_defaults,
    parity_pair,
)

diffusers = pytest.importorskip("diffusers")

MIN_DB = 70.0
TEXT_LEN = 12
BASE: dict[str, Any] = {
    "num_attention_heads": 2,
    "attention_head_dim": 16,
    "in_channels": 4,
    "out_channels": 4,
    "time_embed_dim": 24,
    "text_embed_dim": 20,
    "num_layers": 2,
    "sample_width": 10,
    "sample_height": 8,
    "sample_frames": 9,
    "patch_size": 2,
    "max_text_seq_length": TEXT_LEN,
}
CONFIGS: dict[str, dict[str, Any]] = {
    "1.0 sincos": {},
    "1.0 rope": {"use_rotary_positional_embeddings": True},
    "1.0 rope learned i2v": {
        "use_rotary_positional_embeddings": True,
        "use_learned_positional_embeddings": True,
        "in_channels": 8,
    },
    "1.5 rope": {"use_rotary_positional_embeddings": True, "patch_size_t": 2, "patch_bias": False},
    "1.5 rope ofs i2v": {
        "use_rotary_positional_embeddings": True,
        "patch_size_t": 2,
        "ofs_embed_dim": 24,  # ofs_embed_dim = time_embed_dim, as released
        "in_channels": 8,
    },
}
#: (latent frames, latent height, latent width) per case: the configured size, and another one.
SIZES = [(3, 8, 10), (4, 6, 8), (2, 10, 6)]


def _reference_rope(model, frames: int, height: int, width: int):
    fake = SimpleNamespace(vae_scale_factor_spatial=8, transformer=model)
    return diffusers.CogVideoXPipeline._prepare_rotary_positional_embeddings(
        fake, height * 8, width * 8, frames, torch.device("cpu")
    )


def test_config_defaults_are_diffusers() -> None:
    defaults = diffusers_init_defaults(diffusers.CogVideoXTransformer3DModel)
    ours = CogVideoXTransformerConfig()
    assert {k: getattr(ours, k) for k in defaults} == defaults


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("size", SIZES)
def test_forward_matches(name: str, size: tuple[int, int, int]) -> None:
    config = {**BASE, **CONFIGS[name]}
    if config.get("use_learned_positional_embeddings") and size != SIZES[0]:
        size = (5, *SIZES[0][1:])  # learned positions: the sample size only (another length: sin-cos)
    reference, native = parity_pair(
        diffusers.CogVideoXTransformer3DModel, CogVideoXTransformer3DModel, config
    )
    if config.get("use_learned_positional_embeddings"):
        with torch.no_grad():
            reference.patch_embed.pos_embedding.normal_()
            native.patch_embed.pos_embedding.copy_(reference.patch_embed.pos_embedding)
    assert_same_state_dict_layout(native, reference)
    frames, height, width = size
    if config.get("patch_size_t") and (height > BASE["sample_height"] or width > BASE["sample_width"]):
        pytest.skip("1.5's positions stop at the sample size (Diffusers cannot run a larger grid)")
    if config.get("patch_size_t"):
        frames += frames % 2  # 1.5's pipelines pad the latent frames to whole temporal patches
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, frames, config["in_channels"], height, width, generator=g)
    text = torch.randn(2, TEXT_LEN, config["text_embed_dim"], generator=g)
    t = torch.tensor([999, 421])
    ofs = torch.full((1,), 2.0) if config.get("ofs_embed_dim") else None
    rope = (
        _reference_rope(reference, frames, height, width)
        if config.get("use_rotary_positional_embeddings")
        else None
    )
    with torch.no_grad():
        want = reference(x, text, t, ofs=ofs, image_rotary_emb=rope, return_dict=False)[0]
        got = native(x, text, t, ofs=ofs)
    assert got.shape == want.shape
    assert_parity(got, want, f"cogvideox dit {name} {size}", min_db=MIN_DB)


def test_released_layouts_build_on_meta_with_diffusers_keys() -> None:
    for extra in (
        {},
        {"use_rotary_positional_embeddings": True, "use_learned_positional_embeddings": True},
        {"use_rotary_positional_embeddings": True, "patch_size_t": 2, "ofs_embed_dim": 512},
    ):
        with torch.device("meta"):
            ref = diffusers.CogVideoXTransformer3DModel(num_layers=1, **extra)
            ours = CogVideoXTransformer3DModel.from_config(dict(ref.config))
        assert_same_state_dict_layout(ours, ref)


def test_a_15_grid_past_the_sample_size_is_refused() -> None:
    config = {**BASE, **CONFIGS["1.5 rope"]}
    _, native = parity_pair(diffusers.CogVideoXTransformer3DModel, CogVideoXTransformer3DModel, config)
    x = torch.randn(1, 2, 4, 8, 12)
    with pytest.raises(ValueError, match="larger than the model's"), torch.no_grad():
        native(x, torch.randn(1, TEXT_LEN, 20), torch.tensor([10]))


@pytest.mark.parametrize(
    ("updates", "match"),
    [
        # RoPE: a quarter of the head over frames and 3/8 over rows and over columns, each in pairs.
        ({"attention_head_dim": 24, "use_rotary_positional_embeddings": True}, "multiple of 16 with rotary"),
        # Sin-cos: 3/8 of the width over rows and over columns, 1/4 over frames, each in pairs.
        ({"num_attention_heads": 3, "attention_head_dim": 24}, "multiple of 16 with added positions"),
        ({"ofs_embed_dim": 16, "use_rotary_positional_embeddings": True}, "ofs_embed_dim .16. must equal"),
    ],
)
def test_configs_diffusers_cannot_build_are_refused(updates, match) -> None:
    """Widths Diffusers' position tables fail on, and an ofs embedding of another width than the timestep's
    (Diffusers fails adding them), are refused when the config is read, not inside a request."""
    with pytest.raises(ValueError, match=match):
        CogVideoXTransformerConfig(**{**BASE, **updates})
