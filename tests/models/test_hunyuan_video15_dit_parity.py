"""Native HunyuanVideo 1.5 DiT against Diffusers' `HunyuanVideo15Transformer3DModel` on the same tiny
random weights (fp32).

Latents are (batch 2, 2 * 4 + 1 channels, F=3, H=4, W=6): the pipeline's [noisy; condition; mask]
concat on a non-square grid. Both text inputs carry padding that differs per row (a hole in one Qwen
mask, an empty ByT5 mask as for a prompt without quoted text), and the image states are SigLIP-like
(I2V) or zeros (what the T2V pipeline passes). Parity is reported as PSNR over the reference's peak.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch

from diffserve.models.dits.hunyuan_video15 import (
    HunyuanVideo15Transformer3DModel,
    HunyuanVideo15TransformerConfig,
    hunyuan_video15_rope_tables,
)
from diffserve.testing.parity import (
    assert_parity,
    assert_same_state_dict_layout,
    diffusers_init_defaults,
    parity_pair,
    psnr_db,
)

diffusers = pytest.importorskip("diffusers")
from diffusers import HunyuanVideo15Transformer3DModel as DiffusersHV15  # noqa: E402

LATENT_CHANNELS = 4
#: The smallest config that exercises every branch of the released checkpoints' architecture.
TINY: dict[str, Any] = {
    "in_channels": 2 * LATENT_CHANNELS + 1,
    "out_channels": LATENT_CHANNELS,
    "num_attention_heads": 2,
    "attention_head_dim": 16,
    "num_layers": 2,
    "num_refiner_layers": 2,
    "mlp_ratio": 2.0,  # the refiner keeps 4.0 whatever this says
    "patch_size": 1,
    "patch_size_t": 1,
    "qk_norm": "rms_norm",
    "text_embed_dim": 24,
    "text_embed_2_dim": 20,
    "image_embed_dim": 12,
    "rope_theta": 256.0,
    "rope_axes_dim": (4, 6, 6),
    "target_size": 640,
    "task_type": "i2v",
    "use_meanflow": False,
}
#: Spatial patches (2x2) and MeanFlow's second timestep embedder.
PATCH2_MEANFLOW: dict[str, Any] = {**TINY, "patch_size": 2, "mlp_ratio": 4.0, "use_meanflow": True}
MIN_PSNR_DB = 80.0
#: bf16 runs (a few bf16 rounding steps apart from Diffusers where CPU kernels differ).
BF16_MIN_PSNR_DB = 60.0


def _pair(config: dict[str, Any]) -> tuple[torch.nn.Module, HunyuanVideo15Transformer3DModel]:
    """A seeded Diffusers model and the native model loaded from its state dict through the meta device,
    every tensor perturbed (norm weights start at one, biases at zero) so that no term is trivial."""
    return parity_pair(DiffusersHV15, HunyuanVideo15Transformer3DModel, config)


Pair = tuple[torch.nn.Module, HunyuanVideo15Transformer3DModel]


@pytest.fixture(scope="module")
def tiny_pair() -> Pair:
    return _pair(TINY)


@pytest.fixture(scope="module")
def patch2_pair() -> Pair:
    return _pair(PATCH2_MEANFLOW)


def _inputs(
    config: dict[str, Any], image: bool, fhw: tuple[int, int, int] = (3, 4, 6)
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    text_mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [1, 1, 0, 1, 0, 0, 0]])  # row 1 has a hole
    glyph_mask = torch.tensor([[1, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0]])  # row 1: no quoted text
    glyph = torch.randn(2, 6, config["text_embed_2_dim"], generator=g)
    glyph[1] = 0  # the pipeline passes zeros for a prompt without glyph text
    return {
        "hidden_states": torch.randn(2, config["in_channels"], *fhw, generator=g),
        "timestep": torch.tensor([900.0, 250.0]),
        "encoder_hidden_states": torch.randn(2, 7, config["text_embed_dim"], generator=g),
        "encoder_attention_mask": text_mask,
        "encoder_hidden_states_2": glyph,
        "encoder_attention_mask_2": glyph_mask,
        "image_embeds": torch.randn(2, 5, config["image_embed_dim"], generator=g)
        if image
        else torch.zeros(2, 5, config["image_embed_dim"]),
    }


def _reference(ref: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return ref(**inputs, return_dict=False)[0]


def _compare(
    ours: HunyuanVideo15Transformer3DModel,
    expected: torch.Tensor,
    label: str,
    min_db: float = MIN_PSNR_DB,
    **inputs: Any,
) -> torch.Tensor:
    with torch.no_grad():
        out = ours(**inputs).float()
    assert out.shape == expected.shape == (2, LATENT_CHANNELS, *inputs["hidden_states"].shape[2:])
    assert torch.isfinite(out).all()
    assert_parity(out, expected, f"hunyuan_video15 parity {label}", min_db=min_db, metric=psnr_db)
    return out


def test_state_dict_keys_and_shapes_match_diffusers(tiny_pair: Pair, patch2_pair: Pair) -> None:
    """The fixtures loaded strict; here the names and shapes are compared outright."""
    for ref, ours in (tiny_pair, patch2_pair):
        assert_same_state_dict_layout(ours, ref)


def test_rope_tables_match_diffusers() -> None:
    """Half-width float32 tables equal the even columns of Diffusers' interleaved full-width tables."""
    rope = diffusers.models.transformers.transformer_hunyuan_video15.HunyuanVideo15RotaryPosEmbed(
        1, 1, [16, 56, 56], 256.0
    )
    ref_cos, ref_sin = rope(torch.zeros(1, 1, 5, 6, 10))
    cos, sin = hunyuan_video15_rope_tables(5, 6, 10, (16, 56, 56), 256.0, torch.device("cpu"))
    torch.testing.assert_close(cos, ref_cos[:, 0::2], rtol=0, atol=0)
    torch.testing.assert_close(sin, ref_sin[:, 0::2], rtol=0, atol=0)


