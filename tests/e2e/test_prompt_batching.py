"""The Python API batches: `generate(prompt=[...])` and concurrent `generate` calls from several threads
run their steps as shared DiT batches, and each image stays within one uint8 level of the same prompt
generated alone (the speed-up is measured by benchmarks/bench_prompt_batching.py)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from diffserve import DiffGenerator
from diffserve.configs.demo_model import demo_model_path

STEPS = 8
SETTINGS = {
    "height": 64,
    "width": 64,
    "max_sequence_length": 16,
    "true_cfg_scale": 3.0,
    "negative_prompt": "",
}
PROMPTS = [
    "a red circle on the left on a black background",
    "a large blue square in the center on a white background",
    "a small green triangle at the top on a gray background",
    "a yellow circle at the bottom on a black background",
    "a large purple square on the right on a white background",
    "a small orange triangle in the center on a gray background",
    "a blue circle at the top on a white background",
    "a large red triangle at the bottom on a black background",
]


@pytest.fixture(scope="module")
def generator() -> DiffGenerator:
    return DiffGenerator.from_pretrained(
        demo_model_path(), device="cpu", dtype="float32", show_progress=False, batch_policy="throughput"
    )


def _pixels(output) -> np.ndarray:
    return np.asarray(output.images[0]).astype(np.int16)


@pytest.fixture(scope="module")
def alone(generator) -> list[np.ndarray]:
    return [
        _pixels(generator.generate(prompt=p, seed=0, num_inference_steps=STEPS, **SETTINGS)) for p in PROMPTS
    ]


def _assert_close(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        diff = int(np.abs(a - b).max())
        assert diff <= 1, f"prompt {i}: max pixel difference {diff}"


def test_a_list_of_prompts_shares_dit_batches(generator, alone) -> None:
    stats = generator.engine.scheduler.batch_size_counts
    before = stats.copy()
    outputs = generator.generate(prompt=PROMPTS, seed=0, num_inference_steps=STEPS, **SETTINGS)
    assert [out.params.prompt for out in outputs] == PROMPTS
    batches = stats - before
    assert batches == {len(PROMPTS): STEPS}, f"DiT batches by size: {dict(batches)}"
    _assert_close([_pixels(out) for out in outputs], alone)


def test_concurrent_generate_calls_from_threads_share_batches(generator, alone) -> None:
    stats = generator.engine.scheduler.batch_size_counts
    before = stats.copy()
    results: dict[int, np.ndarray] = {}
    barrier = threading.Barrier(len(PROMPTS))

    def call(i: int) -> None:
        barrier.wait()
        results[i] = _pixels(
            generator.generate(prompt=PROMPTS[i], seed=0, num_inference_steps=STEPS, **SETTINGS)
        )

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert sorted(results) == list(range(len(PROMPTS)))
    batches = stats - before
    shared = sum(count for size, count in batches.items() if size > 1)
    assert shared >= STEPS // 2, f"DiT batches by size: {dict(batches)}"
    _assert_close([results[i] for i in range(len(PROMPTS))], alone)


def test_an_invalid_prompt_in_a_list_fails_before_any_work(generator) -> None:
    from diffserve.errors import UserError

    before = generator.engine.scheduler.batch_size_counts.copy()
    with pytest.raises(UserError, match="width"):
        generator.generate(
            prompt=["a red circle", "a blue square"], width=65, height=64, num_inference_steps=2
        )
    assert generator.engine.scheduler.batch_size_counts == before
    assert not generator.engine.has_work
