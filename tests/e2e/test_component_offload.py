"""Component CPU offload end to end, on a platform that counts what is on its "device"
(`testing/counting_platform.py`): tiny FLUX (two text encoders) and tiny Wan 2.1 image-to-video (UMT5,
a CLIP image encoder, a VAE that also encodes).

With each `--*-cpu-offload` flag the outputs are identical (np.array_equal) to a run without offload;
every module that runs finds its own weights on the device; while a component runs, the device holds
exactly the resident weights plus that component (so the others' bytes are gone: the drop), and the peak
is the resident weights plus the largest offloaded component. `--offload auto` on a small device picks
the offloads the plan's rule gives; requests joining a step batch mid-way, and `--compile`, are covered."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from cli_request_args import request_args
from PIL import Image
from torch import nn

import diffserve.api as api
from diffserve import DiffGenerator, SamplingParams
from diffserve.errors import UserError
from diffserve.families.qwen_image.tiny import build_tiny_qwen_image
from diffserve.families.wan.tiny import TinyWanSpec, build_tiny_wan
from diffserve.offload import offload_group, weight_residency
from diffserve.offload.components import OffloadGroup
from diffserve.request import Req
from diffserve.runtime.memory import estimated_memory_model
from diffserve.testing.counting_platform import CountingPlatform
from diffserve.testing.parity import denoise_joining, stack_uint8

FLUX_PARAMS = dict(
    height=32,
    width=48,
    num_inference_steps=2,
    max_sequence_length=16,
    true_cfg_scale=2.0,
    negative_prompt="ugly",
)
WAN_PARAMS = dict(height=32, width=32, num_frames=5, num_inference_steps=2, max_sequence_length=16)
FLAGS = {
    "text_encoder": {"text_encoder_cpu_offload": True},
    "image_encoder": {"image_encoder_cpu_offload": True},
    "vae": {"vae_cpu_offload": True},
    "dit": {"dit_cpu_offload": True},
    "all": {
        "text_encoder_cpu_offload": True,
        "image_encoder_cpu_offload": True,
        "vae_cpu_offload": True,
        "dit_cpu_offload": True,
    },
}
COMPONENT_FLAGS = {
    "text_encoder": "text_encoder_cpu_offload",
    "text_encoder_2": "text_encoder_cpu_offload",
    "image_encoder": "image_encoder_cpu_offload",
    "vae": "vae_cpu_offload",
    "transformer": "dit_cpu_offload",
    "transformer_2": "dit_cpu_offload",  # Wan 2.2 A14B's low-noise expert
}


@contextmanager
def on_platform(platform: CountingPlatform) -> Iterator[None]:
    """DiffGenerator resolves its platform by name: hand it the counting one."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(api, "resolve_platform", lambda name: platform)
        yield


def modules_of(gen: DiffGenerator) -> dict[str, nn.Module]:
    components = gen.pipeline.context.components
    return {n: c.value for n, c in components.items() if isinstance(c.value, nn.Module)}


def nbytes(module: nn.Module) -> int:
    return sum(
        t.numel() * t.element_size()
        for t in {id(t): t for t in [*module.parameters(), *module.buffers()]}.values()
    )


class Probe:
    """Test-side forward pre-hooks (registered after the offload's, so they run after its moves) on every
    module that owns tensors: each call records the device bytes and whether its own tensors are there."""

    def __init__(self, gen: DiffGenerator, platform: CountingPlatform) -> None:
        self.platform = platform
        self.live: dict[str, set[int]] = {}
        self.misplaced: list[str] = []
        for name, module in modules_of(gen).items():
            for sub_name, sub in module.named_modules():
                if next(iter([*sub._parameters.values(), *sub._buffers.values()]), None) is not None:
                    sub.register_forward_pre_hook(self._hook(name, sub_name))

    def _hook(self, component: str, where: str):
        def hook(module: nn.Module, args: tuple) -> None:
            self.live.setdefault(component, set()).add(self.platform.live_bytes)
            tensors = [t for t in [*module._parameters.values(), *module._buffers.values()] if t is not None]
            if not all(self.platform.is_on_device(t) for t in tensors):
                self.misplaced.append(f"{component}.{where}")

        return hook


def counting_generator(root, **flags) -> tuple[DiffGenerator, CountingPlatform, dict[str, int]]:
    """A generator on a fresh counting platform; the resident components (loaded straight onto the
    "device") adopted into its count. Also returns every component's bytes."""
    platform = CountingPlatform()
    with on_platform(platform):
        gen = DiffGenerator.from_pretrained(root, device="cpu", show_progress=False, **flags)
    sizes = {name: nbytes(module) for name, module in modules_of(gen).items()}
    for name, module in modules_of(gen).items():
        if not flags.get(COMPONENT_FLAGS.get(name, ""), False):
            platform.adopt([*module.parameters(), *module.buffers()])
    return gen, platform, sizes


