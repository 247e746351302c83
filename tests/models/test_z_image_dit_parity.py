"""Native Z-Image DiT against Diffusers' `ZImageTransformer2DModel` on the same tiny random weights (fp32)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from diffserve.models.dits.z_image import ZImageTransformer2DModel, ZImageTransformerConfig
from diffserve.testing.parity import (
    assert_parity,
    assert_same_state_dict_layout,
    native_from_reference,
    parity_pair,
)

diffusers = pytest.importorskip("diffusers")
from diffusers import ZImageTransformer2DModel as DiffusersZImage  # noqa: E402

# head_dim = 64 / 2 = 32 = 8 + 12 + 12; caption positions reach ~100, so axis 0 needs more room than rows/cols.
TINY: dict[str, Any] = {
    "all_patch_size": (2,),
    "all_f_patch_size": (1,),
    "in_channels": 16,
    "dim": 64,
    "n_layers": 2,
    "n_refiner_layers": 1,
    "n_heads": 2,
    "n_kv_heads": 2,
    "norm_eps": 1e-5,
    "qk_norm": True,
    "cap_feat_dim": 32,
    "siglip_feat_dim": None,
    "rope_theta": 256.0,
    "t_scale": 1000.0,
    "axes_dims": (8, 12, 12),
    "axes_lens": (256, 64, 64),
}

_REF: dict[str, tuple[torch.nn.Module, ZImageTransformer2DModel]] = {}


def _pair() -> tuple[torch.nn.Module, ZImageTransformer2DModel]:
    """A seeded Diffusers model and the native model loaded from its state dict through the meta device,
    every tensor perturbed (the pad tokens start at zero, the norms at one) so no term is trivial."""
    if "tiny" not in _REF:
        _REF["tiny"] = parity_pair(DiffusersZImage, ZImageTransformer2DModel, TINY)
    return _REF["tiny"]


def _inputs(
    sizes: list[tuple[int, int]], caption_lengths: list[int], t: list[float], seed: int = 1
) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "x": [torch.randn(TINY["in_channels"], 1, h, w, generator=g) for h, w in sizes],
        "t": torch.tensor(t),
        "cap_feats": [torch.randn(n, TINY["cap_feat_dim"], generator=g) for n in caption_lengths],
    }


def _compare(label: str, atol: float = 1e-4, **inputs: Any) -> list[torch.Tensor]:
    ref, ours = _pair()
    with torch.no_grad():
        expected = ref(**inputs, return_dict=False)[0]
        out = ours(**inputs)
    assert isinstance(out, list) and len(out) == len(expected)
    for o, e, xi in zip(out, expected, inputs["x"], strict=True):
        assert o.shape == e.shape == xi.shape
    out_flat = torch.cat([o.flatten() for o in out])
    exp_flat = torch.cat([e.flatten() for e in expected])
    label = f"z-image parity {label}, scale={exp_flat.abs().max():.2f}"
    assert_parity(out_flat, exp_flat, label, max_abs=atol, min_cos=0.9999)
    return out


def test_state_dict_keys_and_shapes_match_diffusers() -> None:
    ref, _ = _pair()
    with torch.device("meta"):
        ours = ZImageTransformer2DModel(ZImageTransformerConfig(**TINY))
    assert_same_state_dict_layout(ours, ref)


def test_parity_batch2_per_sample_timesteps_and_caption_lengths() -> None:
    # Non-square 8x6 latent; captions of 7 and 40 tokens pad to 32 and 64, so every stage is masked.
    inputs = _inputs([(8, 6), (8, 6)], [7, 40], [0.1, 0.85])
    out = _compare("b=2 8x6 caps 7/40", **inputs)
    # Batching must not mix samples: each row equals the same sample run alone.
    _, ours = _pair()
    with torch.no_grad():
        for i in range(2):
            single = ours(x=[inputs["x"][i]], t=inputs["t"][i : i + 1], cap_feats=[inputs["cap_feats"][i]])[0]
            torch.testing.assert_close(single, out[i], rtol=1e-5, atol=1e-5)


def test_parity_batch2_same_padded_lengths_unmasked() -> None:
    # Captions of 5 and 20 tokens both pad to 32: no mask anywhere (Diffusers' unmasked path).
    _compare("b=2 6x8 caps 5/20", **_inputs([(6, 8), (6, 8)], [5, 20], [0.3, 0.95], seed=2))


def test_parity_batch2_different_image_sizes() -> None:
    # 16x10 latent -> 40 patches (padded to 64) next to 8x6 -> 12 patches (padded to 32).
    _compare("b=2 16x10+8x6 caps 33/3", **_inputs([(16, 10), (8, 6)], [33, 3], [0.5, 0.02], seed=3))


def test_parity_batch1() -> None:
    _compare("b=1 8x6 cap 11", **_inputs([(8, 6)], [11], [0.6], seed=4))


def test_timestep_shared_by_batch() -> None:
    """A (1,) timestep serves the whole batch, as it does in Diffusers."""
    _compare("b=2 shared t", **_inputs([(4, 4), (4, 4)], [9, 9], [0.4], seed=5))


def test_layout_cache_reused() -> None:
    _, ours = _pair()
    a = ours.batch_layout([(1, 8, 6)], [7], 2, 1, torch.device("cpu"))
    b = ours.batch_layout([(1, 8, 6)], [7], 2, 1, torch.device("cpu"))
    assert a is b
    assert a.unified_mask is None and a.unified_cis.shape == (1, 64, 16)


def test_from_config_rejects_unknown_keys_and_omni() -> None:
    with pytest.raises(ValueError, match="ZImageTransformer2DModel config has unknown keys"):
        ZImageTransformer2DModel.from_config({**TINY, "num_single_layers": 3})
    with pytest.raises(ValueError, match="Omni"):
        ZImageTransformer2DModel(ZImageTransformerConfig(**{**TINY, "siglip_feat_dim": 24}))


def test_bad_inputs_are_errors() -> None:
    _, ours = _pair()
    inputs = _inputs([(8, 6)], [7], [0.5])
    with pytest.raises(ValueError, match="patch_size"):
        ours(**inputs, patch_size=1)
    with pytest.raises(ValueError, match="not divisible"):
        ours(**{**inputs, "x": [torch.randn(16, 1, 7, 6)]})
    with pytest.raises(TypeError, match="Omni"):
        ours(**{**inputs, "x": [[torch.randn(16, 1, 8, 6)]]})
    with pytest.raises(ValueError, match="axes_lens"):
        ours(**{**inputs, "cap_feats": [torch.randn(300, TINY["cap_feat_dim"])]})


def test_parity_bf16() -> None:
    """Half precision follows Diffusers' op order; only the gather/pad layout differs."""
    ref, _ = _pair()
    ref16 = DiffusersZImage(**TINY).eval()
    ref16.load_state_dict(ref.state_dict())
    ref16 = ref16.to(torch.bfloat16)
    ours = native_from_reference(ZImageTransformer2DModel, ref16)
    inputs = _inputs([(8, 6), (8, 6)], [7, 40], [0.1, 0.85], seed=6)
    inputs = {**inputs, "x": [xi.bfloat16() for xi in inputs["x"]]}
    inputs["cap_feats"] = [c.bfloat16() for c in inputs["cap_feats"]]
    with torch.no_grad():
        expected = torch.cat([e.float().flatten() for e in ref16(**inputs, return_dict=False)[0]])
        out = torch.cat([o.float().flatten() for o in ours(**inputs)])
    assert_parity(out, expected, "z-image parity bf16 b=2", max_abs=5e-2, min_cos=0.999)
