"""What the cache-method and quality-tier test files check per family (`tests/e2e/test_cache_methods_*.py`,
`tests/e2e/test_quality_tiers_wave3.py`): requests with different `cache` settings or `quality` tiers
stepped together in one DiT batch each give what they give alone (within one uint8 level: a batch may
round a pixel the other way), the same cache report and the same steps computed in full."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from diffserve.configs.quality import APPROXIMATE_TIERS, EXACT, PSNR_BARS, TIERS
from diffserve.configs.sampling_params import SamplingParams
from diffserve.errors import InvalidRequestError
from diffserve.pipelines.base import Pipeline
from diffserve.request import Req
from diffserve.runtime.runner import CfgBranchViews
from diffserve.testing.image_metrics import psnr_uint8


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
    views = CfgBranchViews()  # as the runner presents a request skipping its negative branch (FasterCache)
    while not all(r.is_denoised for r in reqs):
        batch = views.enter(reqs)
        pipeline.denoise_step(batch)
        views.leave(batch)
    known = list(alone) if alone is not None else [None] * len(requests)
    for params, req, given in zip(requests, reqs, known, strict=True):
        label = (name, params.quality, params.cache)
        batched = pipeline.run_post_denoise(req)
        single = given if given is not None else generator.generate_from_params(params)
        got = first_output_pixels(batched.outputs).astype(int)
        assert np.abs(got - first_output_pixels(single).astype(int)).max() <= 1, label
        assert batched.cache_report == single.cache, label
        assert batched.steps_computed_in_full == single.steps_computed_in_full, label


#: The request keywords that can turn classifier-free guidance on (`assert_fastercache_without_cfg`).
CFG_KEYWORDS = ("true_cfg_scale", "negative_prompt", "guidance_scale")


def assert_refused(generator: CachingGenerator, params: SamplingParams, message: str, name: str) -> None:
    """Validating `params` is an InvalidRequestError on `cache` whose message contains `message`."""
    try:
        generator.pipeline.validate(Req(params))
    except InvalidRequestError as exc:
        assert exc.param == "cache" and message in str(exc), (name, str(exc))
        return
    raise AssertionError(f"{name}: {params.cache} was accepted; expected a refusal saying {message!r}")


def assert_fastercache_without_cfg(
    name: str,
    generator: CachingGenerator,
    prompt: str,
    kwargs: dict[str, Any],
    no_cfg: dict[str, Any],
    floor_db: float,
) -> float:
    """FasterCache at diffusers' defaults on a request without CFG (`prompt` with `kwargs` less their
    `CFG_KEYWORDS`, plus `no_cfg`, what turns the family's CFG off) reuses attention and stays at
    `floor_db` or more against the same request's exact output; returns that PSNR. Its
    `is_guidance_distilled` false is refused there (no negative branch to approximate)."""
    plain = {k: v for k, v in kwargs.items() if k not in CFG_KEYWORDS} | no_cfg
    params = SamplingParams(prompt=prompt, **plain)
    assert not generator.pipeline.validate(Req(params)).do_cfg, (name, "still runs CFG")
    forced = SamplingParams(
        prompt=prompt, cache={"method": "fastercache", "is_guidance_distilled": False}, **plain
    )
    assert_refused(generator, forced, "is_guidance_distilled false approximates", name)
    exact = first_output_pixels(generator.generate_from_params(params))
    out = generator.generate_from_params(
        SamplingParams(prompt=prompt, cache={"method": "fastercache"}, **plain)
    )
    score = psnr_uint8(first_output_pixels(out), exact)
    print(f"{name} fastercache: {score:.1f} dB, {out.cache['attention_reused']} attention calls reused")
    assert out.cache["attention_reused"] > 0 and out.cache["steps_reused"] > 0, (name, out.cache)
    assert "unconditional_skipped" not in out.cache, (name, out.cache)
    assert score >= floor_db, (name, score)
    return score


def assert_fastercache_with_cfg(
    name: str,
    generator: CachingGenerator,
    params: SamplingParams,
    exact: np.ndarray,
    floor_db: float,
) -> float | None:
    """FasterCache at diffusers' defaults on a request that runs CFG (`params`, whose exact output is
    `exact`): it skips the negative-prompt branch on some steps (diffusers' default: four of every five
    inside its timestep range), reuses self-attention on some of those, and stays at `floor_db` or more
    against `exact`; returns that PSNR. A family whose denoiser does not take one branch's view
    (`Pipeline.runs_branch_views`) refuses it naming `cache` instead (returns None)."""
    with_cache = dataclasses.replace(params, cache={"method": "fastercache"})
    assert generator.pipeline.validate(Req(dataclasses.replace(params))).do_cfg, (name, "runs no CFG")
    if not generator.pipeline.runs_branch_views:
        assert_refused(generator, with_cache, "cannot skip this request's negative-prompt branch", name)
        return None
    out = generator.generate_from_params(with_cache)
    score = psnr_uint8(first_output_pixels(out), exact)
    report = out.cache
    print(f"{name} fastercache with CFG: {score:.1f} dB, {report['unconditional_skipped']} negative branches "
          f"skipped, {report['attention_reused']} attention calls reused")  # fmt: skip
    assert report["unconditional_skipped"] > 0 and report["attention_reused"] > 0, (name, report)
    assert report["steps_reused"] == report["unconditional_skipped"], (name, report)
    assert score >= floor_db, (name, score)
    return score


def assert_fastercache_for_case(
    name: str,
    generator: CachingGenerator,
    params: SamplingParams,
    exact: np.ndarray,
    measured: dict[str, float],
) -> None:
    """A family case's FasterCache check: where its request runs CFG (`name` in `measured`, its PSNR in dB)
    `assert_fastercache_with_cfg` 4 dB below the measured PSNR; elsewhere the request runs no CFG (there
    is no negative branch to approximate)."""
    if name in measured:
        assert_fastercache_with_cfg(name, generator, params, exact, measured[name] - 4.0)
    else:
        assert not generator.pipeline.validate(Req(dataclasses.replace(params))).do_cfg, name


@dataclass
class TierCase:
    """One family's quality-tier case: its generator, the request's keywords (size, frames, inputs), and
    each tier's output for `prompt` / `seed`, generated alone (`generate_tiers`)."""

    name: str
    generator: CachingGenerator
    kwargs: dict[str, Any]
    steps: int
    prompt: str
    seed: int
    outputs: dict[str, Any] = field(default_factory=dict)

    def params(self, quality: str, prompt: str | None = None, seed: int | None = None) -> SamplingParams:
        return SamplingParams(
            prompt=self.prompt if prompt is None else prompt,
            seed=self.seed if seed is None else seed,
            num_inference_steps=self.steps,
            quality=quality,
            **self.kwargs,
        )

    def generate_tiers(self) -> TierCase:
        self.outputs = {tier: self.generator.generate_from_params(self.params(tier)) for tier in TIERS}
        return self


