"""The multi-rank engine on the CPU: 2 rank processes over gloo, one torch thread each, on tiny FLUX.

Parity with one rank (CFG-parallel; Ulysses 2), mixed CFG / no-CFG requests in one step batch, the rank
processes' lifecycle (close, context manager, parent killed), a worker's error failing only its request,
and a dead worker failing fast."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest

from diffserve.api import DiffGenerator
from diffserve.configs.sampling_params import SamplingParams
from diffserve.distributed.launch import RankFailedError
from diffserve.runtime.distributed_runner import FAILURE_HOOK_ENV
from diffserve.testing.threads import one_torch_thread

CFG = dict(negative_prompt="blurry", true_cfg_scale=3.0)
BASE = dict(height=64, width=64, num_inference_steps=3, seed=7)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    with one_torch_thread():  # the workers take the parent's thread count
        yield


def pixels(output) -> np.ndarray:
    return np.asarray(output.images[0], dtype=np.int16)


def mixed_batch() -> list[SamplingParams]:
    """One request with true CFG and one without, same shape: they share each denoising step."""
    return [
        SamplingParams(prompt="a red square", **CFG, **BASE),
        SamplingParams(prompt="a blue disc", **BASE),
    ]


@pytest.fixture(scope="module")
def reference(tiny_flux_dir: Path) -> dict[str, np.ndarray]:
    """One rank's outputs: one CFG request alone, and the mixed batch."""
    gen = DiffGenerator.from_pretrained(tiny_flux_dir, show_progress=False)
    alone = pixels(gen.generate("a red square", **CFG, **BASE))
    mixed = [pixels(out) for out in gen.generate_many(mixed_batch())]
    return {"alone": alone, "mixed_cfg": mixed[0], "mixed_plain": mixed[1]}


def dit_rows(gen: DiffGenerator) -> list[int]:
    """Rows of every DiT forward on rank 0 from now on (recorded by a forward pre-hook)."""
    rows: list[int] = []
    transformer = gen.pipeline.denoiser.transformer
    transformer.register_forward_pre_hook(
        lambda m, a, kw: rows.append(kw["hidden_states"].shape[0]), with_kwargs=True
    )
    return rows


def worker_processes(gen: DiffGenerator) -> list:
    assert gen.ranks is not None
    return [process for process, _ in gen.ranks.processes]


def test_cfg_parallel_matches_one_rank_and_stops_its_ranks(tiny_flux_dir, reference, monkeypatch) -> None:
    monkeypatch.setenv(FAILURE_HOOK_ENV, "pre_denoise:boom")  # read by the workers: see the failure test
    with DiffGenerator.from_pretrained(  # the throughput policy: the two requests share every step
        tiny_flux_dir, show_progress=False, num_gpus=2, enable_cfg_parallel=True, batch_policy="throughput"
    ) as gen:
        workers = worker_processes(gen)
        assert [w.is_alive() for w in workers] == [True]
        rows = dit_rows(gen)
        alone = pixels(gen.generate("a red square", **CFG, **BASE))
        assert rows == [1, 1, 1]  # rank 0 ran only the positive branch (one rank: 2 rows per step)
        mixed = [pixels(out) for out in gen.generate_many(mixed_batch())]
        assert rows[3:] == [2, 2, 2]  # positive branch + the CFG-less request, in one batch

        # A worker's error fails that request on rank 0, naming the rank; the next request runs.
        with pytest.raises(
            RankFailedError, match=r"rank 1 failed in pre_denoise: RuntimeError: injected failure"
        ):
            gen.generate("boom", **BASE)
        after = pixels(gen.generate("a red square", **CFG, **BASE))
        assert len(gen.engine.runner.cfg_views) == 0 and not gen.engine.runner.mirrored
    # Parity measured: identical pixels (max abs diff 0) on this CPU; a few ulps of latent would be <= 1.
    assert np.abs(alone - reference["alone"]).max() <= 1
    assert np.abs(after - reference["alone"]).max() <= 1
    assert np.abs(mixed[0] - reference["mixed_cfg"]).max() <= 1
    assert np.abs(mixed[1] - reference["mixed_plain"]).max() <= 1
    for worker in workers:
        worker.join(5)
        assert not worker.is_alive()
    gen.close()  # idempotent


