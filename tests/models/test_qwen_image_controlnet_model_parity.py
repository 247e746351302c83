"""The native Qwen-Image ControlNet against Diffusers' `QwenImageControlNetModel`, and the Qwen-Image DiT's
ControlNet residuals against Diffusers' transformer (`controlnet_block_samples`, interval arithmetic), on
tiny random weights (fp32). Residuals for some batch rows: those rows as if run alone with them, the other
rows bit-identical to a batch without residuals."""

from __future__ import annotations

import pytest
import torch
from diffusers import QwenImageControlNetModel as DiffusersControlNet
from diffusers import QwenImageTransformer2DModel as DiffusersQwen

from diffserve.models.controlnets.qwen_image import QwenControlNetBatch, QwenImageControlNetModel
from diffserve.models.controlnets.residuals import BlockResiduals
from diffserve.models.dits.qwen_image import QwenImageTransformer2DModel
from diffserve.testing.parity import assert_parity, assert_same_state_dict_layout, parity_pair

CONFIG = {
    "patch_size": 2,
    "in_channels": 16,
    "out_channels": 4,
    "num_layers": 3,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,
    "axes_dims_rope": (4, 6, 6),
}
H, W, TXT = 3, 4, 5
SHAPES = [(1, H, W)]


def _inputs(batch: int, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(batch, H * W, CONFIG["in_channels"], generator=g),
        "encoder_hidden_states": torch.randn(batch, TXT, CONFIG["joint_attention_dim"], generator=g),
        "timestep": torch.rand(batch, generator=g),
    }


@pytest.mark.parametrize("extra_channels", [0, 4], ids=["plain", "inpainting"])
def test_controlnet_samples_match_diffusers(extra_channels) -> None:
    """Plain, and the inpainting kind (`extra_condition_channels`: the packed mask's 4 channels)."""
    config = {**CONFIG, "num_layers": 2, "extra_condition_channels": extra_channels}
    ref, ours = parity_pair(DiffusersControlNet, QwenImageControlNetModel, config)
    assert_same_state_dict_layout(ours, ref)
    assert ours.config.inpainting == bool(extra_channels)
    inputs = _inputs(2)
    control = torch.randn(
        2, H * W, CONFIG["in_channels"] + extra_channels, generator=torch.Generator().manual_seed(7)
    )
    with torch.no_grad():
        want = ref(
            **inputs, controlnet_cond=control, conditioning_scale=0.7, encoder_hidden_states_mask=None,
            img_shapes=SHAPES * 2, return_dict=False,
        )  # fmt: skip
        got = ours(
            QwenControlNetBatch(
                latents=inputs["hidden_states"], control=control, text=inputs["encoder_hidden_states"],
                text_mask=None, timestep=inputs["timestep"], scales=torch.full((2,), 0.7),
                img_shapes=[SHAPES] * 2,
            )
        )  # fmt: skip
    assert len(got) == len(want) == 2
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_parity(g, w, f"ControlNet sample {i}", min_db=100)


def test_a_negative_channel_count_is_refused() -> None:
    with pytest.raises(ValueError, match="extra_condition_channels must be >= 0"):
        QwenImageControlNetModel.from_config({**CONFIG, "extra_condition_channels": -4})


@pytest.mark.parametrize("n_samples", [1, 2, 3])
def test_dit_adds_block_samples_as_diffusers(n_samples) -> None:
    ref, ours = parity_pair(DiffusersQwen, QwenImageTransformer2DModel, CONFIG)
    inputs = _inputs(2)
    g = torch.Generator().manual_seed(3)
    samples = [torch.randn(2, H * W, 32, generator=g) for _ in range(n_samples)]
    with torch.no_grad():
        want = ref(
            **inputs, encoder_hidden_states_mask=None, img_shapes=[SHAPES] * 2,
            controlnet_block_samples=samples, return_dict=False,
        )[0]  # fmt: skip
        got = ours(
            **inputs,
            encoder_hidden_states_mask=None,
            img_shapes=[SHAPES] * 2,
            controlnet_block_samples=samples,
        )
    assert_parity(got, want, f"DiT with {n_samples} ControlNet samples", min_db=100)


def test_residuals_on_some_rows() -> None:
    _, ours = parity_pair(DiffusersQwen, QwenImageTransformer2DModel, CONFIG)
    inputs = _inputs(3)
    g = torch.Generator().manual_seed(4)
    samples = [torch.randn(1, H * W, 32, generator=g) for _ in range(3)]
    common = dict(encoder_hidden_states_mask=None, img_shapes=[SHAPES] * 3)
    with torch.no_grad():
        plain = ours(**inputs, **common)
        mixed = ours(
            **inputs, **common, controlnet_residuals=[BlockResiduals(double=samples, single=(), rows=(1,))]
        )
        alone = ours(
            **{k: v[1:2] for k, v in inputs.items()}, encoder_hidden_states_mask=None, img_shapes=[SHAPES],
            controlnet_block_samples=samples,
        )  # fmt: skip
    assert torch.equal(mixed[0], plain[0]) and torch.equal(mixed[2], plain[2])
    assert_parity(mixed[1:2], alone, "the controlled row as alone", min_db=100)
    assert not torch.allclose(mixed[1], plain[1])
