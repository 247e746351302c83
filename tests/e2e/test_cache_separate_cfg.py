"""DBCache's `enable_separate_cfg` (cache-dit's name, issue 33): the CFG branch of a request keeps its own
cache state (probe reference, residual, counters) and decides on its own.

cache-dit's default per model: true where diffusers' pipeline runs the CFG branch as a transformer call of
its own (Qwen-Image, Wan, HunyuanVideo 1.5), false elsewhere. On a tiny random Qwen-Image (4 blocks, 20
steps, 64x64, true CFG 4.0) at DBCache F1B0 with threshold 0.81, the two branches' first-block residuals
change by 0.805 and 0.819 at step 3, so they part there: diffserve reuses the steps cache-dit on
diffusers' QwenImagePipeline reuses, branch by branch (positive [3, 4, 13], CFG [5, 13], measured), and
its output matches cache-dit's at the pipeline parity bar (40 dB; measured: identical pixels).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diffserve import DiffGenerator, SamplingParams
from diffserve.configs.cache_rule import CacheRule
from diffserve.configs.cache_settings import DBCacheSettings
from diffserve.errors import InvalidRequestError
from diffserve.families.qwen_image.tiny import TinyQwenImageSpec, build_tiny_qwen_image
from diffserve.request import Req
from diffserve.testing.image_metrics import psnr_uint8 as psnr

STEPS = 20
PROMPT = "a red fox in the snow"
KWARGS = {
    "height": 64, "width": 64, "num_inference_steps": STEPS, "true_cfg_scale": 4.0, "negative_prompt": "ugly",
    "max_sequence_length": 64,
}  # fmt: skip
DBCACHE = {
    "method": "dbcache", "Fn_compute_blocks": 1, "Bn_compute_blocks": 0, "residual_diff_threshold": 0.81,
    "max_warmup_steps": 2,
}  # fmt: skip
PARITY_DB = 40.0


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return build_tiny_qwen_image(tmp_path_factory.mktemp("qwen-cfg"), TinyQwenImageSpec(num_layers=4))


@pytest.fixture(scope="module")
def generator(qwen_dir):
    return DiffGenerator.from_pretrained(qwen_dir, device="cpu", show_progress=False)


def reused(history: list[bool]) -> list[int]:
    return [step for step, computed in enumerate(history) if not computed]


def denoise(generator, cache, seed: int = 3) -> Req:
    pipeline = generator.pipeline
    req = pipeline.run_pre_denoise(
        pipeline.validate(Req(SamplingParams(prompt=PROMPT, seed=seed, cache=cache, **KWARGS)))
    )
    while not req.is_denoised:
        pipeline.denoise_step([req])
    return req


def test_each_cfg_branch_decides_on_its_own_by_default_on_qwen_image(generator) -> None:
    req = denoise(generator, DBCACHE)
    state = req.step_cache
    assert state.settings.enable_separate_cfg is True  # cache-dit's default for Qwen-Image
    assert state.cfg_branch is not None
    positive, negative = reused(state.history), reused(state.cfg_branch.history)
    assert positive == [3, 4, 13] and negative == [5, 13], (positive, negative)
    assert len(state.diffs) == len(state.cfg_branch.diffs) == STEPS - 2  # each its own probe, each step
    report = req.cache_report
    assert report["settings"]["enable_separate_cfg"] is True
    assert report["steps_reused"] == 3 and report["cfg_branch"]["steps_reused"] == 2
    assert report["cfg_branch"]["blocks_computed"] + report["cfg_branch"]["blocks_reused"] == STEPS * 4
    # Kept together, the branches decide as one: no CFG state, the same decision for both rows.
    joint = denoise(generator, {**DBCACHE, "enable_separate_cfg": False})
    assert joint.step_cache.cfg_branch is None and "cfg_branch" not in joint.cache_report
    assert joint.cache_report["settings"]["enable_separate_cfg"] is False


def test_the_branches_reuse_what_cache_dit_reuses_and_the_output_matches(generator, qwen_dir) -> None:
    cache_dit = pytest.importorskip(
        "cache_dit", reason="the reference is cache-dit: pip install cache-dit>=1.5"
    )
    from diffusers import QwenImagePipeline

    req = denoise(generator, DBCACHE)
    ours = np.asarray(generator.pipeline.run_post_denoise(req).outputs.images[0].convert("RGB"))
    pipe = QwenImagePipeline.from_pretrained(qwen_dir, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    config = cache_dit.DBCacheConfig(Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=0.81,
                                     max_warmup_steps=2)  # enable_separate_cfg: its default  # fmt: skip
    cache_dit.enable_cache(pipe, cache_config=config)
    try:
        image = pipe(prompt=PROMPT, generator=torch.Generator("cpu").manual_seed(3), **KWARGS).images[0]
        stats = cache_dit.summary(pipe, logging=False)[0]
    finally:
        cache_dit.disable_cache(pipe)
    assert config.enable_separate_cfg is True
    assert reused(req.step_cache.history) == list(stats.cached_steps)
    assert reused(req.step_cache.cfg_branch.history) == list(stats.cfg_cached_steps)
    assert psnr(ours, np.asarray(image.convert("RGB"))) >= PARITY_DB


def test_a_mixed_batch_gives_each_request_its_own_output(generator) -> None:
    """A request with a separate CFG state, one without, and an exact one share each DiT forward."""
    pipeline = generator.pipeline
    caches = [{**DBCACHE, "enable_separate_cfg": True}, None, {**DBCACHE, "enable_separate_cfg": False}]
    reqs = [
        pipeline.run_pre_denoise(
            pipeline.validate(Req(SamplingParams(prompt=PROMPT, seed=3 + i, cache=c, **KWARGS)))
        )
        for i, c in enumerate(caches)
    ]
    assert len({pipeline.batch_key(r) for r in reqs}) == 1
    while not all(r.is_denoised for r in reqs):
        pipeline.denoise_step(reqs)
    for i, (cache, req) in enumerate(zip(caches, reqs, strict=True)):
        batched = pipeline.run_post_denoise(req)
        alone = generator.generate(PROMPT, seed=3 + i, cache=cache, **KWARGS)
        got = np.asarray(batched.outputs.images[0].convert("RGB")).astype(int)
        assert np.abs(got - np.asarray(alone.images[0].convert("RGB")).astype(int)).max() <= 1, cache
        assert batched.cache_report == alone.cache, cache


def test_the_default_and_support_come_from_the_family() -> None:
    settings = DBCacheSettings(Fn_compute_blocks=1)
    assert CacheRule("FluxPipeline", frozenset({"dbcache"}), 6).resolve(settings).enable_separate_cfg is False
    qwen = CacheRule("QwenImagePipeline", frozenset({"dbcache"}), 6, separate_cfg=True)
    assert qwen.resolve(settings).enable_separate_cfg is True
    ltx2 = CacheRule("LTX2Pipeline", frozenset({"dbcache"}), 6, separate_cfg_supported=False)
    assert ltx2.resolve(settings).enable_separate_cfg is False
    with pytest.raises(InvalidRequestError, match="enable_separate_cfg is not supported by LTX2Pipeline"):
        ltx2.resolve(DBCacheSettings(Fn_compute_blocks=1, enable_separate_cfg=True))