def assert_tier_ladder(case: TierCase) -> None:
    """Every approximate tier keeps its PSNR bar against the exact output and reports its tier; medium
    computes no more steps in full than `high`, and low and draft each fewer than the tier above."""
    exact = case.outputs[EXACT]
    reference = first_output_pixels(exact)
    assert reference.std() > 5, "the exact output is flat; PSNR against it would prove nothing"
    assert exact.cache is None and exact.steps_computed_in_full == case.steps
    above = case.steps
    for tier, bar in PSNR_BARS.items():
        out = case.outputs[tier]
        score = psnr_uint8(first_output_pixels(out), reference)
        steps = out.steps_computed_in_full
        print(
            f"{case.name} {tier}: {score:.1f} dB, {steps} of {case.steps} steps in full ({out.cache['method']})"
        )
        assert out.params.quality == tier and out.cache["quality"] == tier
        assert score >= bar, f"{case.name} {tier}: {score:.1f} dB is under its {bar} dB bar"
        if tier == "medium":
            assert steps <= above, (case.name, tier, steps)
        else:
            assert steps < above, f"{case.name} {tier}: {steps} steps in full, the tier above {above}"
        above = steps


def assert_mixed_tiers_as_alone(case: TierCase, other_prompt: str, other_seed: int) -> None:
    """One DiT batch of the exact tier (on another prompt and seed) and every approximate tier gives each
    request its alone output (`assert_batched_as_alone`)."""
    requests = [
        case.params(EXACT, other_prompt, other_seed),
        *(case.params(tier) for tier in APPROXIMATE_TIERS),
    ]
    alone = [None, *(case.outputs[tier] for tier in APPROXIMATE_TIERS)]
    assert_batched_as_alone(case.name, case.generator, requests, alone)
