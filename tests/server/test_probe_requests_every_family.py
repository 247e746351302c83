"""The server's probe requests pass every family's validation: the warm-up, memory calibration (both the
accelerator's and the CPU's sizes), /health_generate, the batch policy's warm-up measurement and the compile
warm-up's kinds. A probe the family refuses stops `diffserve serve` at start (the warm-up's) or silently
turns calibration into the estimate; Mochi's one-step probe (its linear-quadratic schedule needs two) and
SANA-Video's square probe (its resolution binning generates it at the 624x624 bin, no multiple of 32) did.
A family now declares what its probes need (`PipelineFacts.probe_steps`, `probe_extra`, as `probe_frames`),
and the probes are built by the functions the server calls, checked here through the family's own
validation (`resolved_params`: no generation runs).

Every family the registry lists (each has a `make-tiny` builder) is built and loaded once, in its own test
(about 0.3 s each). One real `diffserve serve` of the tiny Mochi with the warm-up on must become ready,
calibrate its memory model and answer /health_generate with its two-step probe."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from server_process import serving

from diffserve import DiffGenerator
from diffserve.configs.engine_args import EngineArgs
from diffserve.configs.sampling_params import SamplingParams
from diffserve.errors import InvalidRequestError
from diffserve.registry import FAMILIES, TinyCheckpointOptions, family_by_name
from diffserve.runtime.calibration import (
    PROBE_PIXELS,
    calibration_params,
    health_probe_params,
    probe_params,
    round_up,
)
from diffserve.runtime.compile import warmup_plan, warmup_request
from diffserve.runtime.contract import EnginePipeline, PipelineFacts, resolved_params
from diffserve.runtime.memory import CALIBRATION_SIDES, CPU_CALIBRATION_SIDES
from diffserve.runtime.step_curve_probe import curve_probe_params
from diffserve.server.health_probe import health_check_params

#: Families that generate every request at one area, whatever size it asks (so both calibration probes
#: at the same size: the memory model is a one-point fit with the estimate's slopes,
#: `runtime.memory.fit_line`) -> why.
ONE_AREA = {
    "hidream-i1": "Diffusers' area rule rescales every request to the default size's area",
    "cogvideox-i2v": "CogVideoX 1.0-5B-I2V's learned positions take its sample size only (its probe_size)",
}
#: Running requests the batch policy's warm-up measurement steps at most (1, 2, 4).
CURVE_MOST = 4


def server_probe_requests(facts: PipelineFacts) -> list[tuple[str, SamplingParams]]:
    """(what, request) of every probe a `diffserve serve` of this family sends, built as the server does."""
    size = round_up(PROBE_PIXELS, facts.pixel_multiple)  # the engine's probe_size
    probes = [("warm-up", probe_params(facts, "warm-up"))]
    for side in (*CPU_CALIBRATION_SIDES, *CALIBRATION_SIDES):
        asked = probe_params(facts, "calibration", round_up(side, facts.pixel_multiple))
        probes.append((f"calibration {side}", calibration_params(facts, asked)))
    probes.append(("/health_generate", health_probe_params(facts, health_check_params(size), size)))
    curve = probe_params(facts, "batch curve")
    probes += [
        (f"batch curve #{seed}", curve_probe_params(facts, curve, CURVE_MOST, seed)) for seed in (0, 1)
    ]
    for height, width, kind in warmup_plan([facts.probe_side_size(size)], facts.cfg_mode):
        probes.append((f"compile warm-up {kind}", warmup_request(facts, height, width, kind)))
    return probes


def refused_probes(pipeline: EnginePipeline) -> dict[str, str]:
    """Each probe the family's validation refuses -> its error."""
    refused = {}
    for what, params in server_probe_requests(pipeline.facts):
        try:
            resolved_params(pipeline, params)
        except InvalidRequestError as exc:
            refused[what] = str(exc)
    return refused


