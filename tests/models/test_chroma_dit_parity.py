"""Native Chroma DiT against Diffusers' `ChromaTransformer2DModel` on the same tiny random weights (fp32)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from diffserve.models.dits.chroma import ChromaTransformer2DModel, ChromaTransformerConfig
from diffserve.testing.parity import assert_parity, assert_same_state_dict_layout, parity_pair

diffusers = pytest.importorskip("diffusers")
from diffusers import ChromaTransformer2DModel as DiffusersChroma  # noqa: E402

TINY: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 16,
    "num_layers": 2,
    "num_single_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,
    "axes_dims_rope": (4, 6, 6),
    "approximator_num_channels": 16,
    "approximator_hidden_dim": 32,
    "approximator_layers": 2,
}
_PAIR: dict[str, tuple[torch.nn.Module, ChromaTransformer2DModel]] = {}


def _pair() -> tuple[torch.nn.Module, ChromaTransformer2DModel]:
    """A seeded Diffusers model and the native one loaded from its state dict through the meta device,
    every tensor perturbed so no term is trivial."""
    if "tiny" not in _PAIR:
        _PAIR["tiny"] = parity_pair(DiffusersChroma, ChromaTransformer2DModel, TINY)
    return _PAIR["tiny"]


def _img_ids(h: int, w: int) -> torch.Tensor:
    ids = torch.zeros(h, w, 3)
    ids[..., 1] = torch.arange(h)[:, None]
    ids[..., 2] = torch.arange(w)[None, :]
    return ids.reshape(h * w, 3)


def _inputs(timesteps: list[float], h: int, w: int, text_lengths: list[int], txt: int = 8) -> dict:
    """Inputs of both models for len(timesteps) rows; row i keeps `text_lengths[i]` text tokens and one
    padding token (ChromaPipeline's mask), the rest of its `txt` tokens masked."""
    g = torch.Generator().manual_seed(1)
    batch = len(timesteps)
    text_mask = (torch.arange(txt)[None, :] <= torch.tensor(text_lengths)[:, None]).float()
    return {
        "hidden_states": torch.randn(batch, h * w, TINY["in_channels"], generator=g),
        "encoder_hidden_states": torch.randn(batch, txt, TINY["joint_attention_dim"], generator=g),
        "timestep": torch.tensor(timesteps),
        "img_ids": _img_ids(h, w),
        "txt_ids": torch.zeros(txt, 3),
        "text_mask": text_mask,
    }


def _compare(label: str, inputs: dict, fused: bool = False) -> None:
    reference, native = _pair()
    text_mask = inputs.pop("text_mask")
    # Diffusers takes the mask over [text; image]: the text's, then every image token kept.
    image_len = inputs["hidden_states"].shape[1]
    full_mask = torch.cat([text_mask, torch.ones(text_mask.shape[0], image_len)], dim=1)
    with torch.no_grad():
        expected = reference(**inputs, attention_mask=full_mask, return_dict=False)[0]
        actual = native(**inputs, text_mask=text_mask)
    assert_parity(actual, expected, f"Chroma DiT {label}", max_abs=1e-4, min_cos=0.9999)


def test_state_dict_layout_matches_diffusers() -> None:
    reference, native = _pair()
    assert_same_state_dict_layout(native, reference)


def test_config_defaults_are_diffusers() -> None:
    with torch.device("meta"):
        reference = DiffusersChroma()
    defaults = {k: v for k, v in reference.config.items() if not k.startswith("_")}
    ours = ChromaTransformerConfig()
    for key, value in defaults.items():
        want = tuple(value) if isinstance(value, list | tuple) else value
        assert getattr(ours, key) == (want if key != "out_channels" else ours.in_channels), key


def test_forward_matches_diffusers_with_per_sample_timesteps_and_masks() -> None:
    """Two rows at their own timesteps and text lengths (one batch, as step batching runs them)."""
    _compare("batch of 2, non-square", _inputs([0.9, 0.25], 3, 5, text_lengths=[2, 6]))


def test_forward_matches_diffusers_without_a_mask_and_fused() -> None:
    reference, native = _pair()
    inputs = _inputs([0.5], 4, 4, text_lengths=[7])
    inputs.pop("text_mask")
    native.fuse_for_inference()
    try:
        with torch.no_grad():
            expected = reference(**inputs, return_dict=False)[0]
            actual = native(**inputs)
        assert_parity(actual, expected, "Chroma DiT fused, no mask", max_abs=1e-4, min_cos=0.9999)
        # The fused model still matches with the mask (and still saves Diffusers' names).
        _compare("fused, masked", _inputs([0.7], 4, 2, text_lengths=[3]))
        assert set(native.state_dict()) == set(reference.state_dict())
    finally:
        _PAIR.clear()


def test_the_mask_changes_the_output() -> None:
    """The padding bias is really applied: another text length moves the prediction."""
    _, native = _pair()
    short, long = _inputs([0.5], 3, 3, text_lengths=[1]), _inputs([0.5], 3, 3, text_lengths=[6])
    with torch.no_grad():
        a, b = native(**short), native(**long)
    assert (a - b).abs().max() > 1e-3


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("axes_dims_rope", (4, 4, 4, 4), r"axes_dims_rope must have 3 entries"),
        (
            "approximator_num_channels",
            18,
            r"approximator_num_channels must be a positive multiple of 4, got 18",
        ),
    ],
)
def test_configs_diffusers_cannot_run_are_refused(key, value, message) -> None:
    """Diffusers builds these and fails at the first forward (RoPE over three id axes; the approximator's
    four sinusoid blocks of approximator_num_channels // 4 each); here the config is refused."""
    with pytest.raises(ValueError, match=message):
        ChromaTransformerConfig(**{**TINY, key: value})
