"""`DiffGenerator` and `diffserve generate` admit requests by the runtime's memory model, as the server does
(issue 30): on a memory budget a request that can never fit is refused with the server's 413 message, and
a decode that would not fit untiled is tiled, to the pixels `vae_tiling=True` makes (tiny FLUX on the CPU).

The budget is set on the generator's model, as tests/e2e/test_video_admission_cpu.py does (the free memory
it is measured from varies from machine to machine); the CLI's comes from the platform's free memory."""

from __future__ import annotations

import logging
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from diffserve import DiffGenerator
from diffserve.cli.main import EXIT_USER_ERROR, main
from diffserve.configs.engine_args import EngineArgs
from diffserve.configs.sampling_params import SamplingParams
from diffserve.platforms.base import MemoryInfo
from diffserve.platforms.cpu import CpuPlatform
from diffserve.request import Req
from diffserve.runtime import EngineEvents, MemoryModel, RequestCost, RequestTooLargeError
from diffserve.server.engine_process import EngineProcess, EngineProcessConfig
from diffserve.server.protocol import GenerateJob, JobRejected

PROMPT = "a red fox in the snow"
#: The tiny FLUX VAE's tiles are 64 pixels (its sample_size): a 128x128 image is decoded in several.
TILED_SIDE = 128


def params(side: int) -> SamplingParams:
    return SamplingParams(PROMPT, height=side, width=side, num_inference_steps=2, seed=7)


def cost_of(generator: DiffGenerator, side: int) -> RequestCost:
    """What the engine charges a `side` x `side` request (validated as `prepare` validates it)."""
    return generator.engine.cost(generator.engine.runner.validate(Req(params=params(side))))


@pytest.fixture(scope="module")
def generator(tiny_flux_dir) -> DiffGenerator:
    return DiffGenerator.from_pretrained(tiny_flux_dir, device="cpu", show_progress=False)


@pytest.fixture
def budget(generator: DiffGenerator):
    """Sets the budget of the generator's memory model (bytes); the model it had is put back after."""
    model = generator.engine.memory
    assert model is not None

    def set_budget(budget_bytes: float) -> MemoryModel:
        generator.engine.memory = replace(model, budget_bytes=int(budget_bytes))
        return generator.engine.memory

    yield set_budget
    generator.engine.memory = model


def test_the_generator_has_the_servers_memory_model(generator: DiffGenerator) -> None:
    """Built at load (estimated: the server calibrates at its warm-up), automatic VAE tiling on."""
    model = generator.engine.memory
    assert model is not None and model.source == "estimated"
    assert model.budget_bytes is not None and model.budget_bytes > 0
    assert model.vae_tiling_mode == "auto" and model.lora_reserved_bytes == 0


def test_a_request_that_can_never_fit_is_refused_with_the_servers_message(
    generator: DiffGenerator, budget, tmp_path
) -> None:
    model = generator.engine.memory
    budget(model.estimate(cost_of(generator, 64)))  # a 64x64 image fits, nothing larger
    with pytest.raises(RequestTooLargeError) as refused:
        generator.generate_from_params(params(256))
    message = str(refused.value)
    print(message)
    assert "but the engine's memory budget is" in message
    assert "to fit, reduce size (width x height) to at most 64x64" in message

    # The server's engine process over the same engine answers the same request 413, in the same words.
    sent: list = []
    config = EngineProcessConfig(
        EngineArgs(model_path=str(generator.model_path), output_path=str(tmp_path)), "", "", 1
    )
    server = EngineProcess(config, SimpleNamespace(send=sent.append), generator=generator)
    try:
        server._handle(GenerateJob("r" * 32, params(256)))
    finally:  # the generator's engine reports to nobody again
        server.loras.close()
        server.encoder.shutdown(wait=True)
        generator.engine.events, generator.engine.request_log = EngineEvents(), None
    [rejected] = sent
    assert isinstance(rejected, JobRejected) and rejected.status == 413 and rejected.param == "size"
    assert rejected.message == message
    assert generator.engine.scheduler.num_waiting == 0


