"""Breakable CUDA graphs on a GPU (`runtime/cuda_graph/`, `CudaGraphBackend`): replays give the eager
output byte for byte, for the tiny FLUX.1, Qwen-Image (its prompt padded to token buckets, attention
broken out of the graphs) and Z-Image DiTs, in fp32 and bf16; an over-limit prompt runs eager; and a whole
tiny FLUX generation through `--enable-cuda-graph` (captured in the warm-up) gives the eager pixels.

With `DIFFSERVE_GPU_TESTS_DEVICE=cpu` the same checks run with CUDA graphs' replay emulated on the CPU."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from diffserve.registry import PROMPT_PADDERS
from diffserve.runtime.cuda_graph import Buckets, CudaGraphBackend, GraphRunner, padder_for
from diffserve.testing.graph_emulation import EmulatedGraphBackend
from diffserve.testing.tiny_dits import FLUX, QWEN_IMAGE, Z_IMAGE, tiny_dit, tiny_dit_inputs

pytestmark = pytest.mark.gpu
BUCKETS = Buckets(batch=(1, 2, 4), tokens=(8, 16, 64))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, list):
        return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    return torch.equal(a, b)


def _runner(dit: torch.nn.Module, device: torch.device) -> GraphRunner:
    """CUDA graphs on a GPU; on the CPU, their replay semantics emulated (testing/graph_emulation.py)."""
    backend = CudaGraphBackend(device) if device.type == "cuda" else EmulatedGraphBackend()
    return GraphRunner(dit, padder_for(dit, PROMPT_PADDERS), backend, BUCKETS).install()


@pytest.fixture(autouse=True)
def _one_cpu_thread(device: torch.device):
    """On the CPU, one thread (multi-threaded CPU matmuls split rows by count: tests/unit/test_cuda_graph_padders.py)."""
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", [FLUX, QWEN_IMAGE, Z_IMAGE])
@pytest.mark.parametrize(
    ("batch", "text", "ragged"), [(1, 8, False), (1, 7, False), (2, 13, True), (4, 5, True)]
)
def test_replay_is_byte_identical_to_eager(device, dtype, name, batch, text, ragged) -> None:
    """(1, 8): no padding at all; the others pad the prompt to its token bucket (Qwen-Image)."""
    dit = tiny_dit(name, device, dtype)
    inputs = tiny_dit_inputs(name, batch, text, ragged=ragged, device=device, dtype=dtype)
    with torch.inference_mode():
        expected = dit(**inputs)
        runner = _runner(dit, device)
        first, again = dit(**inputs), dit(**inputs)
    assert runner.summary()["replayed"] == 2 and runner.summary()["captured"] >= 1
    assert _same(first, expected), f"{name} {dtype} batch {batch} text {text}: replay differs from eager"
    assert _same(again, expected)
    assert runner.backend.graphs > 0


def test_over_limit_prompt_runs_eager(device) -> None:
    dit = tiny_dit(QWEN_IMAGE, device)
    inputs = tiny_dit_inputs(QWEN_IMAGE, 1, 100, device=device)
    with torch.inference_mode():
        expected = dit(**inputs)
        runner = _runner(dit, device)
        assert _same(dit(**inputs), expected)
    assert runner.summary()["fallback"] == 1 and runner.summary()["captured"] == 0


def test_flux_generation_with_enable_cuda_graph_matches_eager(device, tiny_flux_dir) -> None:
    if device.type != "cuda":
        pytest.skip("--enable-cuda-graph needs CUDA graphs (the dry run covers the runner on the CPU)")
    from diffserve import DiffGenerator

    def pixels(gen: DiffGenerator) -> np.ndarray:
        out = gen.generate(prompt="a red fox", seed=3, height=64, width=64, num_inference_steps=4)
        return np.stack([np.asarray(image) for image in out.images])

    eager = pixels(DiffGenerator.from_pretrained(tiny_flux_dir, show_progress=False))
    gen = DiffGenerator.from_pretrained(
        tiny_flux_dir, show_progress=False, enable_cuda_graph=True, warmup_resolutions=[(64, 64)]
    )
    [runner] = gen.cuda_graphs
    captured = runner.summary()["captured"]
    assert captured > 0
    assert np.array_equal(pixels(gen), eager)
    assert runner.summary()["replayed"] >= 4 and runner.summary()["captured"] == captured
