"""Smoke test of benchmarks/bench_cache_vs_cachedit.py (issue 33): its quickest run (`--quick`: the demo
model and a tiny 8-block FLUX at 64x64, 12 steps, one prompt, one run) completes, its table has a row for
every method and setting on both checkpoints, cache-dit and diffusers' hooks run on both, the exact rows
agree across the two engines, diffusers' SeaCache hook reuses the steps diffserve's seacache reuses, and
every diffserve cell is either a measurement or says which cache this build does not support; on the
guidance-distilled FLUX, diffserve's pab and fastercache reuse the attention diffusers' hooks reuse, and on
the true-CFG demo model fastercache is refused. The figures themselves are the benchmark's business, not this test's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "cache_dit",
    reason='the cache benchmark compares against cache-dit: pip install "cache-dit>=1.5" (the test extra)',
)

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_cache_vs_cachedit.py"
THRESHOLDS = ("0.08", "0.12", "0.2")
HOOKS = (
    "first_block_cache",
    "taylorseer_cache",
    "mag_cache",
    "sea_cache",
    "faster_cache",
    "pyramid_attention_broadcast",
)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    out = tmp_path_factory.mktemp("bench_cache")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--threads", "1", "--json", str(out / "result.json"),
         "--model-dir", str(out / "flux-8blocks")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout, json.loads((out / "result.json").read_text())


def test_the_table_has_every_row(quick_run: tuple[str, dict]) -> None:
    table, _ = quick_run
    sections = table.split("\n### ")[1:]
    assert [s.split(":", 1)[0] for s in sections] == ["demo", "flux"], table
    for section in sections:
        rows = [
            line for line in section.splitlines()
            if line.startswith("| ") and not line.startswith(("| |", "| method |"))
        ]  # fmt: skip
        names = [row.split(" | ")[0].removeprefix("| ") for row in rows]
        for threshold in THRESHOLDS:
            for method in ("DBCache", "DBCache + TaylorSeer"):
                assert any(
                    r.startswith(f"| {method} | F1B0, residual_diff_threshold {threshold}") for r in rows
                ), (method, threshold, section)
        assert names.count("exact") == 1 and names.count("DBCache + SCM") == 1, names
        for hook in HOOKS:
            assert f"diffusers hook: {hook}" in names, (hook, names)
        assert names.count("TeaCache") == 3, names
        # Every setting has its diffserve line, measured or "not supported by this build (...)".
        assert section.count(" diffserve | ") == len(names), section


def test_references_ran_and_exact_rows_agree(quick_run: tuple[str, dict]) -> None:
    _, result = quick_run
    for checkpoint in result["checkpoints"]:
        rows = checkpoint["rows"]
        exact = rows[0]
        assert exact["method"] == "exact"
        # diffserve's exact output is diffusers' (native pipelines match diffusers' pixels).
        assert min(exact["diffserve_result"]["psnr_vs_diffusers_exact"]) >= 40, exact
        for row in rows:
            if row["reference"] == "cache-dit" or row["method"] in (
                "diffusers hook: first_block_cache", "diffusers hook: mag_cache", "diffusers hook: taylorseer_cache",
                "diffusers hook: sea_cache",
            ):  # fmt: skip
                assert "error" not in row["reference_result"], row
                assert row["reference_result"]["seconds"] > 0
            ours = row["diffserve_result"]
            assert "error" in ours or (ours["seconds"] > 0 and 0 < ours["block_work"] <= 1), row
            if row["method"] == "diffusers hook: sea_cache":
                # The hook really caches (not its fail-open mode), and diffserve's seacache decides alike.
                assert 0 < row["reference_result"]["steps_reused"] == ours["steps_reused"], row
            hook = row["method"].removeprefix("diffusers hook: ")
            if (
                hook in HOOKS[-2:] and checkpoint["checkpoint"] == "flux"
            ):  # FasterCache, PAB: the same decisions
                assert "error" not in row["reference_result"] and "error" not in ours, row
                assert ours["steps_reused"] == row["reference_result"]["steps_reused"] > 0, row
                assert ours["block_work"] == pytest.approx(row["reference_result"]["block_work"]), row
            if hook == "faster_cache" and checkpoint["checkpoint"] == "demo":
                # true CFG, given `is_guidance_distilled` as the hook: each branch reuses its own attention
                assert "error" not in ours and ours["steps_reused"] > 0, row