def pixels(out) -> np.ndarray:
    return np.stack(out.frames) if out.frames else np.stack([np.asarray(im) for im in out.images])


def check_residency(gen, platform, sizes, probe, offloaded: set[str]) -> None:
    """While each component ran, the device held the resident weights plus that component alone."""
    resident = sum(size for name, size in sizes.items() if name not in offloaded)
    assert not probe.misplaced, f"modules ran with weights off the device: {probe.misplaced[:5]}"
    for name, seen in probe.live.items():
        expected = resident + (sizes[name] if name in offloaded else 0)
        assert seen == {expected}, f"{name}: device held {seen}, expected {expected} (resident {resident})"
    peak = platform.memory_info().peak_bytes
    expected_peak = resident + max((sizes[n] for n in offloaded), default=0)
    print(
        f"offloaded {sorted(offloaded)}: peak device weights {peak} B (all resident: {sum(sizes.values())} B), "
        f"while the DiT runs {min(probe.live['transformer'])} B"
    )
    assert peak == expected_peak
    group = offload_group(gen.pipeline.context.components)
    assert isinstance(group, OffloadGroup)
    residency = weight_residency(gen.pipeline.context.components)
    assert residency.resident_bytes == resident
    assert residency.swap_bytes == max(sizes[n] for n in offloaded)
    assert platform.live_bytes == residency.resident_bytes + residency.moved_in_bytes


# -- FLUX ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def flux_reference(tiny_flux_dir):
    gen = DiffGenerator.from_pretrained(tiny_flux_dir, device="cpu", show_progress=False)
    return pixels(gen.generate(prompt="a red fox", seed=5, **FLUX_PARAMS))


FLUX_OFFLOADED = {
    "text_encoder": {"text_encoder", "text_encoder_2"},
    "vae": {"vae"},
    "dit": {"transformer"},
    "all": {"text_encoder", "text_encoder_2", "vae", "transformer"},
}


@pytest.mark.parametrize("which", sorted(FLUX_OFFLOADED))
def test_flux_offload_is_exact_and_moves_only_for_the_stage(tiny_flux_dir, flux_reference, which) -> None:
    gen, platform, sizes = counting_generator(tiny_flux_dir, **FLAGS[which])
    probe = Probe(gen, platform)
    platform.reset_peak_memory()
    out = pixels(gen.generate(prompt="a red fox", seed=5, **FLUX_PARAMS))
    assert np.array_equal(out, flux_reference)
    check_residency(gen, platform, sizes, probe, FLUX_OFFLOADED[which])
    again = pixels(gen.generate(prompt="a red fox", seed=5, **FLUX_PARAMS))  # after the moves
    assert np.array_equal(again, flux_reference)


# -- Wan 2.1 image-to-video ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wan_i2v(tmp_path_factory):
    root = build_tiny_wan(tmp_path_factory.mktemp("wan-i2v"), TinyWanSpec(image_to_video=True))
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 40, 3), dtype=np.uint8))
    gen = DiffGenerator.from_pretrained(root, device="cpu", show_progress=False)
    return root, image, pixels(gen.generate(prompt="a red fox", seed=5, image=image, **WAN_PARAMS))


WAN_OFFLOADED = {
    "text_encoder": {"text_encoder"},
    "image_encoder": {"image_encoder"},
    "vae": {"vae"},
    "dit": {"transformer"},
    "all": {"text_encoder", "image_encoder", "vae", "transformer"},
}


@pytest.mark.parametrize("which", ["image_encoder", "text_encoder", "vae", "all"])
def test_wan_i2v_offload_is_exact_and_moves_only_for_the_stage(wan_i2v, which) -> None:
    root, image, reference = wan_i2v
    gen, platform, sizes = counting_generator(root, **FLAGS[which])
    probe = Probe(gen, platform)
    platform.reset_peak_memory()
    out = pixels(gen.generate(prompt="a red fox", seed=5, image=image, **WAN_PARAMS))
    assert np.array_equal(out, reference)
    check_residency(gen, platform, sizes, probe, WAN_OFFLOADED[which])


# -- Qwen-Image: the text encoder runs through a child (`text_encoder.model(...)`), not its forward -----------


def test_qwen_image_text_encoder_offload_is_exact(tmp_path) -> None:
    root = build_tiny_qwen_image(tmp_path / "qwen")
    params = dict(height=32, width=32, num_inference_steps=2, true_cfg_scale=2.0, negative_prompt="blurry")
    plain = DiffGenerator.from_pretrained(root, device="cpu", show_progress=False)
    reference = pixels(plain.generate(prompt="a red fox", seed=5, **params))
    gen, platform, sizes = counting_generator(root, text_encoder_cpu_offload=True)
    probe = Probe(gen, platform)
    platform.reset_peak_memory()
    assert np.array_equal(pixels(gen.generate(prompt="a red fox", seed=5, **params)), reference)
    check_residency(gen, platform, sizes, probe, {"text_encoder"})


