"""Projection fusion in the native FLUX DiT (`fuse_for_inference`): memory, names, misuse, step cache rows."""

from __future__ import annotations

import gc
import logging
import weakref

import pytest
import torch

from diffserve.models.dits.flux import FluxTransformer2DModel, FluxTransformerConfig
from diffserve.models.step_cache import CacheRows, StepCachePolicy, StepCacheState, batch_step_cache

CONFIG = {
    "in_channels": 8,
    "num_layers": 1,
    "num_single_layers": 2,
    "attention_head_dim": 8,
    "num_attention_heads": 2,
    "joint_attention_dim": 12,
    "pooled_projection_dim": 10,
    "axes_dims_rope": (2, 2, 4),
    "guidance_embeds": False,
}


def _model(seed: int = 0) -> FluxTransformer2DModel:
    torch.manual_seed(seed)
    model = FluxTransformer2DModel(FluxTransformerConfig(**CONFIG)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    return model


def _inputs(batch: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    grid = torch.meshgrid(torch.zeros(1), torch.arange(3.0), torch.arange(3.0), indexing="ij")
    img_ids = torch.stack(grid, -1)
    return {
        "hidden_states": torch.randn(batch, 9, CONFIG["in_channels"], generator=g),
        "encoder_hidden_states": torch.randn(batch, 4, CONFIG["joint_attention_dim"], generator=g),
        "pooled_projections": torch.randn(batch, CONFIG["pooled_projection_dim"], generator=g),
        "timestep": torch.linspace(0.9, 0.2, batch),
        "img_ids": img_ids.reshape(-1, 3),
        "txt_ids": torch.zeros(4, 3),
    }


def test_fusion_frees_the_originals_and_keeps_parameter_count_and_names() -> None:
    model = _model()
    names = dict(model.state_dict())
    count = sum(p.numel() for p in model.parameters())
    originals = [
        weakref.ref(model.transformer_blocks[0].attn.to_q.weight),
        weakref.ref(model.single_transformer_blocks[1].proj_mlp.weight),
        weakref.ref(model.norm_out.linear.weight),
    ]
    model.fuse_for_inference()
    gc.collect()
    assert all(ref() is None for ref in originals), "a fused part is still alive: memory would be doubled"
    assert sum(p.numel() for p in model.parameters()) == count
    fused = model.state_dict()
    assert list(fused) != [] and sorted(fused) == sorted(names)
    for key, value in names.items():
        assert torch.equal(fused[key], value), key
    assert not any(".to_q." in name or "norm1.linear" in name for name, _ in model.named_parameters())


def test_second_fuse_does_nothing_and_logs_nothing(caplog) -> None:
    model = _model()
    with caplog.at_level(logging.INFO, logger="diffserve"):
        model.fuse_for_inference()
        fused = model.single_transformer_blocks[0].to_qkv_mlp
        model.fuse_for_inference()
    assert model.single_transformer_blocks[0].to_qkv_mlp is fused
    assert caplog.text.count("fused QKV in 3 attention layers") == 1


def test_fusing_before_the_weights_are_loaded_is_refused() -> None:
    with torch.device("meta"):
        model = FluxTransformer2DModel(FluxTransformerConfig(**CONFIG))
    with pytest.raises(RuntimeError, match="after loading the checkpoint"):
        model.fuse_for_inference()


def test_a_fused_model_refuses_a_state_dict_with_part_of_a_group() -> None:
    model = _model()
    state = model.state_dict()
    model.fuse_for_inference()
    del state["transformer_blocks.0.attn.to_k.weight"]
    with pytest.raises(RuntimeError, match="must be loaded together"):
        model.load_state_dict(state, strict=True)


def test_step_cache_rows_run_the_fused_blocks_like_the_full_batch() -> None:
    """With a step cache, the fused adaLN vectors are sliced by row like the activations: the rows that
    run the blocks get what the full batch gives them."""
    model = _model()
    model.fuse_for_inference()
    inputs = _inputs(3)
    cached = StepCacheState(StepCachePolicy(threshold=10.0, full_first_steps=1, max_reuse_in_a_row=5))
    with torch.no_grad():
        exact = model(**inputs)
        # Step 0: every row runs; step 1: the cached request (row 0) reuses, rows 1-2 run their blocks.
        for step in range(2):
            cache = batch_step_cache([CacheRows(cached, 1, step, 4), CacheRows(None, 2, step, 4)])
            out = model(**inputs, step_cache=cache)
    assert cached.history == [True, False]
    torch.testing.assert_close(out[1:], exact[1:], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out[:1], exact[:1], rtol=1e-6, atol=1e-6)  # same input: same residual
