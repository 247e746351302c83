"""The native SD3 ControlNet against Diffusers' `SD3ControlNetModel`, and the SD3 DiT's ControlNet residuals
against Diffusers' transformer (`block_controlnet_hidden_states`: sample `int(i / (n_blocks / n_samples))`
after every block but the last, skipped blocks included), on tiny random weights (fp32). Residuals for some
batch rows: those rows as if run alone with them, the other rows bit-identical to a batch without residuals.
SD3.5-Large's kind of ControlNet (single-stream blocks on the DiT's positions) too, and the other position
configs Diffusers runs (no positions; joint blocks on the DiT's positions)."""

from __future__ import annotations

import pytest
import torch
from diffusers import SD3ControlNetModel as DiffusersControlNet
from diffusers import SD3Transformer2DModel as DiffusersSD3

from diffserve.models.controlnets.residuals import BlockResiduals
from diffserve.models.controlnets.sd3 import SD3ControlNetModel
from diffserve.models.controlnets.sd3_single_stream import SD3SingleStreamControlNetModel
from diffserve.models.dits.sd3 import SD3Transformer2DModel
from diffserve.testing.parity import assert_parity, parity_pair

CONFIG = {
    "sample_size": 16,
    "patch_size": 2,
    "in_channels": 16,
    "num_layers": 5,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,
    "caption_projection_dim": 32,
    "pooled_projection_dim": 48,
    "out_channels": 16,
    "pos_embed_max_size": 16,
}
H, W = 6, 8  # latent size: 3 x 4 tokens
TOKENS, INNER = (H // 2) * (W // 2), 32


def _inputs(batch: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "hidden_states": torch.randn(batch, 16, H, W, generator=g),
        "encoder_hidden_states": torch.randn(batch, 7, 32, generator=g),
        "pooled_projections": torch.randn(batch, 48, generator=g),
        "timestep": torch.rand(batch, generator=g) * 1000,
    }


def _samples(batch: int, n: int, seed: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, TOKENS, INNER, generator=g) for _ in range(n)]


@pytest.mark.parametrize(("n_samples", "skip"), [(1, ()), (2, ()), (3, (1,)), (4, ())])
def test_dit_adds_block_samples_as_diffusers(n_samples, skip) -> None:
    ref, ours = parity_pair(DiffusersSD3, SD3Transformer2DModel, CONFIG)
    inputs, samples = _inputs(2), _samples(2, n_samples)
    with torch.no_grad():
        want = ref(
            **inputs,
            block_controlnet_hidden_states=samples,
            skip_layers=list(skip) or None,
            return_dict=False,
        )[0]
        got = ours(**inputs, block_controlnet_hidden_states=samples, skip_layers=frozenset(skip))
    assert_parity(got, want, f"SD3 DiT with {n_samples} ControlNet samples, skip {skip}", min_db=100)


def test_residuals_on_some_rows() -> None:
    _, ours = parity_pair(DiffusersSD3, SD3Transformer2DModel, CONFIG)
    inputs, samples = _inputs(3), _samples(1, 2)
    group = BlockResiduals(double=samples, single=(), rows=(1,), truncating=True)
    with torch.no_grad():
        plain = ours(**inputs)
        mixed = ours(**inputs, controlnet_residuals=[group])
        alone = ours(**{k: v[1:2] for k, v in inputs.items()}, block_controlnet_hidden_states=samples)
    assert torch.equal(mixed[0], plain[0]) and torch.equal(mixed[2], plain[2])
    assert_parity(mixed[1:2], alone, "the controlled row as alone", min_db=100)
    assert not torch.allclose(mixed[1], plain[1])


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"extra_conditioning_channels": 1},
        # Latents patched without positions (Diffusers' PatchEmbed with pos_embed_type None).
        {"pos_embed_type": None},
        # Joint blocks on a copy of the DiT's patch embedding and positions (use_pos_embed false).
        {"use_pos_embed": False, "pos_embed_type": None},
        # Diffusers' `from_transformer(num_layers=2)` of an SD3.5-medium-like DiT keeps its dual-attention
        # list (0..2): the index past the ControlNet's blocks changes nothing, as in Diffusers.
        {"qk_norm": "rms_norm", "dual_attention_layers": (0, 1, 2)},
    ],
    ids=["plain", "inpainting", "no-positions", "dit-positions", "dual-beyond-blocks"],
)
def test_controlnet_samples_match_diffusers(extra) -> None:
    """Plain, the inpainting kind (`extra_conditioning_channels`: the mask as a 17th control channel), and
    the other position and block configs Diffusers runs."""
    config = {**CONFIG, "num_layers": 2, **extra}
    ref, ours = parity_pair(DiffusersControlNet, SD3ControlNetModel, config)
    assert ours.config.inpainting == bool(extra.get("extra_conditioning_channels"))
    if not config.get("use_pos_embed", True):  # as the pipelines hand it the DiT's
        ref_dit, our_dit = parity_pair(DiffusersSD3, SD3Transformer2DModel, CONFIG)
        ref.pos_embed = ref._get_pos_embed_from_transformer(ref_dit)
        ours.use_transformer_pos_embed(our_dit.pos_embed)
    inputs = _inputs(2)
    control = torch.randn(2, ours.config.control_channels, H, W, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        want = ref(**inputs, controlnet_cond=control, conditioning_scale=0.7, return_dict=False)[0]
        got = ours(**inputs, controlnet_cond=control, scales=torch.full((2,), 0.7))
    assert len(got) == len(want) == 2
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_parity(g, w, f"SD3 ControlNet {extra} sample {i}", min_db=100)


def test_sd35_large_controlnet_samples_match_diffusers() -> None:
    """SD3.5-Large's kind (no `joint_attention_dim`: single-stream blocks; `use_pos_embed` false: a copy of
    the DiT's patch embedding and positions, which Diffusers' pipeline gives it): built as
    `SD3SingleStreamControlNetModel`, its samples equal Diffusers' `SD3ControlNetModel`'s."""
    ref_dit, our_dit = parity_pair(DiffusersSD3, SD3Transformer2DModel, CONFIG)
    config = {**CONFIG, "num_layers": 2, "joint_attention_dim": None, "use_pos_embed": False,
              "pos_embed_type": None, "force_zeros_for_pooled_projection": False}  # fmt: skip
    ref, ours = parity_pair(DiffusersControlNet, SD3ControlNetModel, config)
    assert isinstance(ours, SD3SingleStreamControlNetModel)
    ref.pos_embed = ref._get_pos_embed_from_transformer(ref_dit)
    ours.use_transformer_pos_embed(our_dit.pos_embed)
    inputs = {k: v for k, v in _inputs(2).items() if k != "encoder_hidden_states"}
    control = torch.randn(2, 16, H, W, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        want = ref(**inputs, controlnet_cond=control, conditioning_scale=0.7, return_dict=False)[0]
        got = ours(
            **inputs, controlnet_cond=control, encoder_hidden_states=None, scales=torch.full((2,), 0.7)
        )
    assert len(got) == len(want) == 2
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_parity(g, w, f"SD3.5-Large ControlNet sample {i}", min_db=100)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"pos_embed_type": "rope"}, "pos_embed_type 'rope' is not supported"),
        ({"extra_conditioning_channels": -1}, "extra_conditioning_channels must be >= 0"),
    ],
)
def test_unsupported_controlnets_are_refused(extra, message) -> None:
    with pytest.raises(ValueError, match=message):
        SD3ControlNetModel.from_config({**CONFIG, **extra})