def test_layerwise_dit_with_offloaded_encoders_is_exact(tiny_flux_dir, flux_reference) -> None:
    """`offload/layerwise.py` streams the DiT's blocks; the encoders' offload hooks evict T5 and CLIP
    when the (layerwise) DiT starts. On a CPU device the blocks are not copied, so only the encoders count."""
    gen = DiffGenerator.from_pretrained(
        tiny_flux_dir,
        device="cpu",
        show_progress=False,
        dit_layerwise_offload=True,
        text_encoder_cpu_offload=True,
    )
    assert np.array_equal(pixels(gen.generate(prompt="a red fox", seed=5, **FLUX_PARAMS)), flux_reference)
    group = offload_group(gen.pipeline.context.components)
    assert group is not None and set(group.layerwise) == {"transformer"}
    assert not group.components["text_encoder_2"].on_device  # evicted when the DiT ran
    residency = weight_residency(gen.pipeline.context.components)
    assert residency.swap_bytes >= group.components["text_encoder"].nbytes


# -- the automatic plan, the memory model, the log -----------------------------------------------------------


def test_offload_auto_on_a_small_device_offloads_the_vae_and_the_dit(
    tiny_flux_dir, flux_reference, caplog
) -> None:
    """Tiny FLUX's weights (fp32): VAE 1,307,980 B, DiT 389,632, CLIP 144,872, T5 107,648. On a 1.9 MB
    device (15% = 285,000 B kept for activations) nothing fits with the VAE and the DiT both resident
    (1,982,612 B for either's stage), so the plan offloads both; the text encoders, offloaded first, come
    back once the DiT is out (the VAE's stage then needs 1,845,500 B)."""
    platform = CountingPlatform(capacity_bytes=1_900_000)
    with caplog.at_level(logging.INFO, logger="diffserve.offload"), on_platform(platform):
        gen = DiffGenerator.from_pretrained(tiny_flux_dir, device="cpu", show_progress=False, offload="auto")
    # No admission on this simulated 1.9 MB device: the estimated model's 64 MB a request is for real models.
    gen.engine.memory = None
    group = offload_group(gen.pipeline.context.components)
    assert group is not None
    placements = {name: c.placement for name, c in group.components.items()}
    assert placements == {
        "text_encoder": "resident",
        "text_encoder_2": "resident",
        "vae": "offload",
        "transformer": "offload",
    }
    log = caplog.text
    print("\n".join(line for line in log.splitlines() if "Memory plan" in line or "resident" in line))
    assert "Memory plan (--offload auto): device free 1.81 MiB, 278.3 KiB kept for activations" in log
    assert (
        "Memory plan: vae -> CPU offload" in log and "--offload auto (used once or twice per request)" in log
    )
    assert "Components that stay resident: ['text_encoder', 'text_encoder_2']" in log
    for name, module in modules_of(gen).items():
        if placements[name] == "resident":
            platform.adopt([*module.parameters(), *module.buffers()])
    platform.reset_peak_memory()
    out = pixels(gen.generate(prompt="a red fox", seed=5, **FLUX_PARAMS))
    assert np.array_equal(out, flux_reference)
    assert platform.memory_info().peak_bytes <= 1_900_000 - 285_000
    # Admission: the budget counts free memory as if the offloaded were out; a request counts the swap once.
    weights = weight_residency(gen.pipeline.context.components)
    model = estimated_memory_model(gen.pipeline.facts, platform, 1.0, weights)
    assert model.budget_bytes == platform.memory_info().available_bytes + weights.moved_in_bytes
    assert weights.swap_bytes == 1_307_980 and weights.moved_in_bytes == 1_307_980  # the VAE decoded last
    cost = gen.engine.prepare(Req(params=SamplingParams("x", **FLUX_PARAMS))).cost
    assert model.total([cost, cost]) == 2 * model.denoise_bytes(cost) + model.decode_bytes(cost) + 1_307_980