def test_i2v_and_t2v_parity_batch2_padded_masks(tiny_pair: Pair) -> None:
    ref, ours = tiny_pair
    for image in (True, False):
        inputs = _inputs(TINY, image)
        _compare(ours, _reference(ref, inputs), f"{'i2v' if image else 't2v'} b=2 F3xH4xW6", **inputs)

    # T2V: no image tokens and no glyph tokens given as None is the same as zeros with empty masks.
    inputs = _inputs(TINY, image=False)
    inputs["encoder_attention_mask_2"] = torch.zeros_like(inputs["encoder_attention_mask_2"])
    expected = _reference(ref, inputs)
    none_inputs = {
        **inputs,
        "image_embeds": None,
        "encoder_hidden_states_2": None,
        "encoder_attention_mask_2": None,
    }
    _compare(ours, expected, "t2v, image and glyph None", **none_inputs)


def test_row_without_any_context_token(tiny_pair: Pair) -> None:
    """A T2V row whose Qwen mask is empty and that has no glyphs: its refiner embedding is NaN (a mean
    over no tokens) but, as in Diffusers, none of it reaches the video."""
    ref, ours = tiny_pair
    inputs = _inputs(TINY, image=False)
    inputs["encoder_attention_mask"][1] = 0
    _compare(ours, _reference(ref, inputs), "row without context tokens", **inputs)


def test_patch2_meanflow_parity_and_unpadded_rows(patch2_pair: Pair) -> None:
    """2x2 patches, MeanFlow's timestep_r; then full masks (no attention mask at all), integer timesteps."""
    ref, ours = patch2_pair
    inputs = _inputs(PATCH2_MEANFLOW, image=True, fhw=(2, 4, 6))
    inputs["timestep_r"] = torch.tensor([600.0, 0.0])
    _compare(ours, _reference(ref, inputs), "patch 2 meanflow", **inputs)
    inputs["encoder_attention_mask"] = torch.ones_like(inputs["encoder_attention_mask"])
    inputs["encoder_attention_mask_2"] = torch.ones_like(inputs["encoder_attention_mask_2"])
    inputs["timestep"] = torch.tensor([961.0, 20.0])
    inputs["timestep_r"] = torch.tensor([700.0, 0.0])
    out = _compare(ours, _reference(ref, inputs), "patch 2 meanflow, unpadded", **inputs)
    # Integer timesteps (which Diffusers' forward cannot take) mean the same values.
    with torch.no_grad():
        as_int = ours(**{**inputs, "timestep": torch.tensor([961, 20]), "timestep_r": torch.tensor([700, 0])})
    torch.testing.assert_close(as_int, out, rtol=0, atol=0)