def test_a_decode_that_would_not_fit_untiled_is_tiled_as_vae_tiling_does(
    generator: DiffGenerator, budget, tiled_decodes, tiny_flux_dir, caplog
) -> None:
    model = generator.engine.memory
    cost = cost_of(generator, TILED_SIDE)
    # The request's peak with its decode untiled and tiled (nothing else runs).
    untiled = model.denoise_bytes(cost) + model.decode_bytes(cost, False) + model.weights.swap_bytes
    tiled = model.denoise_bytes(cost) + model.decode_bytes(cost, True) + model.weights.swap_bytes
    assert tiled < untiled

    budget(untiled + 1)  # the untiled decode fits: it runs untiled
    whole = generator.generate_from_params(params(TILED_SIDE))
    assert tiled_decodes == []

    budget((tiled + untiled) / 2)  # only the tiled decode fits: admitted, and decoded in tiles
    with caplog.at_level(logging.INFO, logger="diffserve"):
        automatic = generator.generate_from_params(params(TILED_SIDE))
    assert tiled_decodes == [(1, 16, TILED_SIDE // 8, TILED_SIDE // 8)], tiled_decodes
    assert "VAE decode tiled (untiled, it would not fit in memory)" in caplog.text

    with DiffGenerator.from_pretrained(
        tiny_flux_dir, device="cpu", show_progress=False, vae_tiling=True
    ) as forced:
        assert forced.engine.memory is not None and forced.engine.memory.vae_tiling_mode == "on"
        expected = forced.generate_from_params(params(TILED_SIDE))
    got, want = np.asarray(automatic.images[0]), np.asarray(expected.images[0])
    assert np.array_equal(got, want), f"max |diff| {np.abs(got.astype(int) - want.astype(int)).max()}"
    diff = np.abs(np.asarray(whole.images[0]).astype(int) - got.astype(int)).max()
    print(f"tiled vs untiled decode: max |diff| {diff} (tile seams)")
    assert diff > 0, "the tiled decode blends its seams: it cannot equal the untiled one"


def test_the_cli_refuses_a_request_that_can_never_fit(tiny_flux_dir, tmp_path, monkeypatch, capsys) -> None:
    """`diffserve generate` builds the same model: on a machine with 64 MiB free, a 1024x1024 image is
    refused before any model work, exit code 2 and the server's message."""
    real = CpuPlatform.memory_info

    def little_free(self: CpuPlatform, index: int | None = None) -> MemoryInfo:
        return replace(real(self, index), available_bytes=64 * 2**20)

    monkeypatch.setattr(CpuPlatform, "memory_info", little_free)
    args = ["generate", "--model-path", str(tiny_flux_dir), "--device", "cpu", "--prompt", PROMPT,
            "--height", "1024", "--width", "1024", "--num-inference-steps", "1", "--seed", "1",
            "--output-path", str(tmp_path / "out")]  # fmt: skip
    assert main(args) == EXIT_USER_ERROR
    error = capsys.readouterr().err
    assert (
        "error: this request needs an estimated" in error
        and "but the engine's memory budget is 58 MB" in error
    )
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_the_budget_keeps_the_lora_reserve(tiny_flux_dir, tmp_path) -> None:
    """With a `lora_dir`, adapters may load later: `max_lora_memory` is kept out of the budget, as the
    server's /server_info shows it (`lora_reserved_mb`)."""
    with DiffGenerator.from_pretrained(
        tiny_flux_dir, device="cpu", show_progress=False, lora_dir=tmp_path, max_lora_memory=64 * 2**20
    ) as generator:
        model = generator.engine.memory
        assert model is not None and model.lora_reserved_bytes == 64 * 2**20
        assert model.describe()["lora_reserved_mb"] == 64.0