def test_cli_logs_the_plan_and_the_components_that_can_stay_resident(tiny_flux_dir, tmp_path, caplog) -> None:
    from diffserve.cli.main import main

    args = ["generate", "--model-path", str(tiny_flux_dir), *request_args("a fox", steps=1)]
    args += [
        "--text-encoder-cpu-offload",
        "--no-save-output",
        "--device",
        "cpu",
    ]
    # The CLI's logging setup replaces the root logger's handlers (caplog's among them): listen on ours.
    logger = logging.getLogger("diffserve")
    logger.addHandler(caplog.handler)
    try:
        assert main(args) == 0
    finally:
        logger.removeHandler(caplog.handler)
    lines = [r.getMessage() for r in caplog.records]
    plan = [line for line in lines if line.startswith("Memory plan") or line.startswith("Components that")]
    end = [line for line in lines if "Components that can stay resident" in line]
    print("\n".join([*plan, *end]))
    assert any(line.startswith("Memory plan: text_encoder -> CPU offload") for line in plan)
    assert "Components that stay resident: ['vae', 'transformer']" in plan
    # On the CPU the "device" is the host: its free memory at peak holds both small encoders.
    assert len(end) == 1 and end[0].endswith(
        "Components that can stay resident: ['text_encoder', 'text_encoder_2']"
    )


# -- Ctrl: step batching, compile -------------------------------------------------------------------------


def run_batched(gen: DiffGenerator, params: list[SamplingParams], join_after: list[int]) -> list[np.ndarray]:
    """Request i joins once `join_after[i]` batched steps have run (its text encoding between steps)."""
    done = denoise_joining(gen.pipeline, params, join_after)
    return [stack_uint8(done[p.prompt].outputs.images) for p in params]


def test_requests_joining_a_step_batch_with_everything_offloaded(tiny_flux_dir) -> None:
    params = [
        SamplingParams(
            prompt=p, seed=3 + i, height=32, width=32, num_inference_steps=3, max_sequence_length=16
        )
        for i, p in enumerate(["a fox", "a bird", "a tree"])
    ]
    plain = DiffGenerator.from_pretrained(tiny_flux_dir, device="cpu", show_progress=False)
    expected = run_batched(plain, params, [0, 1, 2])
    gen, platform, _ = counting_generator(tiny_flux_dir, **FLAGS["all"])
    got = run_batched(gen, params, [0, 1, 2])
    for a, b in zip(got, expected, strict=True):
        assert np.array_equal(a, b)
    group = offload_group(gen.pipeline.context.components)
    assert group is not None
    # The joining requests' encoders (and the finished ones' decodes) evicted the DiT between steps.
    print({name: c.moves_in for name, c in group.components.items()})
    assert group.components["transformer"].moves_in >= 3
    # Every byte that moved went through the platform (its own count, not the group's).
    assert platform.bytes_to_device == sum(c.moves_in * c.nbytes for c in group.components.values())


def test_compile_is_refused_with_the_dit_offloaded(tiny_flux_dir) -> None:
    with pytest.raises(UserError, match="--compile does not work with the DiT offloaded"):
        DiffGenerator.from_pretrained(tiny_flux_dir, device="cpu", compile=True, dit_cpu_offload=True)


def test_compile_works_with_the_encoders_and_vae_offloaded(
    tiny_flux_dir, flux_reference, monkeypatch
) -> None:
    """The offload hooks stay outside the compiled blocks (the DiT is resident: hooks on its root and
    direct children only). The eager backend keeps the test fast: dynamo still traces the blocks."""
    monkeypatch.setattr("diffserve.runtime.compile.BACKEND", "eager")
    gen, _, _ = counting_generator(
        tiny_flux_dir, compile=True, text_encoder_cpu_offload=True, vae_cpu_offload=True
    )
    assert gen.compiled_regions
    out = pixels(gen.generate(prompt="a red fox", seed=5, **FLUX_PARAMS))
    torch._dynamo.reset()
    print(f"compiled (eager backend) vs reference: max diff {np.abs(out.astype(int) - flux_reference).max()}")
    assert np.array_equal(out, flux_reference)


# -- Wan 2.2 A14B: two experts, only the one in use on the device ----------------------------------------


def test_wan22_a14b_dit_offload_keeps_one_expert_on_the_device(tmp_path) -> None:
    root = build_tiny_wan(tmp_path / "a14b", TinyWanSpec(variant="2.2-a14b"))
    params = {**WAN_PARAMS, "num_inference_steps": 4, "guidance_scale_2": 3.0}  # both experts run
    reference = pixels(
        DiffGenerator.from_pretrained(root, device="cpu", show_progress=False).generate(
            prompt="a red fox", seed=5, **params
        )
    )
    gen, platform, sizes = counting_generator(root, **FLAGS["dit"])
    probe = Probe(gen, platform)
    platform.reset_peak_memory()
    out = pixels(gen.generate(prompt="a red fox", seed=5, **params))
    assert np.array_equal(out, reference)
    assert {"transformer", "transformer_2"} <= set(probe.live), "both experts should have run"
    check_residency(gen, platform, sizes, probe, {"transformer", "transformer_2"})
