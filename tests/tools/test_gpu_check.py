"""`tools/gpu/check.sh --dry-run` (issue 34): the one-call GPU check runs its whole path on the CPU with tiny
shapes (the GPU tests' code on the CPU, then the benchmark with CUDA graphs through the dry-run backend,
FP8 through the test-only emulation, torch.compile with the eager backend) and writes a report with every
section, so the script is ready, and stays so, for whenever a GPU is lent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MD_HEADINGS = (
    "# diffserve GPU check",
    "## Environment",
    "## GPU tests",
    "## bf16 matmul rate",
    "## FLUX.1-dev-shaped DiT",
    "## Qwen-Image-shaped DiT",
    "## Wan 2.1 14B-shaped DiT",
    "## Against the published anchors",
    "## Targets",
    "## Skipped",
)
FLUX_VARIANTS = (
    "diffusers eager",
    "diffusers compiled",
    "diffserve eager",
    "diffserve compiled",
    "diffserve BCG",
    "diffserve compiled + BCG",
    "diffserve fp8-dynamic (emulated)",
)


def test_check_dry_run_writes_every_section(tmp_path: Path) -> None:
    out = tmp_path / "report"
    # A budget this loaded machine cannot run out of: every measurement must run (the script's own
    # default keeps the dry run under 3 minutes by skipping, and listing, what would not fit).
    env = {**os.environ, "PYTHON": sys.executable, "TOTAL_BUDGET_S": "900", "TEST_BUDGET_S": "300"}
    result = subprocess.run(
        ["bash", str(ROOT / "tools/gpu/check.sh"), "--dry-run", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    markdown = (out / "report.md").read_text()
    for heading in MD_HEADINGS:
        assert heading in markdown, heading
    report = json.loads((out / "report.json").read_text())
    assert {"env", "tests", "matmul", "sections", "anchors", "targets", "skipped"} <= set(report)
    assert report["env"]["dry_run"] is True
    tests = report["tests"]
    assert tests["ran"] and tests["failed"] == 0 and tests["passed"] > 0, tests
    assert report["matmul"]["tflops"] > 0
    sections = report["sections"]
    assert set(sections) == {"flux", "qwen_image", "wan"}, report["skipped"]
    flux = {(row["variant"], row["batch"]): row for row in sections["flux"]["rows"]}
    for variant in FLUX_VARIANTS:
        row = flux[(variant, 1)]
        assert row.get("s_per_step") and not row.get("error"), row
        assert row.get("steps2_s"), row  # the denoising loop (28 steps on a GPU)
    for variant in ("diffusers eager", "diffserve eager", "diffserve BCG"):
        assert flux[(variant, 4)].get("s_per_step"), variant  # step batching at batch 4
    assert any("BCG counts" in note and "'missed': 0" in note for note in sections["flux"]["notes"])
    for name in ("qwen_image", "wan"):
        variants = {row["variant"] for row in sections[name]["rows"] if row.get("s_per_step")}
        assert {"diffusers eager", "diffserve eager"} <= variants, (name, sections[name]["rows"])
    assert {row["model"] for row in report["anchors"]} == {"flux", "qwen_image", "wan"}
    assert all(row["ours_s_per_step"] for row in report["anchors"])
    assert any("1.3x diffusers eager" in target["target"] for target in report["targets"])
