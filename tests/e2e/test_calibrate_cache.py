"""`diffserve calibrate-cache` measures the tiers on a model folder and stores thresholds the engine then uses."""

from __future__ import annotations

import json

from diffserve import DiffGenerator
from diffserve.cli.main import main
from diffserve.configs.quality import CALIBRATION_FILE, PSNR_BARS
from diffserve.testing.tiny_flux import build_tiny_flux


def test_calibration_is_written_next_to_the_model_and_used(tmp_path, capsys) -> None:
    folder = build_tiny_flux(tmp_path / "flux")
    code = main(
        [
            "calibrate-cache",
            "--model-path",
            str(folder),
            "--prompt",
            "a red fox",
            "--height",
            "32",
            "--width",
            "32",
            "--num-inference-steps",
            "8",
            "--log-level",
            "warning",
        ]
    )
    assert code == 0
    table = capsys.readouterr().out
    assert "| medium | 30 dB |" in table
    data = json.loads((folder / CALIBRATION_FILE).read_text())
    assert data["family"] == "flux" and set(data["tiers"]) == set(PSNR_BARS)
    for tier, bar in PSNR_BARS.items():
        measured = data["measurements"]["tiers"][tier]
        assert measured["mean_psnr_db"] >= bar + 1.0  # the default margin
        assert measured["mean_steps_computed"] < 8
    generator = DiffGenerator.from_pretrained(folder, device="cpu", show_progress=False)
    assert {t: p.threshold for t, p in generator.pipeline.quality_rule.policies.items()} == {
        t: v["threshold"] for t, v in data["tiers"].items()
    }


def test_dry_run_writes_nothing(tmp_path) -> None:
    folder = build_tiny_flux(tmp_path / "flux")
    assert (
        main(
            [
                "calibrate-cache",
                "--model-path",
                str(folder),
                "--prompt",
                "a fox",
                "--height",
                "32",
                "--width",
                "32",
                "--num-inference-steps",
                "4",
                "--dry-run",
                "--log-level",
                "warning",
            ]
        )
        == 0
    )
    assert not (folder / CALIBRATION_FILE).exists()
