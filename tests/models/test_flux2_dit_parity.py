"""Native FLUX.2 DiT against Diffusers' `Flux2Transformer2DModel` on the same tiny random weights (fp32)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from diffserve.configs.step_cache_policy import StepCachePolicy
from diffserve.models.dits.flux2 import Flux2Transformer2DModel, Flux2TransformerConfig
from diffserve.models.step_cache import BatchStepCache, CacheRows, StepCacheState
from diffserve.testing.parity import assert_parity, assert_same_state_dict_layout, parity_pair

diffusers = pytest.importorskip("diffusers")
from diffusers import Flux2Transformer2DModel as DiffusersFlux2  # noqa: E402

TINY_CONFIG: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 16,
    "num_layers": 2,
    "num_single_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 24,
    "timestep_guidance_channels": 32,
    "mlp_ratio": 3.0,
    "axes_dims_rope": (4, 4, 4, 4),
    "rope_theta": 2000,
}
TXT = 7


def _pair(guidance_embeds: bool) -> tuple[torch.nn.Module, Flux2Transformer2DModel]:
    """A seeded Diffusers model and the native model loaded from its state dict through the meta device,
    every tensor perturbed (the RMSNorm weights start at one) so no term is trivially an identity."""
    return parity_pair(
        DiffusersFlux2, Flux2Transformer2DModel, {**TINY_CONFIG, "guidance_embeds": guidance_embeds}
    )


def _grid_ids(h: int, w: int, t: int = 0) -> torch.Tensor:
    """(h * w, 4) ids (t, row, col, 0), as `Flux2Pipeline._prepare_latent_ids` / `_prepare_image_ids`."""
    return torch.cartesian_prod(torch.tensor([t]), torch.arange(h), torch.arange(w), torch.arange(1))


def _inputs(
    batch: int,
    h: int,
    w: int,
    timestep: torch.Tensor,
    guidance: torch.Tensor | None,
    refs: tuple[tuple[int, int], ...] = (),
) -> dict[str, Any]:
    """Inputs for both models: noisy tokens of an h x w grid plus the reference grids `refs`, whose
    ids carry the time coordinate 10 + 10 i as in the pipeline."""
    g = torch.Generator().manual_seed(1)
    img_ids = torch.cat(
        [_grid_ids(h, w)] + [_grid_ids(rh, rw, 10 + 10 * i) for i, (rh, rw) in enumerate(refs)]
    )
    return {
        "hidden_states": torch.randn(batch, img_ids.shape[0], TINY_CONFIG["in_channels"], generator=g),
        "encoder_hidden_states": torch.randn(batch, TXT, TINY_CONFIG["joint_attention_dim"], generator=g),
        "timestep": timestep,
        "guidance": guidance,
        "img_ids": img_ids,
        "txt_ids": torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(TXT)),
    }


def _compare(
    ref: torch.nn.Module, ours: Flux2Transformer2DModel, label: str, inputs: dict, atol: float = 1e-4
) -> torch.Tensor:
    batch = inputs["hidden_states"].shape[0]
    # Diffusers' pipeline passes batched (B, seq, 4) ids; the native model takes the shared (seq, 4).
    ref_inputs = {
        **inputs,
        "img_ids": inputs["img_ids"].expand(batch, -1, -1),
        "txt_ids": inputs["txt_ids"].expand(batch, -1, -1),
    }
    with torch.no_grad():
        expected = ref(**ref_inputs, return_dict=False)[0].float()
        out = ours(**inputs).float()
    label = f"flux2 parity {label}, max|ref|={expected.abs().max():.3f}"
    assert_parity(out, expected, label, max_abs=atol, min_cos=0.9999)
    return out


def test_state_dict_keys_and_shapes_match_diffusers() -> None:
    for guidance_embeds in (False, True):
        ref = DiffusersFlux2(**TINY_CONFIG, guidance_embeds=guidance_embeds)
        with torch.device("meta"):
            ours = Flux2Transformer2DModel(
                Flux2TransformerConfig(**TINY_CONFIG, guidance_embeds=guidance_embeds)
            )
        assert_same_state_dict_layout(ours, ref)
        assert not list(ours.buffers())
        # Bias-free everywhere, as in Diffusers (the LoRA / quantization code wraps these nn.Linear).
        assert all(m.bias is None for m in ours.modules() if isinstance(m, torch.nn.Linear))


def test_parity_guidance_batch2_non_square_with_reference_tokens() -> None:
    """FLUX.2-dev-like: guidance embedded, per-sample timesteps, a 3x5 noisy grid plus two reference
    images (2x3 and 4x2 tokens) with distinct time ids."""
    ref, ours = _pair(guidance_embeds=True)
    inputs = _inputs(2, 3, 5, torch.tensor([0.9, 0.25]), torch.tensor([4.0, 2.5]), refs=((2, 3), (4, 2)))
    out = _compare(ref, ours, "dev-like b=2 3x5 + 2 refs", inputs)
    # Batching must not mix samples: each row equals the same sample run alone.
    with torch.no_grad():
        for i in range(2):
            single = {k: (v[i : i + 1] if k not in ("img_ids", "txt_ids") else v) for k, v in inputs.items()}
            torch.testing.assert_close(ours(**single), out[i : i + 1], rtol=1e-5, atol=1e-5)


def test_parity_no_guidance_klein_like() -> None:
    ref, ours = _pair(guidance_embeds=False)
    inputs = _inputs(2, 4, 3, torch.tensor([0.6]), None, refs=((3, 3),))
    _compare(ref, ours, "klein-like b=2 4x3 + 1 ref", inputs)


def test_skipped_guidance_embedder_matches_diffusers_without_guidance() -> None:
    """A `guidance_embeds` DiT run as Diffusers' Flux2KleinPipeline runs it (guidance None: the timestep
    embedding alone) equals the native model with `skip_guidance_embedder`; a guidance value is refused."""
    ref, ours = _pair(guidance_embeds=True)
    inputs = _inputs(2, 3, 2, torch.tensor([0.7, 0.2]), None, refs=((2, 2),))
    batch = inputs["hidden_states"].shape[0]
    ref_inputs = {**inputs, "img_ids": inputs["img_ids"].expand(batch, -1, -1)}
    ref_inputs["txt_ids"] = inputs["txt_ids"].expand(batch, -1, -1)
    with torch.no_grad():
        expected = ref(**ref_inputs, return_dict=False)[0]
        out = ours(**inputs, skip_guidance_embedder=True)
        assert_parity(out, expected, "guidance embedder skipped", max_abs=1e-4, min_cos=0.9999)
        with pytest.raises(ValueError, match="guidance embedding is skipped"):
            ours(**{**inputs, "guidance": torch.tensor([3.0])}, skip_guidance_embedder=True)


def test_precomputed_rope_and_context_match() -> None:
    ref, ours = _pair(guidance_embeds=True)
    inputs = _inputs(2, 2, 5, torch.tensor([0.5, 0.7]), torch.tensor([3.0]))
    with torch.no_grad():
        direct = ours(**inputs)
        rope = ours.rope_tables(inputs["txt_ids"], inputs["img_ids"])
        context = ours.embed_context(inputs["encoder_hidden_states"])
        cached = ours(inputs["hidden_states"], inputs["timestep"], inputs["guidance"], rope, context=context)
    torch.testing.assert_close(cached, direct, rtol=0, atol=0)


def test_parity_bf16() -> None:
    ref, ours = _pair(guidance_embeds=True)
    ref.to(torch.bfloat16)
    ours.to(torch.bfloat16)
    inputs = _inputs(2, 3, 4, torch.tensor([0.9, 0.3]), torch.tensor([4.0, 4.0]), refs=((2, 2),))
    for key in ("hidden_states", "encoder_hidden_states"):
        inputs[key] = inputs[key].to(torch.bfloat16)
    _compare(ref, ours, "bf16 b=2", inputs, atol=0.05)


def test_step_cache_first_step_is_exact_and_reuse_adds_the_residual() -> None:
    """With a step cache the first step runs every block (same output as without); a later step that
    reuses returns x_embed + the stored residual through the same head."""
    _, ours = _pair(guidance_embeds=True)
    inputs = _inputs(2, 3, 3, torch.tensor([0.9, 0.9]), torch.tensor([4.0]))
    policy = StepCachePolicy(threshold=1e9, full_first_steps=1, full_last_steps=0, max_reuse_in_a_row=5)
    state = StepCacheState(policy)
    with torch.no_grad():
        exact = ours(**inputs)
        first = ours(**inputs, step_cache=BatchStepCache([CacheRows(state, 2, 0, 4)]))
        torch.testing.assert_close(first, exact, rtol=0, atol=0)
        second = ours(**inputs, step_cache=BatchStepCache([CacheRows(state, 2, 1, 4)]))
    assert state.history == [True, False]
    # Same inputs again: the reused residual is exactly what the blocks added, so the output matches.
    torch.testing.assert_close(second, exact, rtol=1e-5, atol=1e-5)


def test_from_config_checks() -> None:
    with torch.device("meta"):
        model = Flux2Transformer2DModel.from_config({**TINY_CONFIG, "_class_name": "Flux2Transformer2DModel"})
        assert model.config.out_channels == TINY_CONFIG["in_channels"]
        assert model.hidden_width == 32
        with pytest.raises(ValueError, match="Flux2Transformer2DModel config has unknown keys"):
            Flux2Transformer2DModel.from_config({**TINY_CONFIG, "pooled_projection_dim": 3})
        with pytest.raises(ValueError, match="axes_dims_rope"):
            Flux2Transformer2DModel.from_config({**TINY_CONFIG, "axes_dims_rope": (4, 6, 6)})


def test_guidance_mismatch_and_bad_ids_are_errors() -> None:
    _, with_guidance = _pair(guidance_embeds=True)
    _, without = _pair(guidance_embeds=False)
    inputs = _inputs(1, 2, 2, torch.tensor([0.5]), None)
    with torch.no_grad():
        with pytest.raises(ValueError, match="guidance"):
            with_guidance(**inputs)
        with pytest.raises(ValueError, match="guidance"):
            without(**{**inputs, "guidance": torch.tensor([3.0])})
        with pytest.raises(ValueError, match="img_ids must be"):
            without(**{**inputs, "img_ids": inputs["img_ids"][None]})
