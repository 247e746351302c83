"""The check every cache-method test file makes per family (`tests/e2e/test_cache_methods_*.py`): requests
with different `cache` settings stepped together in one DiT batch each give what they give alone (within
one uint8 level: a batch may round a pixel the other way) and the same cache report."""

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

    def generate(self, *args: Any, **kwargs: Any) -> Any: ...


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
    pipeline = generator.pipeline
    reqs = [
        pipeline.run_pre_denoise(pipeline.validate(Req(SamplingParams(prompt=p, seed=i, cache=c, **params))))
        for i, (p, c) in enumerate(zip(prompts, caches, strict=True))
    ]
    assert len({pipeline.batch_key(r) for r in reqs}) == 1, name
    while not all(r.is_denoised for r in reqs):
        pipeline.denoise_step(reqs)
    for i, (prompt, cache, req) in enumerate(zip(prompts, caches, reqs, strict=True)):
        batched = pipeline.run_post_denoise(req)
        alone = generator.generate(prompt, seed=i, cache=cache, **params)
        got = first_output_pixels(batched.outputs).astype(int)
        assert np.abs(got - first_output_pixels(alone).astype(int)).max() <= 1, (name, cache)
        assert batched.cache_report == alone.cache, (name, cache)
