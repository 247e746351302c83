"""Native Qwen-Image DiT against Diffusers' `QwenImageTransformer2DModel` on the same tiny random weights (fp32)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from diffserve.models.dits.qwen_image import QwenImageTransformer2DModel, QwenImageTransformerConfig
from diffserve.testing.parity import (
    assert_parity,
    assert_same_state_dict_layout,
    native_from_reference,
    parity_pair,
)

diffusers = pytest.importorskip("diffusers")
from diffusers import QwenImageTransformer2DModel as DiffusersQwenImage  # noqa: E402

TINY: dict[str, Any] = {
    "patch_size": 2,
    "in_channels": 16,
    "out_channels": 4,
    "num_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,
    "axes_dims_rope": (4, 6, 6),
}
TINY_ZERO_COND: dict[str, Any] = {**TINY, "zero_cond_t": True}
#: Qwen-Image-Layered: layer-aware RoPE and the additional timestep embedding.
TINY_LAYERED: dict[str, Any] = {**TINY, "use_layer3d_rope": True, "use_additional_t_cond": True}

# Non-square generated image (6 x 4 patches) and, for edit calls, a 4 x 4 conditioning image.
GEN = (1, 6, 4)
COND = (1, 4, 4)


def _pair(config: dict[str, Any]) -> tuple[torch.nn.Module, QwenImageTransformer2DModel]:
    """A seeded Diffusers model and the native model loaded from its state dict through the meta device,
    every tensor perturbed (norm weights start at one) so no term is trivial."""
    return parity_pair(DiffusersQwenImage, QwenImageTransformer2DModel, config)


def _inputs(
    batch: int, shapes: list[tuple[int, int, int]], timestep: list[float], txt: int = 7, mask: bool = False
) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    seq = sum(f * h * w for f, h, w in shapes)
    inputs: dict[str, Any] = {
        "hidden_states": torch.randn(batch, seq, TINY["in_channels"], generator=g),
        "encoder_hidden_states": torch.randn(batch, txt, TINY["joint_attention_dim"], generator=g),
        "encoder_hidden_states_mask": None,
        "timestep": torch.tensor(timestep),
        "img_shapes": [list(shapes)] * batch,
    }
    if mask:
        m = torch.ones(batch, txt, dtype=torch.long)
        m[0, txt - 3 :] = 0  # row 0 has 3 padding tokens, the last row none
        inputs["encoder_hidden_states_mask"] = m
    return inputs


def _compare(
    ref: torch.nn.Module, ours: QwenImageTransformer2DModel, label: str, atol: float = 1e-4, **inputs
):
    with torch.no_grad():
        expected = ref(**inputs, return_dict=False)[0].float()
        out = ours(**inputs).float()
    assert_parity(out, expected, f"qwen-image parity {label}", max_abs=atol, min_cos=0.9999)


@pytest.mark.parametrize("config", [TINY, TINY_ZERO_COND], ids=["default", "zero_cond_t"])
def test_state_dict_keys_and_shapes_match_diffusers(config: dict[str, Any]) -> None:
    ref = DiffusersQwenImage(**config)
    with torch.device("meta"):
        ours = QwenImageTransformer2DModel(QwenImageTransformerConfig(**config))
    assert_same_state_dict_layout(ours, ref)


def test_rope_tables_match_diffusers() -> None:
    """The cos/sin tables equal Diffusers' complex table bit for bit, for an edit-style list of images."""
    ref, ours = _pair(TINY)
    img_freqs, txt_freqs = ref.pos_embed([[GEN, COND]], max_txt_seq_len=5, device=torch.device("cpu"))
    cos, sin = ours.rope_tables([[GEN, COND]], 5, torch.device("cpu"))
    expected = torch.cat([txt_freqs, img_freqs], dim=0)
    assert torch.equal(cos, expected.real) and torch.equal(sin, expected.imag)
    # Cached per shape: the next step gets the same tensors back.
    assert ours.rope_tables([[GEN, COND]], 5, torch.device("cpu"))[0] is cos


