"""What the cache-method and quality-tier test files check per family (`tests/e2e/test_cache_methods_*.py`,
`tests/e2e/test_quality_tiers_wave3.py`): requests with different `cache` settings or `quality` tiers
stepped together in one DiT batch each give what they give alone (within one uint8 level: a batch may
round a pixel the other way), the same cache report and the same steps computed in full."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from diffserve.configs.sampling_params import SamplingParams
from diffserve.pipelines.base import Pipeline
from diffserve.request import Req


class CachingGenerator(Protocol):
    """What the check uses of a `DiffGenerator` (passed in: `testing` may not import the API)."""

    pipeline: Pipeline

    def generate_from_params(self, params: SamplingParams) -> Any: ...


def first_output_pixels(output: Any) -> np.ndarray:
    """The first image (as RGB) or video's frames of a generation's output, as an array."""
    return np.asarray(output.images[0].convert("RGB")) if output.images else np.asarray(output.frames[0])


def assert_mixed_caches_as_alone(
    name: str,
    generator: CachingGenerator,
    params: dict[str, Any],
    caches: Sequence[dict[str, Any] | None],
    prompts: Sequence[str],
) -> None:
    """Request i (`prompts[i]`, seed i, `caches[i]`, `params`) stepped in one batch with the others equals
    itself generated alone, and reports the same cache counts; they must share one batch key."""
    requests = [
        SamplingParams(prompt=p, seed=i, cache=c, **params)
        for i, (p, c) in enumerate(zip(prompts, caches, strict=True))
    ]
    assert_batched_as_alone(name, generator, requests)


def assert_batched_as_alone(
    name: str,
    generator: CachingGenerator,
    requests: Sequence[SamplingParams],
    alone: Sequence[Any | None] | None = None,
) -> None:
    """`requests` stepped in one DiT batch each equal themselves generated alone, and report the same cache
    counts and steps computed in full; they must share one batch key. `alone`: the outputs the caller
    already generated alone, in order (None, or a None entry: generated here)."""
    pipeline = generator.pipeline
    reqs = [pipeline.run_pre_denoise(pipeline.validate(Req(params))) for params in requests]
    assert len({pipeline.batch_key(r) for r in reqs}) == 1, name
    while not all(r.is_denoised for r in reqs):
        pipeline.denoise_step(reqs)
    known = list(alone) if alone is not None else [None] * len(requests)
    for params, req, given in zip(requests, reqs, known, strict=True):
        label = (name, params.quality, params.cache)
        batched = pipeline.run_post_denoise(req)
        single = given if given is not None else generator.generate_from_params(params)
        got = first_output_pixels(batched.outputs).astype(int)
        assert np.abs(got - first_output_pixels(single).astype(int)).max() <= 1, label
        assert batched.cache_report == single.cache, label
        assert batched.steps_computed_in_full == single.steps_computed_in_full, label
