"""`--batch-policy auto` (the default) through a real `diffserve serve` on the tiny FLUX: the warm-up measures
the step curve at the probe size (batches of 1, 2, 4, 8), /server_info shows it with the policy, and
concurrent requests, however the policy groups them, each get the image they get alone (within one level)."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from server_process import generate_pixels, serving

REQUESTS = [
    {"prompt": "a red fox", "num_inference_steps": 5, "seed": 1},
    {
        "prompt": "a blue bird",
        "num_inference_steps": 3,
        "seed": 2,
        "true_cfg_scale": 3.0,
        "negative_prompt": "ugly",
    },
    {"prompt": "a green frog", "num_inference_steps": 4, "seed": 3, "n": 2},
    {"prompt": "a tall tower", "num_inference_steps": 2, "seed": 4, "size": "48x32"},
    {"prompt": "a small boat", "num_inference_steps": 6, "seed": 5},
]


@pytest.fixture(scope="module")
def auto_server(tiny_flux_dir, tmp_path_factory):
    with serving(tiny_flux_dir, tmp_path_factory.mktemp("auto-batching"), "--max-queue-size", "16") as srv:
        yield srv


def test_the_warm_up_measures_the_step_curve(auto_server) -> None:
    batching = auto_server.info()["engine"]["batching"]
    print(batching)
    assert batching["policy"] == "auto"
    # The probe size's bucket has every batch size up to --max-running-requests 8 (the memory model's
    # calibration probes, one request each, add rows=1 points at their own sizes).
    (curve,) = [points for points in batching["step_seconds"].values() if len(points) > 1]
    assert sorted(curve, key=int) == ["1", "2", "4", "8"]
    assert all(point["seconds"] > 0 and point["samples"] >= 2 for point in curve.values())


def test_concurrent_requests_each_equal_their_solo_run(auto_server) -> None:
    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        together = list(pool.map(lambda body: generate_pixels(auto_server, body), REQUESTS))
    for body, got in zip(REQUESTS, together, strict=True):
        want = generate_pixels(auto_server, body)
        diff = max(int(np.abs(g - w).max()) for g, w in zip(got, want, strict=True))
        print(f"{body['prompt']!r}: together vs alone max abs pixel diff {diff}")
        assert len(got) == len(want) == body.get("n", 1) and diff <= 1
    batching = auto_server.info()["engine"]["batching"]
    assert "1" in batching["step_seconds"]["4"]  # 32x32: 4 latent tokens, measured while serving
    assert set(batching["last_decision"].values()) <= {"measuring", "exploring", "measured", "re-measuring"}


def test_an_unknown_policy_is_one_error_line() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "diffserve.cli.main", "serve", "--model-path", "x", "--batch-policy", "fastest"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2
    assert "--batch-policy" in run.stderr and "auto" in run.stderr, run.stderr
