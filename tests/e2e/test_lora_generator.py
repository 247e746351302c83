"""LoRA through `DiffGenerator` on a tiny FLUX: per-request adapters change the image, a request without
adapters is the base model bit for bit (before and after LoRA requests), requests with different
adapter sets share DiT batches and each equals its own run (called from threads, and with a step-cache
tier), merging gives the unmerged result, and bad adapters are clear errors that harm nothing."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import save_file

from diffserve import DiffGenerator, SamplingParams
from diffserve.configs.sampling_params import LoraChoice
from diffserve.errors import InvalidRequestError, LoraError
from diffserve.testing.image_metrics import psnr_uint8 as psnr
from diffserve.testing.tiny_lora import write_random_lora

STEPS = 3
BASE = {"height": 64, "width": 64, "num_inference_steps": STEPS, "guidance_scale": 3.5, "seed": 7}


@pytest.fixture(scope="module")
def lora_dir(tiny_flux_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("loras")
    write_random_lora(tiny_flux_dir, directory / "style.safetensors", rank=4, alpha=8.0, seed=1, std=0.08)
    write_random_lora(tiny_flux_dir, directory / "detail.safetensors", rank=2, seed=2, std=0.08)
    return directory


@pytest.fixture(scope="module")
def gen(tiny_flux_dir: Path, lora_dir: Path):
    generator = DiffGenerator.from_pretrained(
        tiny_flux_dir, device="cpu", show_progress=False, lora_dir=lora_dir, batch_policy="throughput"
    )
    base_before_any_lora = _pixels(generator.generate("a red fox", **BASE))
    generator.load_lora("style", lora_dir / "style.safetensors")
    generator.load_lora("detail", lora_dir / "detail.safetensors")
    yield generator, base_before_any_lora
    generator.close()


def _pixels(output) -> np.ndarray:
    return np.asarray(output.images[0], dtype=np.int16)


def _run(generator: DiffGenerator, loras: list[dict], prompt: str = "a red fox", **extra) -> np.ndarray:
    return _pixels(generator.generate(prompt, **{**BASE, **extra}, loras=loras))


def test_loras_change_the_image_and_no_lora_is_the_base_bit_for_bit(gen) -> None:
    generator, base = gen
    styled = _run(generator, [{"name": "style", "scale": 1.0}])
    assert np.abs(styled - base).max() > 10, "the adapter should visibly change the image"
    half = _run(generator, [{"name": "style", "scale": 0.5}])
    assert 0 < np.abs(half - base).mean() < np.abs(styled - base).mean()  # the scale scales the change
    assert np.array_equal(_run(generator, []), base)  # after LoRA requests, the base is untouched
    assert np.array_equal(_run(generator, [{"name": "style", "scale": 0.0}]), base)


def test_mixed_adapter_sets_share_a_batch_and_each_equals_its_own_run(gen) -> None:
    generator, base = gen
    sets = [
        [{"name": "style", "scale": 0.8}],
        [{"name": "style", "scale": 0.8}, {"name": "detail", "scale": -0.6}],
        [],
    ]
    prompts = ["a red fox", "a blue bird", "a green tree"]
    alone = [_run(generator, loras, prompt) for loras, prompt in zip(sets, prompts, strict=True)]
    results: list[np.ndarray | None] = [None] * 3
    barrier = threading.Barrier(3)

    def worker(i: int) -> None:
        barrier.wait()
        results[i] = _run(generator, sets[i], prompts[i])

    counts = generator.engine.scheduler.batch_size_counts
    shared_before = sum(n for size, n in counts.items() if size >= 2)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    shared = sum(n for size, n in counts.items() if size >= 2) - shared_before
    assert shared >= 1, "the three requests should have shared DiT batches"
    for together, solo in zip(results, alone, strict=True):
        assert np.abs(together - solo).max() <= 1  # a batched matmul may round a pixel the other way


def test_rows_without_adapters_are_untouched_by_the_adapters_in_their_batch(gen) -> None:
    """The request without `loras` runs the base weights: in a batch with LoRA rows it is bit-identical to
    the same batch with no adapter at all (the adapters never touch its rows)."""
    generator, _ = gen
    prompts = ["a red fox", "a blue bird", "a green tree"]
    with_adapters = [[LoraChoice("style", 0.8)], [LoraChoice("style", 0.8), LoraChoice("detail", -0.6)], []]
    mixed = generator.generate_many(
        [
            SamplingParams(prompt=p, loras=loras, **BASE)
            for p, loras in zip(prompts, with_adapters, strict=True)
        ]
    )
    plain = generator.generate_many([SamplingParams(prompt=p, **BASE) for p in prompts])
    assert np.array_equal(_pixels(mixed[2]), _pixels(plain[2]))
    assert np.abs(_pixels(mixed[0]) - _pixels(plain[0])).max() > 10  # the adapters did apply to their rows


def test_step_cache_tier_keeps_each_rows_adapters(gen) -> None:
    generator, _ = gen
    params = [
        SamplingParams(
            prompt="a red fox",
            quality="low",
            loras=[LoraChoice("style", 0.7)],
            **{**BASE, "num_inference_steps": 6},
        ),
        SamplingParams(prompt="a blue bird", quality="low", **{**BASE, "num_inference_steps": 6}),
    ]
    together = [_pixels(out) for out in generator.generate_many(params)]
    alone = [_pixels(generator.generate_many([p])[0]) for p in params]
    for a, b in zip(together, alone, strict=True):
        assert psnr(a.astype(np.uint8), b.astype(np.uint8)) >= 45


def test_adapter_named_by_file_in_lora_dir_loads_on_demand(gen, lora_dir: Path, tiny_flux_dir: Path) -> None:
    generator, base = gen
    write_random_lora(tiny_flux_dir, lora_dir / "ondemand.safetensors", rank=2, seed=5, std=0.08)
    out = _run(generator, [{"name": "ondemand"}])
    assert np.abs(out - base).max() > 0
    assert "ondemand" in [info.name for info in generator.loras()]


def test_bad_adapters_are_clear_errors(gen, tmp_path: Path) -> None:
    generator, base = gen
    with pytest.raises(InvalidRequestError, match="unknown LoRA 'nope'"):
        generator.generate("x", **BASE, loras=[{"name": "nope"}])
    with pytest.raises(InvalidRequestError, match="not valid"):
        generator.generate("x", **BASE, loras=[{"name": "../style"}])
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(LoraError, match="corrupt.safetensors"):
        generator.load_lora("corrupt", corrupt)
    import torch

    foreign = tmp_path / "sd3.safetensors"
    save_file(
        {
            "transformer.joint_blocks.0.x_block.attn.qkv.lora_A.weight": torch.zeros(2, 8),
            "transformer.joint_blocks.0.x_block.attn.qkv.lora_B.weight": torch.zeros(8, 2),
        },
        str(foreign),
    )
    with pytest.raises(LoraError, match="flux"):
        generator.load_lora("foreign", foreign)
    assert "corrupt" not in [i.name for i in generator.loras()]
    assert np.array_equal(_run(generator, []), base)  # nothing else affected


def test_unloading_an_adapter_in_use_is_refused(gen, lora_dir: Path) -> None:
    generator, _ = gen
    generator.load_lora("busy", lora_dir / "style.safetensors")
    registry = generator.engine.runner.loras
    pinned = registry.acquire([LoraChoice("busy")])  # as a running request holds it
    with pytest.raises(LoraError, match=r"used by 1 request \(1 running, 0 queued\)"):
        generator.unload_lora("busy")
    registry.release(pinned)
    generator.unload_lora("busy")
    assert "busy" not in [info.name for info in generator.loras()]


def test_merged_adapter_equals_the_unmerged_one(gen, tiny_flux_dir: Path, lora_dir: Path) -> None:
    generator, _ = gen
    unmerged = _run(generator, [{"name": "style", "scale": 1.0}])
    with DiffGenerator.from_pretrained(
        tiny_flux_dir, device="cpu", show_progress=False,
        loras={"style": lora_dir / "style.safetensors"}, lora_merge=True,
    ) as merged_gen:  # fmt: skip
        merged = _pixels(merged_gen.generate("a red fox", **BASE))
        with pytest.raises(InvalidRequestError, match="merged"):
            merged_gen.generate("a red fox", **BASE, loras=[{"name": "style"}])
    assert psnr(merged.astype(np.uint8), unmerged.astype(np.uint8)) >= 40
