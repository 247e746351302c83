"""Native FLUX DiT against Diffusers' `FluxTransformer2DModel` on the same tiny random weights (fp32)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from diffserve.models.dits.flux import FluxTransformer2DModel, FluxTransformerConfig
from diffserve.testing.parity import assert_parity, assert_same_state_dict_layout, parity_pair

diffusers = pytest.importorskip("diffusers")
from diffusers import FluxTransformer2DModel as DiffusersFlux  # noqa: E402

TINY_CONFIG: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 16,
    "num_layers": 2,
    "num_single_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,
    "pooled_projection_dim": 24,
    "axes_dims_rope": (4, 6, 6),
}


def _pair(guidance_embeds: bool) -> tuple[torch.nn.Module, FluxTransformer2DModel]:
    """A seeded Diffusers model and the native model loaded from its state dict through the meta device.
    Diffusers zero-initialises nothing here, but every tensor is perturbed so no term is trivially zero."""
    return parity_pair(
        DiffusersFlux, FluxTransformer2DModel, {**TINY_CONFIG, "guidance_embeds": guidance_embeds}
    )


def _img_ids(h: int, w: int) -> torch.Tensor:
    ids = torch.zeros(h, w, 3)
    ids[..., 1] = torch.arange(h)[:, None]
    ids[..., 2] = torch.arange(w)[None, :]
    return ids.reshape(h * w, 3)


def _compare(
    ref: torch.nn.Module, ours: FluxTransformer2DModel, label: str, atol: float = 1e-4, **inputs: torch.Tensor
) -> None:
    with torch.no_grad():
        expected = ref(**inputs, return_dict=False)[0].float()
        out = ours(**inputs).float()
    assert_parity(out, expected, f"flux parity {label}", max_abs=atol, min_cos=0.9999)


def _inputs(
    batch: int, h: int, w: int, txt: int = 5, guidance: torch.Tensor | None = None, **kw: Any
) -> dict:
    g = torch.Generator().manual_seed(1)
    inputs = {
        "hidden_states": torch.randn(batch, h * w, TINY_CONFIG["in_channels"], generator=g),
        "encoder_hidden_states": torch.randn(batch, txt, TINY_CONFIG["joint_attention_dim"], generator=g),
        "pooled_projections": torch.randn(batch, TINY_CONFIG["pooled_projection_dim"], generator=g),
        "img_ids": _img_ids(h, w),
        "txt_ids": torch.zeros(txt, 3),
        **kw,
    }
    if guidance is not None:
        inputs["guidance"] = guidance
    return inputs


def test_state_dict_keys_and_shapes_match_diffusers() -> None:
    for guidance_embeds in (False, True):
        ref = DiffusersFlux(**TINY_CONFIG, guidance_embeds=guidance_embeds)
        with torch.device("meta"):
            config = FluxTransformerConfig(**TINY_CONFIG, guidance_embeds=guidance_embeds)
            ours = FluxTransformer2DModel(config)
        assert_same_state_dict_layout(ours, ref)
        assert not list(ours.buffers())


def test_parity_no_guidance_batch1() -> None:
    ref, ours = _pair(guidance_embeds=False)
    _compare(ref, ours, "schnell-like b=1", **_inputs(1, 4, 4, timestep=torch.tensor([0.7])))


def test_parity_guidance_batch2_per_sample_timesteps() -> None:
    ref, ours = _pair(guidance_embeds=True)
    inputs = _inputs(2, 4, 4, timestep=torch.tensor([0.9, 0.25]), guidance=torch.tensor([3.5, 1.0]))
    _compare(ref, ours, "dev-like b=2", **inputs)
    # Batching must not mix samples: each row equals the same sample run alone.
    with torch.no_grad():
        batched = ours(**inputs)
        for i in range(2):
            single = {k: (v[i : i + 1] if k not in ("img_ids", "txt_ids") else v) for k, v in inputs.items()}
            torch.testing.assert_close(ours(**single), batched[i : i + 1], rtol=1e-5, atol=1e-5)


def test_parity_non_square_grid() -> None:
    ref, ours = _pair(guidance_embeds=True)
    inputs = _inputs(1, 3, 6, txt=7, timestep=torch.tensor([0.5]), guidance=torch.tensor([4.0]))
    _compare(ref, ours, "non-square 3x6", **inputs)
    # Precomputed RoPE tables give the same result as computing them from the ids.
    with torch.no_grad():
        rope = ours.rope_tables(inputs["txt_ids"], inputs["img_ids"])
        torch.testing.assert_close(ours(**inputs, rope=rope), ours(**inputs), rtol=0, atol=0)


def test_from_config_rejects_unknown_keys_and_ignores_metadata() -> None:
    with torch.device("meta"):
        model = FluxTransformer2DModel.from_config(
            {**TINY_CONFIG, "_class_name": "FluxTransformer2DModel", "_diffusers_version": "0.42.1"}
        )
        assert model.config.out_channels == TINY_CONFIG["in_channels"]
        assert model.config.axes_dims_rope == (4, 6, 6)
        with pytest.raises(ValueError, match="FluxTransformer2DModel config has unknown keys"):
            FluxTransformer2DModel.from_config({**TINY_CONFIG, "num_layer": 3})
        with pytest.raises(ValueError, match="axes_dims_rope"):
            FluxTransformer2DModel.from_config({**TINY_CONFIG, "axes_dims_rope": (4, 4, 4)})
        # One entry per position-id axis (index, row, column): Diffusers builds other counts and then
        # fails at the first forward.
        with pytest.raises(ValueError, match=r"axes_dims_rope must have 3 entries, got \(4, 4, 4, 4\)"):
            FluxTransformer2DModel.from_config({**TINY_CONFIG, "axes_dims_rope": (4, 4, 4, 4)})


def test_check_packed_latents_follows_what_the_pipelines_feed() -> None:
    """The DiT reads 4 x latent channels (+ a pipeline's condition channels) per token and predicts
    patch_size^2 x out_channels = 4 x latent channels: `patch_size` 2 with `out_channels` 16 fits 16-channel
    latents as Diffusers runs it; a Fill DiT or a wider prediction is refused, naming the keys."""
    with torch.device("meta"):
        plain = FluxTransformer2DModel.from_config({**TINY_CONFIG, "in_channels": 64})
        patched = FluxTransformer2DModel.from_config(
            {**TINY_CONFIG, "in_channels": 64, "patch_size": 2, "out_channels": 16}
        )
        fill = FluxTransformer2DModel.from_config({**TINY_CONFIG, "in_channels": 384, "out_channels": 64})
        wide = FluxTransformer2DModel.from_config({**TINY_CONFIG, "in_channels": 64, "out_channels": 128})
    plain.check_packed_latents(16)
    patched.check_packed_latents(16)
    fill.check_packed_latents(16, condition_channels=64 + 4 * 8 * 8)
    with pytest.raises(ValueError, match="in_channels 384, but its image tokens are 64 channels wide"):
        fill.check_packed_latents(16)
    with pytest.raises(ValueError, match=r"patch_size\^2 x out_channels \(1\^2 x 128 = 128\) must be 64"):
        wide.check_packed_latents(16)


def test_guidance_mismatch_is_an_error() -> None:
    _, ours = _pair(guidance_embeds=True)
    with torch.no_grad(), pytest.raises(ValueError, match="guidance"):
        ours(**_inputs(1, 2, 2, timestep=torch.tensor([0.5])))


def test_parity_bf16_batch2() -> None:
    """Half precision follows Diffusers' rounding too (QK-norm rounds once, contiguous out-projection inputs)."""
    ref, ours = _pair(guidance_embeds=True)
    ref.to(torch.bfloat16)
    ours.to(torch.bfloat16)
    inputs = _inputs(2, 4, 4, timestep=torch.tensor([0.9, 0.25]), guidance=torch.tensor([3.5, 1.0]))
    for key in ("hidden_states", "encoder_hidden_states", "pooled_projections"):
        inputs[key] = inputs[key].to(torch.bfloat16)
    _compare(ref, ours, "bf16 b=2", atol=0.05, **inputs)


# ------------------------------------------------------------------ fused projections (the loader's model)


def test_fused_model_matches_diffusers_and_the_unfused_model() -> None:
    """`fuse_for_inference()` (one matmul for q/k/v, for q/k/v + MLP input, for all adaLN projections)
    changes no number: each fused output column is the same dot product as before."""
    ref, ours = _pair(guidance_embeds=True)
    inputs = _inputs(2, 4, 4, timestep=torch.tensor([0.9, 0.25]), guidance=torch.tensor([3.5, 1.0]))
    with torch.no_grad():
        unfused = ours(**inputs)
    ours.fuse_for_inference()
    assert ours.adaln_modulation is not None
    _compare(ref, ours, "fused dev-like b=2", **inputs)
    with torch.no_grad():
        torch.testing.assert_close(ours(**inputs), unfused, rtol=0, atol=1e-6)


def test_fused_model_bf16_matches_diffusers() -> None:
    ref, ours = _pair(guidance_embeds=True)
    ours.fuse_for_inference()
    ref.to(torch.bfloat16)
    ours.to(torch.bfloat16)  # the fused weights convert like any parameter
    inputs = _inputs(2, 3, 6, txt=7, timestep=torch.tensor([0.9, 0.25]), guidance=torch.tensor([3.5, 1.0]))
    for key in ("hidden_states", "encoder_hidden_states", "pooled_projections"):
        inputs[key] = inputs[key].to(torch.bfloat16)
    _compare(ref, ours, "fused bf16 b=2", atol=0.05, **inputs)


def test_loading_a_diffusers_folder_fuses_and_keeps_diffusers_names(tmp_path, caplog) -> None:
    """The loader fuses after loading (logged once); the state dict still has Diffusers' names and values,
    and a strict load of Diffusers' state dict into the fused model still works."""
    from diffserve.loader.component_loader import load_native_model
    from diffserve.loader.model_index import ComponentSpec
    from diffserve.platforms import CpuPlatform

    ref, _ = _pair(guidance_embeds=True)
    ref.save_pretrained(tmp_path / "transformer")
    spec = ComponentSpec("transformer", "diffusers", "FluxTransformer2DModel", tmp_path / "transformer")
    with caplog.at_level(logging.INFO, logger="diffserve"):
        model, _ = load_native_model(spec, FluxTransformer2DModel, CpuPlatform(), torch.float32)
    assert caplog.text.count("fused QKV in 4 attention layers") == 1
    assert model.transformer_blocks[0].attn.to_qkv is not None
    assert model.single_transformer_blocks[0].to_qkv_mlp is not None
    assert not hasattr(model.transformer_blocks[0].attn, "to_q")  # the originals are gone, not duplicated

    expected = ref.state_dict()
    got = model.state_dict()
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in ref.parameters())

    inputs = _inputs(1, 4, 4, timestep=torch.tensor([0.6]), guidance=torch.tensor([2.0]))
    _compare(ref, model, "loaded + fused", **inputs)
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(1.5)
    model.load_state_dict(ref.state_dict(), strict=True)  # Diffusers' names into the fused layers
    _compare(ref, model, "fused, reloaded", **inputs)