def test_ulysses_two_ranks_matches_one_rank(tiny_flux_dir, reference) -> None:
    """Also with attention reuse (PAB), and FasterCache skipping a CFG request's negative branch: every
    rank stands in for the same attention calls (each its shard of the outputs) and skips the same
    steps' negative branch, so the images and the counts are one rank's."""
    steps = {**BASE, "num_inference_steps": 8}
    pab = SamplingParams(prompt="a red square", cache={"method": "pab"}, **steps)
    faster = SamplingParams(prompt="a red square", cache={"method": "fastercache"}, **CFG, **steps)
    single = DiffGenerator.from_pretrained(tiny_flux_dir, show_progress=False)
    one, one_faster = single.generate_from_params(pab), single.generate_from_params(faster)
    gen = DiffGenerator.from_pretrained(tiny_flux_dir, show_progress=False, num_gpus=2)
    try:
        assert gen.ranks is not None and gen.ranks.state is not None
        assert gen.ranks.state.ulysses_degree == 2 and gen.ranks.state.cfg_degree == 1
        mixed = [pixels(out) for out in gen.generate_many(mixed_batch())]
        two, two_faster = gen.generate_from_params(pab), gen.generate_from_params(faster)
    finally:
        gen.close()
    assert two_faster.cache == one_faster.cache and one_faster.cache["unconditional_skipped"] > 0
    assert np.abs(pixels(two_faster) - pixels(one_faster)).max() <= 1
    assert np.abs(mixed[0] - reference["mixed_cfg"]).max() <= 1
    assert np.abs(mixed[1] - reference["mixed_plain"]).max() <= 1
    assert two.cache == one.cache and one.cache["attention_reused"] > 0
    assert np.abs(pixels(two) - pixels(one)).max() <= 1
    assert not any(w.is_alive() for w in worker_processes(gen))


def test_a_dead_worker_fails_requests_fast(tiny_flux_dir) -> None:
    with DiffGenerator.from_pretrained(  # the throughput policy: the two requests share every step
        tiny_flux_dir, show_progress=False, num_gpus=2, enable_cfg_parallel=True, batch_policy="throughput"
    ) as gen:
        (worker,) = worker_processes(gen)
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(5)
        start = time.monotonic()
        with pytest.raises(RankFailedError, match=r"rank 1 \(pid \d+\) exited with code -9"):
            gen.generate("a red square", **CFG, **BASE)
        with pytest.raises(RankFailedError, match="cannot run requests any more"):
            gen.generate("a red square", **CFG, **BASE)
        assert time.monotonic() - start < 30  # not a collective's timeout (600 s)


_KILLED_PARENT = """
import sys, torch
torch.set_num_threads(1)
from diffserve.api import DiffGenerator
if __name__ == "__main__":
    gen = DiffGenerator.from_pretrained(sys.argv[1], show_progress=False, num_gpus=2)
    print(*[p.pid for p, _ in gen.ranks.processes], flush=True)
    sys.stdin.read()  # until killed
"""


def test_workers_exit_when_their_parent_is_killed(tiny_flux_dir, tmp_path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(_KILLED_PARENT)
    parent = subprocess.Popen(
        [sys.executable, str(script), str(tiny_flux_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert parent.stdout is not None
        pids = [int(pid) for pid in parent.stdout.readline().split()]
        assert len(pids) == 1 and psutil.pid_exists(pids[0])
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        gone, alive = psutil.wait_procs(
            [psutil.Process(pid) for pid in pids if psutil.pid_exists(pid)], timeout=10
        )
        assert not alive, f"worker(s) {[p.pid for p in alive]} outlived their killed parent"
    finally:
        if parent.poll() is None:
            parent.kill()


def test_cfg_parallel_times_ulysses_on_four_ranks_matches_one_rank(tiny_flux_dir, reference) -> None:
    """CFG 2 x Ulysses 2: each CFG branch's sequence split over two ranks, on a non-square size."""
    with DiffGenerator.from_pretrained(
        tiny_flux_dir, show_progress=False, num_gpus=4, enable_cfg_parallel=True, ulysses_degree=2
    ) as gen:
        state = gen.ranks.state
        assert (state.cfg_degree, state.ulysses_degree, state.ring_degree) == (2, 2, 1)
        mixed = [pixels(out) for out in gen.generate_many(mixed_batch())]
    assert np.abs(mixed[0] - reference["mixed_cfg"]).max() <= 1
    assert np.abs(mixed[1] - reference["mixed_plain"]).max() <= 1


def test_ring_two_ranks_matches_one_rank_on_a_non_square_size(tiny_flux_dir) -> None:
    params = SamplingParams(prompt="a red square", **{**BASE, "height": 48, "width": 80}, **CFG)
    one = pixels(
        DiffGenerator.from_pretrained(tiny_flux_dir, show_progress=False).generate_from_params(params)
    )
    with DiffGenerator.from_pretrained(tiny_flux_dir, show_progress=False, num_gpus=2, ring_degree=2) as gen:
        assert gen.ranks.state.ring_degree == 2
        two = pixels(gen.generate_from_params(params))
    assert np.abs(two - one).max() <= 1
