"""diffusers' own SeaCache hook on its FluxPipeline, the reference of diffserve's `seacache` (tests and the
cache benchmark).

diffusers ships SeaCache's indicator for Cosmos 3 and Wan only: other transformers need a
`raw_vision_callback` (the output latents on their grid) and a denoising loop that passes the scheduler
step, sigma and step count in `cache_context`; FluxPipeline passes neither, so without them the hook runs
every block (its "fail-open" mode). `flux_sea_cache` supplies both: the callback unpacks FLUX's 2x2-packed
latents to (channels, 1, height, width) per output, as diffserve hands any family's latents to SeaCache
(`pipelines/cfg_batch.latent_grid`), and `cache_context` gets the loop's step (found from the pipeline's
current timestep), the scheduler's sigma there and the step count.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def flux_raw_vision(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """FLUX's packed latents (batch, h/2 * w/2, 4c) as SeaCache's raw vision: (c, 1, h, w) per output."""
    tokens, ids = kwargs["hidden_states"], kwargs["img_ids"]
    rows, cols = int(ids[:, 1].max()) + 1, int(ids[:, 2].max()) + 1
    b, _, channels = tokens.shape
    grid = tokens.view(b, rows, cols, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    grid = grid.reshape(b, channels // 4, 2 * rows, 2 * cols)
    return list(grid.unsqueeze(2).unbind(0))


def enable_flux_sea_cache(pipe: Any, config: Any) -> list[tuple[int, bool]]:
    """Enable diffusers' SeaCache (`config`, a `SeaCacheConfig`; its `raw_vision_callback` defaults to
    `flux_raw_vision`) on FluxPipeline `pipe`'s transformer with a `cache_context` that carries the step,
    sigma and step count. Returns a list that gets (step, whether the last block ran) per transformer call
    ("cond", then "uncond" under true CFG). `disable_flux_sea_cache` undoes it."""
    transformer = pipe.transformer
    plain = type(transformer).cache_context.__get__(transformer)
    calls: list[tuple[int, bool]] = []

    @contextlib.contextmanager
    def cache_context(name: str, **kwargs: Any) -> Iterator[None]:
        timesteps = pipe.scheduler.timesteps
        step = int((timesteps == pipe._current_timestep).nonzero()[0])
        sigma = float(pipe.scheduler.sigmas[step])
        with plain(name, step_index=step, sigma=sigma, num_inference_steps=len(timesteps)):
            calls.append((step, False))
            yield

    def last_block_ran(module: Any, inputs: Any, output: Any) -> None:
        if calls:
            calls[-1] = (calls[-1][0], True)

    if config.raw_vision_callback is None:
        config.raw_vision_callback = flux_raw_vision
    handle = transformer.single_transformer_blocks[-1].attn.to_q.register_forward_hook(last_block_ran)
    transformer.enable_cache(config)
    transformer.cache_context = cache_context
    transformer._sea_cache_reference_handle = handle
    return calls


def disable_flux_sea_cache(pipe: Any) -> None:
    """Undo `enable_flux_sea_cache`."""
    transformer = pipe.transformer
    transformer.__dict__.pop("cache_context", None)
    transformer.disable_cache()
    handle = transformer.__dict__.pop("_sea_cache_reference_handle", None)
    if handle is not None:
        handle.remove()


@contextlib.contextmanager
def flux_sea_cache(pipe: Any, config: Any) -> Iterator[list[tuple[int, bool]]]:
    """`enable_flux_sea_cache` for the `with` block."""
    calls = enable_flux_sea_cache(pipe, config)
    try:
        yield calls
    finally:
        disable_flux_sea_cache(pipe)