def calibration_size(pipeline: EnginePipeline, side: int) -> tuple[int, int]:
    """(height, width) the family generates the calibration probe of `side` at."""
    facts = pipeline.facts
    params = probe_params(facts, "calibration", round_up(side, facts.pixel_multiple))
    resolved = resolved_params(pipeline, calibration_params(facts, params))
    return resolved.height, resolved.width


def load_tiny(family_name: str, folder: Path) -> DiffGenerator:
    """The family's tiny checkpoint (`diffserve make-tiny NAME`) written to `folder` and loaded."""
    path = family_by_name(family_name).tiny_builder(folder, TinyCheckpointOptions(0))
    return DiffGenerator(EngineArgs(model_path=str(path)), show_progress=False, memory_model=False)


@pytest.mark.parametrize("family_name", [family.name for family in FAMILIES])
def test_every_probe_passes_the_family_validation(family_name: str, tmp_path: Path) -> None:
    generator = load_tiny(family_name, tmp_path / family_name)
    pipeline, facts = generator.pipeline, generator.pipeline.facts
    assert refused_probes(pipeline) == {}, f"{family_name} refuses the server's probes"
    warmup = resolved_params(pipeline, probe_params(facts, "warm-up"))
    assert warmup.num_inference_steps == facts.probe_steps >= 1
    if facts.makes_video:
        assert warmup.num_frames == facts.probe_frames
    for sides in (CPU_CALIBRATION_SIDES, CALIBRATION_SIDES):  # the memory line needs two sizes
        sizes = {calibration_size(pipeline, side) for side in sides}
        assert len(sizes) == 2 or family_name in ONE_AREA, (
            f"{family_name}'s calibration sizes {sides}: {sizes}"
        )


def test_mochi_and_sana_video_declare_what_their_probes_need(tmp_path: Path) -> None:
    """The two families whose probes differ from the defaults; refused without their declarations."""
    mochi = load_tiny("mochi", tmp_path / "mochi").pipeline
    assert (mochi.facts.probe_steps, mochi.facts.probe_extra) == (2, ())
    one_step = probe_params(mochi.facts, "warm-up")
    one_step.num_inference_steps = 1
    with pytest.raises(InvalidRequestError, match="at least 2 for Mochi"):
        resolved_params(mochi, one_step)

    sana_video = load_tiny("sana-video", tmp_path / "sana-video").pipeline
    facts = sana_video.facts
    assert (facts.probe_steps, facts.probe_extra) == (1, (("use_resolution_binning", False),))
    binned = probe_params(facts, "warm-up")
    binned.extra = {"use_resolution_binning": True}
    with pytest.raises(InvalidRequestError, match="to the bin 624x624, which is not a multiple of 32"):
        resolved_params(sana_video, binned)


def test_a_family_setting_the_client_sends_wins_over_the_probe_default(tmp_path: Path) -> None:
    """A probe's `extra` keeps what is already set (the health probe is completed, not overwritten)."""
    facts = load_tiny("sana-video", tmp_path / "sana-video").pipeline.facts
    params = SamplingParams(
        "x", height=64, width=64, num_inference_steps=3, extra={"use_resolution_binning": True}
    )
    facts.with_probe_settings(params)
    assert params.extra == {"use_resolution_binning": True} and params.num_inference_steps == 3


def test_mochi_server_starts_with_warm_up_and_answers_health_generate(tmp_path: Path) -> None:
    folder = family_by_name("mochi").tiny_builder(tmp_path / "mochi", TinyCheckpointOptions(0))
    with serving(folder, tmp_path) as srv:
        info = srv.info()["engine"]
        assert info["family"] == "mochi" and info["warmup_seconds"] is not None
        r = httpx.get(f"{srv.base_url}/health_generate", timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["num_inference_steps"] == 2
        log = srv.log()
        assert "Engine failed to start" not in log
        assert "Memory calibration failed" not in log, log[-3000:]
        assert "Batch policy: the warm-up measurement failed" not in log, log[-3000:]