def test_parity_batch2_per_sample_timesteps_non_square() -> None:
    ref, ours = _pair(TINY)
    inputs = _inputs(2, [GEN], [0.9, 0.25])
    _compare(ref, ours, "b=2 6x4", **inputs)
    # Batching must not mix samples: each row equals the same sample run alone.
    with torch.no_grad():
        batched = ours(**inputs)
        for i in range(2):
            single = {
                **inputs,
                "hidden_states": inputs["hidden_states"][i : i + 1],
                "encoder_hidden_states": inputs["encoder_hidden_states"][i : i + 1],
                "timestep": inputs["timestep"][i : i + 1],
                "img_shapes": inputs["img_shapes"][i : i + 1],
            }
            torch.testing.assert_close(ours(**single), batched[i : i + 1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("config", [TINY, TINY_ZERO_COND], ids=["default", "zero_cond_t"])
def test_parity_with_text_mask(config: dict[str, Any]) -> None:
    ref, ours = _pair(config)
    _compare(
        ref,
        ours,
        f"{'zero_cond ' if config.get('zero_cond_t') else ''}masked b=2",
        **_inputs(2, [GEN], [0.7, 0.05], mask=True),
    )


@pytest.mark.parametrize("config", [TINY, TINY_ZERO_COND], ids=["default", "zero_cond_t"])
def test_parity_edit_two_images_per_sample(config: dict[str, Any]) -> None:
    ref, ours = _pair(config)
    label = f"{'zero_cond ' if config.get('zero_cond_t') else ''}edit 6x4+4x4 b=2"
    _compare(ref, ours, label, **_inputs(2, [GEN, COND], [0.8, 0.3], mask=True))


@pytest.mark.parametrize("config", [TINY, TINY_ZERO_COND], ids=["default", "zero_cond_t"])
def test_right_padded_masked_text_does_not_change_the_image(config: dict[str, Any]) -> None:
    """The CFG-batching contract: a sample alone with its unpadded text equals its row in a batch where
    its text is right-padded with garbage and masked (next to a longer, unmasked prompt)."""
    _, ours = _pair(config)
    g = torch.Generator().manual_seed(2)
    shapes = [GEN, COND] if config.get("zero_cond_t") else [GEN]
    seq = sum(f * h * w for f, h, w in shapes)
    x = torch.randn(2, seq, TINY["in_channels"], generator=g)
    short_txt = torch.randn(1, 5, TINY["joint_attention_dim"], generator=g)
    long_txt = torch.randn(1, 9, TINY["joint_attention_dim"], generator=g)
    garbage = 100 * torch.randn(1, 4, TINY["joint_attention_dim"], generator=g)
    txt = torch.cat([torch.cat([short_txt, garbage], dim=1), long_txt], dim=0)
    mask = torch.tensor([[1] * 5 + [0] * 4, [1] * 9], dtype=torch.bool)
    t = torch.tensor([0.6, 0.2])
    with torch.no_grad():
        alone = ours(x[:1], short_txt, None, t[:1], [shapes])
        batched = ours(x, txt, mask, t, [shapes, shapes])
    max_abs = (alone - batched[:1]).abs().max().item()
    print(f"[qwen-image padding invariance] max_abs_diff={max_abs:.3e}")
    assert max_abs <= 1e-4


def test_mixed_shapes_in_one_batch_use_per_sample_positions() -> None:
    """Deviation from Diffusers (which uses the first sample's shapes for all): 6x4 and 4x6 in one batch."""
    _, ours = _pair(TINY)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 24, TINY["in_channels"], generator=g)
    txt = torch.randn(2, 6, TINY["joint_attention_dim"], generator=g)
    t = torch.tensor([0.9, 0.4])
    shapes = [[(1, 6, 4)], [(1, 4, 6)]]
    with torch.no_grad():
        batched = ours(x, txt, None, t, shapes)
        for i in range(2):
            alone = ours(x[i : i + 1], txt[i : i + 1], None, t[i : i + 1], shapes[i : i + 1])
            torch.testing.assert_close(alone, batched[i : i + 1], rtol=1e-5, atol=1e-5)


def test_parity_bf16() -> None:
    """Half precision follows Diffusers' rounding (timestep rounded to bf16 first, same op order)."""
    ref, _ = _pair(TINY)
    ref = ref.to(torch.bfloat16)
    ours = native_from_reference(QwenImageTransformer2DModel, ref)
    inputs = _inputs(2, [GEN], [0.9, 0.013], mask=True)
    for k in ("hidden_states", "encoder_hidden_states"):
        inputs[k] = inputs[k].to(torch.bfloat16)
    _compare(ref, ours, "bf16 masked b=2", atol=2e-2, **inputs)


def test_config_errors() -> None:
    with pytest.raises(ValueError, match="QwenImageTransformer2DModel config has unknown keys"):
        QwenImageTransformer2DModel.from_config({**TINY, "num_single_layers": 3})
    with pytest.raises(ValueError, match="img_shapes"):
        with torch.device("meta"):
            ours = QwenImageTransformer2DModel(QwenImageTransformerConfig(**TINY))
        ours(
            torch.zeros(1, 20, 16, device="meta"),
            torch.zeros(1, 3, 32, device="meta"),
            None,
            torch.zeros(1, device="meta"),
            [[GEN]],
        )


def test_layered_state_dict_keys_and_shapes_match_diffusers() -> None:
    ref = DiffusersQwenImage(**TINY_LAYERED)
    with torch.device("meta"):
        ours = QwenImageTransformer2DModel(QwenImageTransformerConfig(**TINY_LAYERED))
    assert_same_state_dict_layout(ours, ref)
    assert "time_text_embed.addition_t_embedding.weight" in ours.state_dict()


# Layered shapes: the composite and its layers, then the input image (frame position -1). With 2x2
# patches and 5 layers the text starts after the layer index (5 > 2 // 2), the other branch of the rule.
LAYERED_SHAPES = [[GEN] * 3 + [GEN], [(1, 2, 2)] * 6 + [(1, 2, 2)]]


@pytest.mark.parametrize("shapes", LAYERED_SHAPES, ids=["3 layers 6x4", "6 layers 2x2"])
def test_layered_rope_tables_match_diffusers(shapes: list[tuple[int, int, int]]) -> None:
    ref, ours = _pair(TINY_LAYERED)
    img_freqs, txt_freqs = ref.pos_embed([shapes], max_txt_seq_len=5, device=torch.device("cpu"))
    cos, sin = ours.rope_tables([shapes], 5, torch.device("cpu"))
    expected = torch.cat([txt_freqs, img_freqs], dim=0)
    assert torch.equal(cos, expected.real) and torch.equal(sin, expected.imag)


@pytest.mark.parametrize("shapes", LAYERED_SHAPES, ids=["3 layers 6x4", "6 layers 2x2"])
@pytest.mark.parametrize("is_rgb", [[0, 0], [0, 1]], ids=["rgba", "mixed"])
def test_layered_parity(shapes: list[tuple[int, int, int]], is_rgb: list[int]) -> None:
    ref, ours = _pair(TINY_LAYERED)
    inputs = _inputs(2, shapes, [0.8, 0.3], mask=True)
    inputs["additional_t_cond"] = torch.tensor(is_rgb)
    _compare(ref, ours, f"layered {len(shapes) - 2} layers b=2 is_rgb={is_rgb}", **inputs)


def test_layered_needs_additional_t_cond() -> None:
    _, ours = _pair(TINY_LAYERED)
    inputs = _inputs(1, LAYERED_SHAPES[0], [0.5])
    with pytest.raises(ValueError, match="additional_t_cond"), torch.no_grad():
        ours(**inputs)
