"""What the cache-methods-by-name files (test_cache_methods_families.py, _images_wave3.py, _videos_wave3.py)
share: the DBCache and TeaCache settings, a family's case built once (its generator, its keywords and its exact output without a cache), the
check that DBCache which never reuses is that exact output, each reusing setting's output with its PSNR
against it, and the FasterCache run without CFG.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from diffserve import DiffGenerator
from diffserve.configs.sampling_params import SamplingParams
from diffserve.testing.cache_parity import assert_fastercache_for_case, assert_fastercache_without_cfg
from diffserve.testing.image_metrics import psnr_uint8 as psnr

#: DBCache that never reuses: its range path must compute what the DiT's own loop computes.
NEVER = {"method": "dbcache", "Fn_compute_blocks": 1, "Bn_compute_blocks": 1, "residual_diff_threshold": 0}
#: Aggressive reusing settings (threshold 1: reuse after the warm-up, at most one step in a row), since tiny
#: random models' first-block residuals change by more than any real threshold between steps.
DBCACHE = {
    "method": "dbcache", "Fn_compute_blocks": 1, "Bn_compute_blocks": 1, "residual_diff_threshold": 1.0,
    "max_warmup_steps": 3, "max_continuous_cached_steps": 1,
}  # fmt: skip
DBCACHE_TAYLORSEER = {**DBCACHE, "Fn_compute_blocks": 2, "Bn_compute_blocks": 0, "enable_taylorseer": True}
TEACACHE = {"method": "teacache", "rel_l1_thresh": 2.0, "coefficients": [1.0, 0.0]}  # the raw change

#: name -> (builder, generation kwargs, {setting name: measured PSNR in dB}).
Cases = Mapping[str, tuple[Callable[[Path], Path], dict[str, Any], dict[str, float]]]
#: One output's pixels (an image's or a video's) as uint8.
Pixels = Callable[[Any], np.ndarray]
#: A family's case: its name, generator, keywords (with steps and seed), measured PSNRs and exact output.
Case = tuple[str, DiffGenerator, dict[str, Any], dict[str, float], np.ndarray]


def build_case(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    cases: Cases,
    prompt: str,
    steps: int,
    pixels: Pixels,
) -> Case:
    """The case `request.param` names: its tiny checkpoint built and loaded, and its output without a
    cache at `steps` steps, seed 7."""
    build, kwargs, measured = cases[request.param]
    generator = DiffGenerator.from_pretrained(
        build(tmp_path_factory.mktemp(request.param)), device="cpu", show_progress=False
    )
    kwargs = {**kwargs, "num_inference_steps": steps, "seed": 7}
    exact = pixels(generator.generate(prompt, **kwargs))
    return request.param, generator, kwargs, measured, exact


def assert_never_reusing_is_exact(
    family: Case, prompt: str, never: dict[str, Any], pixels: Pixels, blocks_computed: int
) -> None:
    """DBCache that never reuses (`never`) gives the exact output pixel for pixel, computing
    `blocks_computed` blocks and reusing no step."""
    name, generator, kwargs, _, exact = family
    out = generator.generate(prompt, cache=never, **kwargs)
    np.testing.assert_array_equal(pixels(out), exact, err_msg=name)
    assert out.cache["steps_reused"] == 0 and out.cache["blocks_computed"] == blocks_computed


def reusing_outputs(
    family: Case, prompt: str, settings: Mapping[str, dict[str, Any]], steps: int, pixels: Pixels
) -> Iterator[tuple[str, float, np.ndarray, float]]:
    """For each measured setting: its name, measured PSNR, output and PSNR against the exact output, once
    it has reused steps and blocks (asserted)."""
    name, generator, kwargs, measured, exact = family
    for setting, db in measured.items():
        out = generator.generate(prompt, cache=settings[setting], **kwargs)
        got = pixels(out)
        score = psnr(got, exact)
        print(f"{name} {setting}: {score:.1f} dB, {out.cache['steps_reused']} of {steps} steps reused")
        assert out.cache["steps_reused"] > 0 and out.cache["blocks_reused"] > 0, (name, setting)
        yield setting, db, got, score


def assert_fastercache_without_cfg_case(
    family: Case, prompt: str, no_cfg: Mapping[str, dict[str, Any]], fastercache_db: Mapping[str, float]
) -> None:
    """FasterCache without CFG (`no_cfg[name]`, else guidance 1) within 4 dB of its measured PSNR."""
    name, generator, kwargs, _, _ = family
    no_cfg_kwargs = no_cfg.get(name, {"guidance_scale": 1.0})
    assert_fastercache_without_cfg(name, generator, prompt, kwargs, no_cfg_kwargs, fastercache_db[name] - 4.0)


def assert_fastercache_with_cfg_case(
    family: Case, prompt: str, fastercache_cfg_db: Mapping[str, float]
) -> None:
    """FasterCache with the case's own CFG (the negative branch approximated) within its measured PSNR."""
    name, generator, kwargs, _, exact = family
    params = SamplingParams(prompt=prompt, **kwargs)
    assert_fastercache_for_case(name, generator, params, exact, fastercache_cfg_db)


def without_seed(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """A case's keywords without its seed (for a batch whose requests take their own)."""
    return {k: v for k, v in kwargs.items() if k != "seed"}
