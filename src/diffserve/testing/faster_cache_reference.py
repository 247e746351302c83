"""diffusers' FasterCache hook on `StableDiffusion3Pipeline`, set up to decide as diffserve's `fastercache`
does (`tests/e2e/test_fastercache_cfg.py`, `benchmarks/bench_fastercache_cfg.py`).

The hook needs three things SD3's pipeline does not give it: the current timestep (SD3's pipeline keeps
none: read here from the transformer's `timestep` input), SD3's attention modules by name (they are
`transformer_blocks.N.attn`; its default identifiers select `attn1`), and `pooled_projections` among the
inputs it splits into the two CFG branches. Its state is not reset after a generation (SD3's transformer is
no `CacheMixin`): `reset_faster_cache` does that before each one.
"""

from __future__ import annotations

import torch
from diffusers.hooks import FasterCacheConfig, HookRegistry, apply_faster_cache

#: The SD3 transformer's inputs whose rows are the two CFG branches, for the hook to split.
SD3_BRANCH_INPUTS = ["hidden_states", "encoder_hidden_states", "timestep", "pooled_projections"]


def apply_sd3_faster_cache(transformer: torch.nn.Module, is_guidance_distilled: bool = False) -> None:
    """FasterCache at diffusers' defaults on an SD3 transformer (its `is_guidance_distilled` as given)."""
    current: dict[str, float] = {}
    transformer.register_forward_pre_hook(
        lambda module, args, kwargs: current.update(t=float(kwargs["timestep"][0])), with_kwargs=True
    )
    config = FasterCacheConfig(
        spatial_attention_block_identifiers=("transformer_blocks.*attn",),
        current_timestep_callback=lambda: current["t"],
        tensor_format="BCHW",
        is_guidance_distilled=is_guidance_distilled,
        _unconditional_conditional_input_kwargs_identifiers=SD3_BRANCH_INPUTS,
    )
    apply_faster_cache(transformer, config)


def reset_faster_cache(transformer: torch.nn.Module) -> None:
    """Start the hook's step counts and kept outputs afresh (before a generation)."""
    HookRegistry.check_if_exists_or_initialize(transformer).reset_stateful_hooks()


def attention_rows(transformer: torch.nn.Module, attention: str = "attn") -> list[int]:
    """A list that gets the batch rows of each call of the joint blocks' `attention` modules (counted at
    their `to_q`, which a stood-in call does not run): diffusers' SD3 / CogVideoX and diffserve's alike."""
    rows: list[int] = []
    for block in transformer.transformer_blocks:
        getattr(block, attention).to_q.register_forward_hook(lambda m, a, out: rows.append(out.shape[0]))
    return rows