def test_bf16_parity(tiny_pair: Pair) -> None:
    """bf16 weights and activations, padded and unpadded context: same op order and rounding points as
    Diffusers. Bit-identical on CPUs with AVX-512; on an AVX2-only CPU torch's bf16 kernels round the
    attentions one bf16 step apart (75 dB from the first block on), so the bar is bf16's."""
    ref, ours = (copy.deepcopy(m).to(torch.bfloat16) for m in tiny_pair)
    inputs = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in _inputs(TINY, True).items()}
    _compare(ours, _reference(ref, inputs).float(), "i2v bf16", BF16_MIN_PSNR_DB, **inputs)
    inputs["encoder_attention_mask"] = torch.ones_like(inputs["encoder_attention_mask"])
    _compare(ours, _reference(ref, inputs).float(), "i2v bf16 unpadded text", BF16_MIN_PSNR_DB, **inputs)


def test_rows_are_independent_mixed_t2v_i2v_batch(tiny_pair: Pair) -> None:
    """Each row of a batch equals that row run alone through Diffusers, even when the rows' padding
    differs and one row is text-to-video and the other image-to-video (decided per row)."""
    ref, ours = tiny_pair
    inputs = _inputs(TINY, image=True)
    inputs["image_embeds"][1] = 0
    with torch.no_grad():
        batched = ours(**inputs)
    for row in range(2):
        single = {k: v[row : row + 1] for k, v in inputs.items()}
        label = f"hunyuan_video15 mixed batch row {row}"
        assert_parity(
            batched[row : row + 1], _reference(ref, single), label, min_db=MIN_PSNR_DB, metric=psnr_db
        )


def test_from_config_rejects_unknown_keys_and_keeps_defaults() -> None:
    with pytest.raises(ValueError, match="HunyuanVideo15Transformer3DModel config has unknown keys"):
        HunyuanVideo15Transformer3DModel.from_config({**TINY, "guidance_embeds": True})
    defaults = HunyuanVideo15TransformerConfig()
    diffusers_defaults = diffusers_init_defaults(DiffusersHV15)
    assert {f.name for f in dataclasses.fields(defaults)} == set(diffusers_defaults)
    for name, default in diffusers_defaults.items():
        value = getattr(defaults, name)
        expected = tuple(default) if isinstance(default, list | tuple) else default
        assert value == expected, f"{name}: {value!r} != Diffusers' {expected!r}"


def test_invalid_configs_and_inputs_are_errors() -> None:
    with pytest.raises(ValueError, match="qk_norm"):
        HunyuanVideo15TransformerConfig(**{**TINY, "qk_norm": "layer_norm"})
    with pytest.raises(ValueError, match="rope_axes_dim"):
        HunyuanVideo15TransformerConfig(**{**TINY, "rope_axes_dim": (4, 4, 4)})
    with torch.device("meta"):
        model = HunyuanVideo15Transformer3DModel(HunyuanVideo15TransformerConfig(**TINY))
        patch2 = HunyuanVideo15Transformer3DModel(HunyuanVideo15TransformerConfig(**PATCH2_MEANFLOW))
    meta = {k: v.to("meta") for k, v in _inputs(TINY, image=True).items()}
    with pytest.raises(ValueError, match="timestep_r"):
        model(**meta, timestep_r=torch.zeros(2))
    with pytest.raises(ValueError, match="multiple of"):
        patch2(**{**meta, "hidden_states": meta["hidden_states"][..., :5]})
    with pytest.raises(ValueError, match="timestep"):
        model(**{**meta, "timestep": torch.zeros(3)})
    with pytest.raises(ValueError, match="together"):
        model(**{**meta, "encoder_attention_mask_2": None})
    with pytest.raises(ValueError, match="mask of encoder_hidden_states"):
        model(**{**meta, "encoder_attention_mask": meta["encoder_attention_mask"][:, :3]})
    with pytest.raises(ValueError, match="attention_kwargs"):
        model(**meta, attention_kwargs={"scale": 0.5})
