"""Breakable CUDA graphs through whole generations on the tiny checkpoints, on the CPU (CUDA graphs' replay
emulated; the warm-up test with the dry-run backend):
FLUX.1, Qwen-Image and Z-Image give the same pixels with the runner installed as without, with and
without CFG (Qwen-Image's CFG branches have prompts of different lengths: a padding mask); the warm-up
captures and afterwards an unseen size is MISSED and runs eager; `--enable-cuda-graph` is refused on the
CPU and with the flags it cannot combine with."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from diffserve import DiffGenerator
from diffserve.configs.engine_args import EngineArgs
from diffserve.errors import UserError
from diffserve.families.qwen_image.tiny import build_tiny_qwen_image
from diffserve.families.z_image.tiny import build_tiny_zimage
from diffserve.registry import PROMPT_PADDERS
from diffserve.runtime.cuda_graph import (
    DryRunBackend,
    check_cuda_graph_args,
    install_cuda_graphs,
    warmup_capture,
)
from diffserve.runtime.cuda_graph.buckets import Buckets
from diffserve.testing.graph_emulation import EmulatedGraphBackend

BUCKETS = Buckets(batch=(1, 2, 4), tokens=(16, 64, 256))
PROMPT = "a red fox in the snow"
NEGATIVE = "blurry, low quality, distorted, oversaturated, watermark"


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_flux_dir) -> dict[str, Path]:
    return {
        "flux": tiny_flux_dir,
        "qwen_image": build_tiny_qwen_image(tmp_path_factory.mktemp("qwen")),
        "z_image": build_tiny_zimage(tmp_path_factory.mktemp("zimage")),
    }


def _load(folder: Path) -> DiffGenerator:
    # One thread: the padded text rows then leave the real rows' matmuls as they are (see
    # tests/unit/test_cuda_graph_padders.py).
    return DiffGenerator.from_pretrained(folder, device="cpu", show_progress=False, cpu_threads=1)


def _pixels(gen: DiffGenerator, **kwargs) -> np.ndarray:
    out = gen.generate(prompt=PROMPT, seed=7, height=64, width=64, num_inference_steps=3, **kwargs)
    return np.stack([np.asarray(image) for image in out.images])


CASES = {
    "flux": [{}, {"true_cfg_scale": 2.0, "negative_prompt": NEGATIVE}],
    "qwen_image": [{}, {"true_cfg_scale": 2.0, "negative_prompt": NEGATIVE}],
    "z_image": [{"guidance_scale": 0.0}, {"guidance_scale": 3.0, "negative_prompt": NEGATIVE}],
}


@pytest.mark.parametrize("family", ["flux", "qwen_image", "z_image"])
def test_generation_through_the_graphs_is_pixel_identical(folders, family: str) -> None:
    gen = _load(folders[family])
    expected = [_pixels(gen, **case) for case in CASES[family]]
    components = {name: c.value for name, c in gen.pipeline.context.components.items()}
    # CUDA graphs' replay emulated on the CPU (testing/graph_emulation.py): the replay path a GPU takes.
    [runner] = install_cuda_graphs(
        components, gen.platform, PROMPT_PADDERS, backend=EmulatedGraphBackend(), buckets=BUCKETS
    )
    try:
        for case, want in zip(CASES[family], expected, strict=True):
            assert np.array_equal(_pixels(gen, **case), want), case
        counts = runner.summary()
        assert counts["captured"] >= 1 and counts["replayed"] == 3 * len(CASES[family])
        assert counts["missed"] == counts["fallback"] == counts["eager"] == 0
    finally:
        runner.uninstall()


def test_warm_up_captures_then_unseen_sizes_are_missed(folders, caplog) -> None:
    gen = _load(folders["qwen_image"])
    components = {name: c.value for name, c in gen.pipeline.context.components.items()}
    [runner] = install_cuda_graphs(
        components, gen.platform, PROMPT_PADDERS, backend=DryRunBackend(), buckets=BUCKETS
    )
    try:
        caplog.set_level(logging.INFO, logger="diffserve.cuda_graph")
        with warmup_capture([runner], sizes_given=True):
            gen.warm_up([(64, 64)])
        assert any(
            "warm-up captured" in r.getMessage() and "MISSED" in r.getMessage() for r in caplog.records
        )
        captured = runner.summary()["captured"]
        assert captured > 0 and not runner.capture_enabled
        _pixels(gen)  # the warm-up's size and a short prompt: replayed
        assert runner.summary()["missed"] == 0
        gen.generate(prompt=PROMPT, seed=1, height=32, width=64, num_inference_steps=1)  # a size never seen
        assert runner.summary()["missed"] >= 1 and runner.summary()["captured"] == captured
        assert any(
            "MISSED" in r.getMessage() and "not captured at warm-up" in r.getMessage() for r in caplog.records
        )
    finally:
        runner.uninstall()


def test_enable_cuda_graph_is_refused_on_the_cpu(folders) -> None:
    with pytest.raises(
        UserError, match=r"--enable-cuda-graph needs an NVIDIA GPU \(CUDA graphs\); this engine runs on"
    ):
        DiffGenerator.from_pretrained(
            folders["flux"], device="cpu", show_progress=False, enable_cuda_graph=True
        )


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        ({"dit_layerwise_offload": True}, "--dit-layerwise-offload"),
        ({"dit_cpu_offload": True}, "--dit-cpu-offload"),
        ({"num_gpus": 2}, "--num-gpus > 1"),
    ],
)
def test_enable_cuda_graph_names_the_flags_it_cannot_combine_with(flags, named: str) -> None:
    with pytest.raises(UserError, match=f"--enable-cuda-graph cannot be combined with {named}"):
        check_cuda_graph_args(EngineArgs(model_path="/m", enable_cuda_graph=True, **flags))
