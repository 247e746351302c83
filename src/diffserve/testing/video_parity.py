"""Helpers of the video pipelines' parity tests: both sides' final latents and uint8 frames for one request,
and a module's tiny folders, built once each with their diffserve generator and Diffusers pipeline."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diffserve.testing.parity import generator_and_reference, to_uint8


def final_latents_and_frames(generator: Any, params: Any) -> tuple[torch.Tensor, np.ndarray]:
    """diffserve's final latents (outputs, channels, frames, h, w), before decoding, and its uint8 frames
    (outputs, F, H, W, 3) for `params` (`SamplingParams`) on `generator` (a `DiffGenerator`): the request
    validated, prepared, denoised step by step and decoded, as the engine runs it alone."""
    from diffserve.request import Req

    pipeline = generator.pipeline
    req = pipeline.run_pre_denoise(pipeline.validate(Req(params=params)))
    while not req.is_denoised:
        pipeline.denoise_step([req])
    latents = req.latents.clone()
    return latents, np.stack(pipeline.run_post_denoise(req).outputs.frames)


def diffusers_latents_and_frames(reference: Any, seed: int, **kwargs: Any) -> tuple[torch.Tensor, np.ndarray]:
    """Diffusers' `reference(**kwargs)` run twice with a CPU generator seeded `seed` (as diffserve seeds a
    request): its latents (`output_type="latent"`) and its uint8 frames."""

    def run(output_type: str) -> Any:
        return reference(
            generator=torch.Generator("cpu").manual_seed(seed), output_type=output_type, **kwargs
        )

    return run("latent").frames, to_uint8(run("np").frames)


def folder_pairs(
    directory: Callable[[str], Path],
    build: Callable[[str, Path], Path],
    generator_cls: Any,
    diffusers_cls: Any,
) -> Callable[[str], tuple[Any, Any]]:
    """`get(name)`: the (diffserve generator, Diffusers pipeline) pair on the tiny folder `build(name, dir)`
    writes into `directory(name)` (a fresh folder: pytest's `tmp_path_factory.mktemp`), built on first use
    and kept (a module-scoped fixture returns it). The generator class is passed in, as to
    `generator_and_reference`."""
    cache: dict[str, tuple[Any, Any]] = {}

    def get(name: str) -> tuple[Any, Any]:
        if name not in cache:
            cache[name] = generator_and_reference(generator_cls, build(name, directory(name)), diffusers_cls)
        return cache[name]

    return get


@contextmanager
def randn_like_from(seed: int) -> Iterator[None]:
    """Inside the block `torch.randn_like` draws from one CPU generator seeded `seed`: a Diffusers pipeline
    that draws noise from torch's global RNG (SkyReels-V2 diffusion forcing's `addnoise_condition`) then
    draws what a diffserve request draws from a generator of its own."""
    generator = torch.Generator("cpu").manual_seed(seed)
    original = torch.randn_like

    def seeded(tensor: torch.Tensor, **_: object) -> torch.Tensor:
        return torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype, device=tensor.device)

    torch.randn_like = seeded
    try:
        yield
    finally:
        torch.randn_like = original
