"""Native HiDream-I1 DiT against Diffusers' `HiDreamImageTransformer2DModel` on the same tiny random weights:
two samples per forward at different timesteps, square and non-square latent grids (the non-square one
padded to `max_seq` with its keys masked, as Diffusers does), odd text lengths, RoPE over a whole head and
over half of it, the MoE routing (top-2 and top-3 of 4 experts) and the expert-free feed-forward."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from diffserve.models.dits.hidream_image import (
    HiDreamImageTransformer2DModel,
    HiDreamImageTransformerConfig,
    MoEFeedForward,
)
from diffserve.testing.parity import (
    assert_parity,
    assert_same_state_dict_layout,
    diffusers_init_defaults,
    parity_pair,
)

diffusers = pytest.importorskip("diffusers")
from diffusers.models.transformers.transformer_hidream_image import (  # noqa: E402
    MOEFeedForwardSwiGLU as DiffusersMoE,
)

MIN_DB = 80.0
T5_WIDTH, LLAMA_WIDTH, LLAMA_LAYERS = 24, 20, 3
TINY: dict[str, Any] = {
    "patch_size": 2,
    "in_channels": 4,
    "num_layers": 2,
    "num_single_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "caption_channels": [T5_WIDTH, LLAMA_WIDTH],
    "text_emb_dim": 12,
    "num_routed_experts": 4,
    "num_activated_experts": 2,
    "axes_dims_rope": (4, 6, 6),
    "max_resolution": (12, 12),
    "llama_layers": [2, 0, 1, 2],
}


def _inputs(height: int, width: int, t5_len: int, llama_len: int, seed: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(2, 4, height, width, generator=g),
        "timesteps": torch.tensor([937.5, 41.0]),
        "encoder_hidden_states_t5": torch.randn(2, t5_len, T5_WIDTH, generator=g),
        "encoder_hidden_states_llama3": torch.randn(LLAMA_LAYERS, 2, llama_len, LLAMA_WIDTH, generator=g),
        "pooled_embeds": torch.randn(2, 12, generator=g),
    }


def _compare(config: dict[str, Any], inputs: dict[str, torch.Tensor], label: str) -> None:
    reference, native = parity_pair(
        diffusers.HiDreamImageTransformer2DModel, HiDreamImageTransformer2DModel, config
    )
    assert_same_state_dict_layout(native, reference)
    with torch.no_grad():
        want = reference(**inputs, return_dict=False)[0]
        got = native(**inputs)
    assert got.shape == want.shape == inputs["hidden_states"].shape
    assert_parity(got, want, label, min_db=MIN_DB)


@pytest.mark.parametrize(
    ("height", "width", "t5_len", "llama_len"),
    [(8, 8, 7, 5), (6, 10, 5, 9), (12, 4, 3, 3)],
)
def test_forward_matches(height: int, width: int, t5_len: int, llama_len: int) -> None:
    _compare(
        TINY,
        _inputs(height, width, t5_len, llama_len),
        f"hidream dit {height}x{width} text {t5_len}/{llama_len}",
    )


def test_half_head_rope_top3_matches() -> None:
    """RoPE over the first half of each head only (axes summing to head_dim / 2), three of four experts."""
    config = {**TINY, "axes_dims_rope": (2, 2, 4), "num_activated_experts": 3}
    _compare(config, _inputs(6, 8, 5, 7), "hidream dit, half-head rope, top-3")


def test_without_experts_matches() -> None:
    config = {
        **TINY,
        "num_routed_experts": 0,
        "num_layers": 1,
        "num_single_layers": 1,
        "llama_layers": [1, 2],
    }
    _compare(config, _inputs(8, 8, 3, 5), "hidream dit, no experts")


def test_moe_routes_as_diffusers() -> None:
    """The gate's top-k choice and the weighted sum over experts, alone, on tokens spread over every expert."""
    torch.manual_seed(0)
    reference = DiffusersMoE(dim=16, hidden_dim=64, num_routed_experts=4, num_activated_experts=2).eval()
    native = MoEFeedForward(16, 64, 4, 2)
    native.load_state_dict(reference.state_dict(), strict=True)
    x = torch.randn(2, 37, 16, generator=torch.Generator().manual_seed(1)) * 3
    experts, _ = native.gate(x.reshape(-1, 16))
    assert experts.unique().numel() == 4
    with torch.no_grad():
        assert_parity(native(x), reference(x), "hidream moe", min_db=MIN_DB)


def test_bf16_matches() -> None:
    reference, native = parity_pair(
        diffusers.HiDreamImageTransformer2DModel, HiDreamImageTransformer2DModel, TINY
    )
    reference, native = reference.to(torch.bfloat16), native.to(torch.bfloat16)
    inputs = {k: v.bfloat16() if k != "timesteps" else v for k, v in _inputs(6, 10, 5, 9).items()}
    with torch.no_grad():
        want = reference(**inputs, return_dict=False)[0]
        got = native(**inputs)
    assert_parity(got.float(), want.float(), "hidream dit bf16", min_db=60.0)


def test_config_defaults_are_diffusers() -> None:
    defaults = diffusers_init_defaults(diffusers.HiDreamImageTransformer2DModel)
    fields = HiDreamImageTransformerConfig.__dataclass_fields__
    assert set(defaults) == set(fields)
    assert {k: f.default for k, f in fields.items()} == {
        k: tuple(v) if isinstance(v, list) else v for k, v in defaults.items()
    }


def test_released_layout_builds_on_meta_with_diffusers_keys() -> None:
    config = {
        "patch_size": 2,
        "in_channels": 16,
        "num_layers": 2,
        "num_single_layers": 1,
        "caption_channels": [4096, 4096],
        "axes_dims_rope": (64, 32, 32),
        "llama_layers": [10, 20, 31],
    }
    with torch.device("meta"):
        ref = diffusers.HiDreamImageTransformer2DModel(**config)
        ours = HiDreamImageTransformer2DModel.from_config(dict(ref.config))
    assert_same_state_dict_layout(ours, ref)
    assert ours.max_seq == ref.max_seq == 4096
