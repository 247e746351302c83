"""Cache methods on LTX-2 (`models/dits/ltx2_cache.py`): the residual of both streams, video and audio, is
what a block method caches and reuses (PAB: the attention modules' outputs, every block running), with Diffusers' default guidance (CFG, STG on a block the tiny DiT has,
modality guidance and rescale all on): the positive, negative and STG rows of a request decide together,
the modality-isolation rows run exact in their own forward, and the request counts one step per step.

Tiny random LTX-2 (4 blocks), 64x64, 9 frames, 20 steps, seed 7. DBCache that never reuses is the exact
output (frames and soundtrack); each method reuses work within its measured video PSNR (floors 4 dB below;
random weights say nothing about a trained model's); requests caching differently in one batch each get
what they get alone.
"""

from __future__ import annotations

import numpy as np
import pytest

from diffserve import DiffGenerator, SamplingParams
from diffserve.errors import InvalidRequestError
from diffserve.families.ltx2.tiny import TinyLTX2Spec, build_tiny_ltx2
from diffserve.testing.image_metrics import psnr_uint8 as psnr
from diffserve.testing.parity import snr_db
from diffserve.testing.threads import one_torch_thread

STEPS = 20
PROMPT = "a robot dancing in the rain"
KWARGS = {
    "height": 64, "width": 64, "num_frames": 9, "num_inference_steps": STEPS, "max_sequence_length": 32,
    "extra": {"spatio_temporal_guidance_blocks": [1]},  # Diffusers' default block 28 is beyond the tiny DiT
}  # fmt: skip
NEVER = {"method": "dbcache", "Fn_compute_blocks": 1, "Bn_compute_blocks": 1, "residual_diff_threshold": 0}
DBCACHE = {
    "method": "dbcache", "Fn_compute_blocks": 1, "Bn_compute_blocks": 1, "residual_diff_threshold": 1.0,
    "max_warmup_steps": 3, "max_continuous_cached_steps": 1,
}  # fmt: skip
TEACACHE = {"method": "teacache", "rel_l1_thresh": 2.0, "coefficients": [1.0, 0.0]}
#: setting -> (its cache, measured video PSNR in dB, measured soundtrack SNR in dB) against the exact output.
MEASURED = {
    "dbcache": (DBCACHE, 49.8, 71.5),
    "dbcache+taylorseer": (
        {**DBCACHE, "Fn_compute_blocks": 2, "Bn_compute_blocks": 0, "enable_taylorseer": True},
        48.4,
        71.3,
    ),
    "teacache": (TEACACHE, 25.8, 55.0),
    "taylorseer": ({"method": "taylorseer"}, 32.6, 63.0),
    "scm": ({"method": "scm"}, 36.9, 70.4),
    "seacache": ({"method": "seacache"}, 37.1, 70.5),  # its probe: the video latents on their grid
    "pab": ({"method": "pab"}, 54.5, 85.1),  # attention outputs reused, every block runs
    # on every branch: LTX-2 runs its guidance's branches in one forward, none can be skipped
    "fastercache": ({"method": "fastercache", "is_guidance_distilled": True}, 56.2, 87.7),
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny models' ops take microseconds: threads only add contention on a shared CPU."""
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def ltx2(tmp_path_factory):
    folder = build_tiny_ltx2(tmp_path_factory.mktemp("ltx2-cache"), TinyLTX2Spec(num_layers=4))
    generator = DiffGenerator.from_pretrained(
        folder, device="cpu", show_progress=False, batch_policy="throughput"
    )
    return generator, generator.generate(PROMPT, seed=7, **KWARGS)


def _frames(out) -> np.ndarray:
    return np.stack(out.frames)


def test_every_method_is_offered_and_dbcache_that_never_reuses_is_exact(ltx2) -> None:
    generator, exact = ltx2
    assert generator.pipeline.cache_rule.methods == {
        "dbcache",
        "taylorseer",
        "teacache",
        "magcache",
        "scm",
        "easycache",
        "seacache",
        "pab",
        "fastercache",
    }
    out = generator.generate(PROMPT, seed=7, cache=NEVER, **KWARGS)
    np.testing.assert_array_equal(_frames(out), _frames(exact))
    np.testing.assert_array_equal(out.audio[0].waveform, exact.audio[0].waveform)
    assert out.cache["steps_computed"] == STEPS and out.cache["blocks_computed"] == STEPS * 4


@pytest.mark.parametrize("name", list(MEASURED))
def test_each_method_reuses_both_streams_within_its_measured_psnr(ltx2, name) -> None:
    generator, exact = ltx2
    cache, video_db, audio_db = MEASURED[name]
    out = generator.generate(PROMPT, seed=7, cache=cache, **KWARGS)
    video = psnr(_frames(out), _frames(exact))
    audio = snr_db(out.audio[0].waveform, exact.audio[0].waveform)
    print(f"LTX-2 {name}: video {video:.1f} dB, audio SNR {audio:.1f} dB, {out.cache['steps_reused']} reused")
    assert out.cache["steps_reused"] > 0 and out.cache["blocks_reused"] > 0
    assert out.cache["steps_computed"] + out.cache["steps_reused"] == STEPS  # one count per step
    assert video >= video_db - 4.0 and audio >= audio_db - 4.0


def test_fastercache_cannot_skip_the_negative_branch(ltx2) -> None:
    """LTX-2's guidance (CFG, STG, modality isolation) reads every branch's rows in one step: the
    negative branch cannot be left out, so FasterCache's approximation of it is a 400 naming `cache`."""
    generator, _ = ltx2
    with pytest.raises(InvalidRequestError, match="every branch in one forward") as refused:
        generator.generate(PROMPT, seed=7, cache="fastercache", **KWARGS)
    assert refused.value.param == "cache"


def test_magcache_measures_ratios_then_reuses_with_them(ltx2) -> None:
    generator, exact = ltx2
    measured = generator.generate(
        PROMPT, seed=7, cache={"method": "magcache", "magcache_calibrate": True}, **KWARGS
    )
    ratios = measured.cache["measured_mag_ratios"]
    assert len(ratios) == STEPS and measured.cache["steps_reused"] == 0
    cache = {"method": "magcache", "mag_ratios": ratios, "magcache_thresh": 0.2, "magcache_K": 2}
    out = generator.generate(PROMPT, seed=7, cache=cache, **KWARGS)
    assert out.cache["steps_reused"] > 0
    assert psnr(_frames(out), _frames(exact)) >= 25.0


def test_a_mixed_batch_gives_each_request_its_own_output(ltx2) -> None:
    generator, _ = ltx2
    params = [
        SamplingParams(prompt=PROMPT, seed=i, cache=c, **KWARGS)
        for i, c in enumerate((None, DBCACHE, TEACACHE, {"method": "pab"}))
    ]
    alone = [generator.generate_from_params(p) for p in params]
    counts = generator.engine.scheduler.batch_size_counts
    shared_before = sum(n for size, n in counts.items() if size >= 2)
    together = generator.generate_many(params)
    assert sum(n for size, n in counts.items() if size >= 2) > shared_before, (
        "the requests never shared a step"
    )
    for a, b in zip(alone, together, strict=True):
        assert np.abs(_frames(a).astype(int) - _frames(b).astype(int)).max() <= 1
        assert snr_db(b.audio[0].waveform, a.audio[0].waveform) >= 60.0
        assert a.cache == b.cache
