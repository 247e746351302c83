"""`diffserve calibrate-cache` chooses each tier's preset (cache method and settings) on a model folder and
stores it for the engine, which then serves the tier with it and reports the method; the preset computes no
more DiT blocks than the best original step cache at the same bar; it logs progress with an ETA and times
the speed-up interleaved with exact runs, reported with its spread."""

from __future__ import annotations

import json
import logging
import re

import pytest
from cli_request_args import request_args

from diffserve import DiffGenerator
from diffserve.cli.calibrate_cache import Progress, candidate_methods, interleaved_speedups, spread
from diffserve.cli.main import main
from diffserve.configs.quality import CALIBRATION_FILE, CALIBRATION_FORMAT, PSNR_BARS
from diffserve.errors import UserError
from diffserve.families.flux.tiny import build_tiny_flux


class _Records(logging.Handler):
    """The messages of one logger (the CLI replaces the root logger's handlers, pytest's among them)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def calibrate_log():
    handler = _Records()
    logger = logging.getLogger("diffserve.calibrate")
    logger.addHandler(handler)
    yield handler.messages
    logger.removeHandler(handler)


def test_calibration_is_written_next_to_the_model_and_used(tmp_path, capsys, calibrate_log) -> None:
    folder = build_tiny_flux(tmp_path / "flux")
    code = main(
        [
            "calibrate-cache",
            "--model-path",
            str(folder),
            *request_args("a red fox", steps=8),
            "--timing-rounds",
            "2",
            "--log-level",
            "warning",
        ]
    )
    assert code == 0
    table = capsys.readouterr().out
    assert "| medium | 35 dB |" in table and "| low | 30 dB |" in table and "| draft | 25 dB |" in table
    data = json.loads((folder / CALIBRATION_FILE).read_text())
    assert data["format"] == CALIBRATION_FORMAT
    assert data["family"] == "flux" and set(data["tiers"]) == set(PSNR_BARS) == {"medium", "low", "draft"}
    for tier, bar in PSNR_BARS.items():
        measured = data["measurements"]["tiers"][tier]
        assert measured["preset"] == data["tiers"][tier] and f"| {tier} | {bar:.0f} dB | " in table
        assert measured["mean_psnr_db"] >= bar + 1.0  # the default margin
        assert measured["mean_steps_computed"] < 8
        # The original step cache is among the candidates: the preset never computes more blocks.
        baseline = measured["best_stepcache"]
        assert baseline["preset"]["method"] == "stepcache" and baseline["mean_psnr_db"] >= bar + 1.0
        assert measured["mean_blocks_computed"] <= baseline["mean_blocks_computed"]
        speedup = measured["speedup_vs_exact"]
        assert speedup["samples"] == 2  # rounds x prompts
        assert 0 < speedup["min"] <= speedup["median"] <= speedup["max"]
        assert f"{speedup['median']:.2f}x ({speedup['min']:.2f}-{speedup['max']:.2f}x)" in table
    # Progress: every measured candidate and every timing round logs how much is left and an ETA. The
    # search's "at most" is a true bound on what followed, and exact once no search is left.
    counts = [re.search(r"(\d+) generations in \S+, (?:at most )?(\d+) left, ETA", m) for m in calibrate_log]
    done_and_left = [(int(c[1]), int(c[2])) for c in counts if c]
    total = done_and_left[-1][0]
    assert done_and_left[-1][1] == 0 and len(done_and_left) >= 4
    searched = [m for m in calibrate_log if m.startswith("candidate ") and "ETA <= " in m]
    assert searched and all(done + left >= total for done, left in done_and_left)
    [search_done] = [m for m in calibrate_log if m.startswith("Search done")]
    done, left = (int(x) for x in re.search(r"(\d+) generations in \S+, (\d+) left", search_done).groups())
    assert done + left == total and left == 2 * 4  # exact: 2 rounds x 1 prompt x (high + 3 tiers)
    rounds = [m for m in calibrate_log if m.startswith("Timing round")]
    assert len(rounds) == 2 and rounds[-1].endswith("0 left, ETA 0m00s")
    assert {c["preset"]["method"] for c in data["measurements"]["candidates"]} == {
        "stepcache",
        "dbcache",
        "teacache",
        "taylorseer",
        "scm",
        "magcache",
        "easycache",
        "seacache",
    }  # every method the FLUX DiT runs, magcache with ratios measured on the prompts and FLUX.1's
    generator = DiffGenerator.from_pretrained(folder, device="cpu", show_progress=False)
    for tier, preset in data["tiers"].items():
        out = generator.generate("a red fox", height=32, width=32, num_inference_steps=8, quality=tier)
        assert out.params.quality == tier and out.cache["quality"] == tier
        assert out.cache["method"] == preset["method"]
        assert {k: out.cache["settings"][k] for k in preset if preset[k] is not None} == {
            k: v for k, v in preset.items() if v is not None
        }  # the settings that ran: the recorded ones (a null one filled with the family's default)


def test_methods_narrow_the_candidates(tmp_path, capsys) -> None:
    folder = build_tiny_flux(tmp_path / "flux")
    args = ["calibrate-cache", "--model-path", str(folder), *request_args("a fox")]
    more = [
        "--num-inference-steps",
        "8",
        "--timing-rounds",
        "1",
        "--methods",
        "stepcache,scm",
        "--also-steps",
        "4,5",
    ]
    assert main([*args, *more]) == 0
    data = json.loads((folder / CALIBRATION_FILE).read_text())
    assert {c["preset"]["method"] for c in data["measurements"]["candidates"]} == {"stepcache", "scm"}
    # SCM's named masks have no 5-step form: a tier must not refuse 5 steps, so only the step cache passes.
    assert {preset["method"] for preset in data["tiers"].values()} == {"stepcache"}
    assert data["measurements"]["also_steps"] == [4, 5]
    for tier, bar in PSNR_BARS.items():
        at_steps = data["measurements"]["tiers"][tier]["mean_psnr_db_at_steps"]
        assert set(at_steps) == {"4", "5"} and min(at_steps.values()) >= bar
    capsys.readouterr()
    assert main([*args, "--methods", "stepcache,easy"]) == 2
    assert "--methods: unknown method 'easy'; candidates are stepcache, dbcache" in capsys.readouterr().err
    assert main([*args, "--also-steps", "4,x"]) == 2
    assert "--also-steps: expected step counts such as 4,8, got '4,x'" in capsys.readouterr().err


def test_methods_the_dit_does_not_run_are_refused() -> None:
    whole_span = frozenset({"teacache", "magcache", "taylorseer", "scm", "easycache"})
    assert candidate_methods(None, whole_span, "X") == [
        "stepcache",
        "teacache",
        "taylorseer",
        "scm",
        "magcache",
        "easycache",
    ]
    with pytest.raises(
        UserError, match=r"--methods: X's DiT does not run 'dbcache' \(it runs: easycache, magcache"
    ):
        candidate_methods("dbcache", whole_span, "X")
    with pytest.raises(UserError, match="name at least one method"):
        candidate_methods(" , ", whole_span, "X")


def test_dry_run_writes_nothing(tmp_path) -> None:
    folder = build_tiny_flux(tmp_path / "flux")
    assert (
        main(
            [
                "calibrate-cache",
                "--model-path",
                str(folder),
                *request_args("a fox", steps=4),
                "--timing-rounds",
                "1",
                "--dry-run",
                "--methods",
                "scm",  # the cheapest candidate (fixed masks): the test is that nothing is written
                "--log-level",
                "warning",
            ]
        )
        == 0
    )
    assert not (folder / CALIBRATION_FILE).exists()


def test_timing_rounds_below_one_is_a_one_line_error(tmp_path, capsys) -> None:
    code = main(["calibrate-cache", "--model-path", str(tmp_path / "absent"), "--timing-rounds", "0"])
    err = capsys.readouterr().err
    assert code == 2 and err == "error: --timing-rounds must be >= 1, got 0\n"


def test_a_hub_repo_id_is_refused_with_how_to_get_a_folder(capsys) -> None:
    code = main(["calibrate-cache", "--model-path", "some-org/some-model"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: calibrate-cache writes its file")
    assert "hf download REPO --local-dir DIR" in err


def test_speedups_are_timed_interleaved_and_reversed_every_round() -> None:
    """On a fake clock: exact runs take 4 s, medium 2 s, low 1 s, and the host is 3x slower in round 2.
    Interleaving keeps every ratio exact despite the load change (all exact runs first would not)."""
    cost = {"high": 4.0, "medium": 2.0, "low": 1.0}
    calls: list[tuple[str, str]] = []
    time_now = [0.0]

    def run(prompt: str, quality: str) -> None:
        calls.append((prompt, quality))
        time_now[0] += cost[quality] * (1 if len(calls) <= 6 else 3)

    rounds_done: list[int] = []
    speedups, exact = interleaved_speedups(
        run,
        ["a", "b"],
        ["medium", "low"],
        rounds=2,
        clock=lambda: time_now[0],
        after_round=rounds_done.append,
    )
    assert [quality for _, quality in calls] == ["high", "medium", "low"] * 2 + ["low", "medium", "high"] * 2
    assert [prompt for prompt, _ in calls] == ["a"] * 3 + ["b"] * 3 + ["a"] * 3 + ["b"] * 3
    assert rounds_done == [0, 1] and exact == [4.0, 4.0, 12.0, 12.0]
    assert speedups == {"medium": [2.0] * 4, "low": [4.0] * 4}  # one ratio per round and prompt


def test_spread_reports_median_min_max_and_count() -> None:
    assert spread([2.0, 18.8, 2.2, 2.1]) == {"median": 2.15, "min": 2.0, "max": 18.8, "samples": 4}


def test_progress_estimates_the_time_left_from_the_time_per_generation() -> None:
    ticks = iter([100.0, 110.0, 110.0])
    progress = Progress(clock=lambda: next(ticks))
    progress.count(4)  # 4 generations in 10 s: 2.5 s each
    assert progress.describe(6, bound=True) == "4 generations in 0m10s, at most 6 left, ETA <= 0m15s"
    assert progress.describe(30) == "4 generations in 0m10s, 30 left, ETA 1m15s"
