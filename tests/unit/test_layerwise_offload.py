"""Layerwise DiT offload (`offload/layerwise.py`) on the CPU, with a platform that counts its "device" memory,
and the memory-mapped DiT weights it streams under `--max-memory` (`loader/mmap_weights.py`).

For FLUX, Wan and Z-Image (whose refiners run in another order than they are declared): the generated
pixels with the offload are identical to those without it, and the DiT's tensors materialized at any
module call never exceed the non-block weights plus two blocks. That bound is measured apart from the
offload's own bookkeeping, twice: by a probe hooked on every module of the DiT, summing the bytes of the
DiT's tensors that are not `meta` placeholders, and by `CountingPlatform`, which counts the storages it
copied to its "device" while they live. Also: the block prefetch is right after the first forward,
the step cache's out-of-block calls work, `remove()` restores the model, misuse is refused, and, with
stand-in streams (the CPU has none), the accelerator path orders its copies, waits and host syncs.
Memory-mapped: the generator under a tiny `max_memory` gives the same pixels (Wan, Z-Image; FLUX, which
then runs unfused, at the DiT level: the same output as the unfused normal load, in float32 and cast to
bfloat16, streamed in place or copied to a counted device); mismatched checkpoints are refused.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from diffserve import DiffGenerator
from diffserve.errors import ModelLoadError, UserError
from diffserve.families.flux.tiny import TinyFluxSpec, build_tiny_flux, flux_dit_inputs
from diffserve.families.wan.tiny import TinyWanSpec, build_tiny_wan
from diffserve.families.z_image.tiny import TinyZImageSpec, build_tiny_zimage
from diffserve.loader.mmap_weights import load_mmapped_into, mapped_tensors
from diffserve.loader.safetensors_weights import load_safetensors_into
from diffserve.models.dits.flux import FluxTransformer2DModel
from diffserve.offload.layerwise import install_layerwise_offload, layerwise_offload_of
from diffserve.platforms.base import Platform
from diffserve.platforms.cpu import CpuPlatform
from diffserve.testing.counting_platform import CountingPlatform
from diffserve.testing.tiny_writing import save_diffusers_model

#: The DiTs' block lists and a tensor of one of their blocks' submodules, by state-dict name (written
#: out here, not taken from the offload, so that the bound below does not rest on the code it checks).
#: A tensor a block registers itself (Wan's `blocks.N.scale_shift_table`) stays resident: non-block.
BLOCK_LISTS = r"(transformer_blocks|single_transformer_blocks|blocks|layers|noise_refiner|context_refiner)"
BLOCK_NAME = re.compile(BLOCK_LISTS + r"\.\d+")
BLOCK_KEY = re.compile(BLOCK_LISTS + r"\.\d+\.(?=[^.]+\.)")


@dataclass
class Family:
    name: str
    build: Callable[[Path], Path]
    kwargs: dict
    frames: bool = False


FAMILIES = [
    Family(
        "flux",
        lambda d: build_tiny_flux(d, TinyFluxSpec(num_layers=2, num_single_layers=3)),
        dict(height=64, width=64, num_inference_steps=3),
    ),
    Family(
        "wan",
        lambda d: build_tiny_wan(d, TinyWanSpec(num_layers=3)),
        dict(height=32, width=32, num_frames=5, num_inference_steps=3, max_sequence_length=64),
        frames=True,
    ),
    Family(
        "zimage",
        lambda d: build_tiny_zimage(d, TinyZImageSpec(n_layers=3, n_refiner_layers=2)),
        dict(height=64, width=64, num_inference_steps=3),
    ),
]


def _pixels(gen: DiffGenerator, family: Family, **extra) -> np.ndarray:
    out = gen.generate(prompt="a red fox in the snow", seed=7, **family.kwargs, **extra)
    return np.asarray(out.frames if family.frames else out.images[0])


def _dit(gen: DiffGenerator) -> nn.Module:
    return gen.pipeline.context.get("transformer")


def _tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(), *module.named_buffers()]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _footprint(dit: nn.Module) -> tuple[int, int]:
    """(non-block bytes, largest block's bytes) of the loaded DiT, from its state-dict names."""
    blocks: dict[str, int] = {}
    non_block = 0
    for name, t in _tensors(dit):
        match = BLOCK_KEY.match(name)
        if match is None:
            non_block += _nbytes(t)
        else:
            blocks[match.group(0)] = blocks.get(match.group(0), 0) + _nbytes(t)
    return non_block, max(blocks.values())


class MaterializedProbe:
    """At every module call of the DiT, the bytes of its tensors that hold storage (not `meta`)."""

    def __init__(self, dit: nn.Module) -> None:
        self.dit = dit
        self.peak = 0
        self.calls = 0
        self.handles = [m.register_forward_pre_hook(self._measure) for m in dit.modules()]

    def _measure(self, _module: nn.Module, _args: tuple) -> None:
        self.calls += 1
        self.peak = max(self.peak, sum(_nbytes(t) for _, t in _tensors(self.dit) if not t.is_meta))

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


@pytest.fixture(scope="module", params=FAMILIES, ids=lambda f: f.name)
def loaded(request, tmp_path_factory):
    family: Family = request.param
    root = family.build(tmp_path_factory.mktemp(family.name))
    gen = DiffGenerator.from_pretrained(root, device="cpu", show_progress=False)
    return family, gen, _pixels(gen, family), root


def test_outputs_identical_and_device_bytes_bounded(loaded) -> None:
    family, gen, reference, _ = loaded
    dit = _dit(gen)
    non_block, max_block = _footprint(dit)
    platform = CountingPlatform()
    offload = install_layerwise_offload(dit, platform)
    probe = MaterializedProbe(dit)
    try:
        pixels = _pixels(gen, family)
        counted_peak = platform.memory_info().peak_bytes
    finally:
        probe.close()
        offload.remove()
    assert np.array_equal(pixels, reference), f"{family.name}: layerwise offload changed the output"
    bound = non_block + 2 * max_block
    print(
        f"\n{family.name}: {len(offload.groups)} blocks, largest {max_block} B, non-block {non_block} B, "
        f"all blocks {offload.block_bytes} B; peak materialized {probe.peak} B (bound {bound}), peak "
        f"counted on the device {counted_peak} B; {offload.stats}"
    )
    assert probe.calls > 0
    assert probe.peak <= bound
    # Without the offload every block would be materialized at once: the bound is not vacuous.
    assert non_block + offload.block_bytes > bound
    # The counting platform saw only blocks being copied in: at most two at a time, and it saw them.
    assert 0 < counted_peak <= 2 * max_block


def test_prefetch_is_right_after_the_first_forward(loaded) -> None:
    family, gen, reference, _ = loaded
    dit = _dit(gen)
    offload = install_layerwise_offload(dit, CountingPlatform())
    calls = []
    blocks = [m for name, m in dit.named_modules() if BLOCK_NAME.fullmatch(name)]
    handles = [block.register_forward_pre_hook(lambda m, a: calls.append(m)) for block in blocks]
    try:
        _pixels(gen, family)  # learns the order the blocks run in
        offload.reset_stats()
        calls.clear()
        pixels = _pixels(gen, family)
        stats = offload.stats
    finally:
        for handle in handles:
            handle.remove()
        offload.remove()
    assert np.array_equal(pixels, reference)
    assert len(blocks) == len(offload.groups)
    assert len(calls) >= family.kwargs["num_inference_steps"] * 3
    assert stats.hits + stats.missed == len(calls)
    # Z-Image's context refiner runs once per request, before the blocks that run every step: the
    # request's first block is then not the one expected after the previous step's last.
    assert stats.missed == (1 if family.name == "zimage" else 0), stats


def test_step_cache_calls_outside_the_blocks_work(loaded) -> None:
    """The step cache reads the first block's modulated input outside that block's forward."""
    family, gen, _, _ = loaded
    exact_cache = _pixels(gen, family, quality="low")
    dit = _dit(gen)
    offload = install_layerwise_offload(dit, CountingPlatform())
    try:
        pixels = _pixels(gen, family, quality="low")
    finally:
        offload.remove()
    assert np.array_equal(pixels, exact_cache)


def test_remove_restores_the_model(loaded) -> None:
    family, gen, reference, _ = loaded
    dit = _dit(gen)
    before = {name: t.clone() for name, t in _tensors(dit)}
    offload = install_layerwise_offload(dit, CpuPlatform())
    assert layerwise_offload_of(dit) is offload
    assert any(t.is_meta for _, t in _tensors(dit))
    offload.remove()
    assert layerwise_offload_of(dit) is None
    after = dict(_tensors(dit))
    assert before.keys() == after.keys()
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert np.array_equal(_pixels(gen, family), reference)


def test_misuse_is_refused(loaded) -> None:
    _, gen, _, _ = loaded
    dit = _dit(gen)
    offload = install_layerwise_offload(dit, CpuPlatform())
    try:
        with pytest.raises(RuntimeError, match="already has a layerwise offload"):
            install_layerwise_offload(dit, CpuPlatform())
        with pytest.raises(ValueError, match="prefetch_blocks"):
            install_layerwise_offload(nn.Linear(2, 2), CpuPlatform(), prefetch_blocks=0)
        with pytest.raises(UserError, match="no repeated blocks"):
            install_layerwise_offload(nn.Sequential(nn.Linear(2, 2)), CpuPlatform())
    finally:
        offload.remove()


def test_two_blocks_ahead_keeps_three(loaded) -> None:
    family, gen, reference, _ = loaded
    dit = _dit(gen)
    _, max_block = _footprint(dit)
    platform = CountingPlatform()
    offload = install_layerwise_offload(dit, platform, prefetch_blocks=2)
    try:
        pixels = _pixels(gen, family)
        peak = platform.memory_info().peak_bytes
    finally:
        offload.remove()
    assert np.array_equal(pixels, reference)
    assert 2 * min(g.nbytes for g in offload.groups) < peak <= 3 * max_block


class StandInEvent:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def synchronize(self) -> None:
        self.log.append(f"host waits {self.name}")


class StandInStream:
    """Records what the offload asks of a stream (the CPU has none): the order of copies and waits."""

    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name, self.events = log, name, 0

    def __enter__(self) -> StandInStream:
        self.log.append(f"enter {self.name}")
        return self

    def __exit__(self, *exc: object) -> None:
        self.log.append(f"exit {self.name}")

    def record_event(self) -> StandInEvent:
        self.events += 1
        return StandInEvent(self.log, f"{self.name}#{self.events}")

    def wait_event(self, event: StandInEvent) -> None:
        self.log.append(f"{self.name} waits {event.name}")


def test_side_stream_protocol(loaded, monkeypatch) -> None:
    """The accelerator path's ordering, with stand-in streams: prefetch copies are queued on the side
    stream and recorded on the compute stream, the compute stream waits on each copy before its block,
    and the host waits for the previous block before it copies the next one into its memory."""
    family, gen, reference, _ = loaded
    log: list[str] = []
    side, compute = StandInStream(log, "side"), StandInStream(log, "compute")
    recorded: list[object] = []
    monkeypatch.setattr("diffserve.offload.layerwise._side_stream", lambda device: side)
    monkeypatch.setattr("diffserve.offload.layerwise._current_stream", lambda device: compute)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda tensor, stream: recorded.append(stream))
    dit = _dit(gen)
    offload = install_layerwise_offload(dit, CountingPlatform())
    try:
        pixels = _pixels(gen, family)
        stats = offload.stats
    finally:
        offload.remove()
    assert np.array_equal(pixels, reference)
    assert stats.prefetched == side.events and stats.prefetched > 0
    assert len(recorded) >= stats.prefetched and set(map(id, recorded)) == {id(compute)}
    # Every prefetch copy is waited for by the compute stream before its block runs, once (but the last,
    # for the next request's first block, and those of a wrong guess, each also a miss).
    copies = [line.split()[-1] for line in log if line.startswith("compute waits side#")]
    assert len(copies) >= side.events - 1 - stats.missed and len(set(copies)) == len(copies)
    # Each prefetch after the first block is preceded by the host waiting for the block before.
    enters = [i for i, line in enumerate(log) if line == "enter side"]
    assert all(log[i - 1].startswith("host waits compute#") for i in enters[1:])


# ------------------------------------------------------------------------------ memory-mapped weights


def test_max_memory_generates_the_same_pixels(loaded) -> None:
    family, _, reference, root = loaded
    if family.name == "flux":
        pytest.skip("FLUX runs unfused when memory-mapped: compared at the DiT level below")
    # A cap the other components' weights fit under, and the DiT's do not.
    others = sum(f.stat().st_size for f in root.glob("*/*.safetensors") if f.parent.name != "transformer")
    dit_file = root / "transformer" / "diffusion_pytorch_model.safetensors"
    cap = others + dit_file.stat().st_size // 2
    dit_file.chmod(0o444)  # only files nothing can rewrite stay mapped (owned_weights.read_only_reason)
    gen = DiffGenerator.from_pretrained(root, device="cpu", show_progress=False, max_memory=cap)
    offload = layerwise_offload_of(_dit(gen))
    assert offload is not None and offload.host_memory == "memory-mapped files"
    assert np.array_equal(_pixels(gen, family), reference)


FLUX_CONFIG = {
    "patch_size": 1, "in_channels": 16, "out_channels": None, "num_layers": 2, "num_single_layers": 3,
    "attention_head_dim": 16, "num_attention_heads": 2, "joint_attention_dim": 24, "pooled_projection_dim": 12,
    "guidance_embeds": True, "axes_dims_rope": [4, 6, 6],
}  # fmt: skip


@pytest.fixture(scope="module")
def flux_files(tmp_path_factory) -> list[Path]:
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("flux-dit")
    save_diffusers_model(
        FluxTransformer2DModel.from_config(FLUX_CONFIG), folder, "FluxTransformer2DModel", FLUX_CONFIG
    )
    weights = folder / "diffusion_pytorch_model.safetensors"
    weights.chmod(0o444)  # mapped files must be read-only (loader/mmap_weights.py)
    return [weights]


def _meta_flux() -> FluxTransformer2DModel:
    with torch.device("meta"):
        return FluxTransformer2DModel.from_config(FLUX_CONFIG).eval()


@pytest.mark.parametrize("make_platform", [CpuPlatform, CountingPlatform], ids=["in-place", "counted-copies"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mapped_flux_matches_the_normal_load(
    flux_files, make_platform: Callable[[], Platform], dtype: torch.dtype
) -> None:
    platform = make_platform()
    inputs = {
        k: v.to(dtype) if v.is_floating_point() else v
        for k, v in flux_dit_inputs(3, 3, 5, [0.6, 0.3]).items()
    }
    normal = _meta_flux()
    load_safetensors_into(normal, flux_files, torch.device("cpu"), dtype)
    mapped = _meta_flux()
    load_mmapped_into(mapped, flux_files, dtype)
    assert all(t.is_meta and t.dtype == dtype for _, t in _tensors(mapped))
    assert mapped_tensors(mapped).keys() == normal.state_dict().keys()
    offload = install_layerwise_offload(mapped, platform)
    assert mapped_tensors(mapped) is None  # handed over to the offload
    with torch.no_grad():
        expected = normal(**inputs)
        for _ in range(2):
            assert torch.equal(mapped(**inputs), expected)
    # Unfused FLUX computes every adaLN projection before the blocks run: those Linears are copied for
    # their call alone (touches), and the blocks still stream with their prefetch.
    assert offload.stats.touches > 0 and offload.stats.missed == 1
    if isinstance(platform, CountingPlatform):  # the non-block weights were copied from the files too
        non_block, max_block = _footprint(normal)
        assert non_block < platform.memory_info().peak_bytes <= non_block + 2 * max_block


def test_mapped_checkpoint_must_match_the_model(flux_files, tmp_path) -> None:
    other = dict(FLUX_CONFIG, num_single_layers=2)  # the file has a third single-stream block
    with torch.device("meta"):
        model = FluxTransformer2DModel.from_config(other)
    with pytest.raises(ModelLoadError, match="unexpected keys: single_transformer_blocks.2"):
        load_mmapped_into(model, flux_files, torch.float32)
    wider = dict(FLUX_CONFIG, joint_attention_dim=32)
    with torch.device("meta"):
        model = FluxTransformer2DModel.from_config(wider)
    with pytest.raises(ModelLoadError, match="context_embedder.weight' has shape"):
        load_mmapped_into(model, flux_files, torch.float32)
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(flux_files[0].read_bytes()[:5000])
    broken.chmod(0o444)
    with pytest.raises(ModelLoadError, match="cannot map .*broken.safetensors"):
        load_mmapped_into(_meta_flux(), [broken], torch.float32)


def test_writable_files_are_not_mapped(flux_files, tmp_path, caplog) -> None:
    """Issue 31: a mapped file rewritten in place changes the weights, a truncated one kills the engine
    (SIGBUS): only files nothing can rewrite stay mapped, and the log says why each may."""
    writable = tmp_path / "writable.safetensors"
    writable.write_bytes(flux_files[0].read_bytes())
    with pytest.raises(ModelLoadError, match=r"writable: .*writable.safetensors.*chmod a-w"):
        load_mmapped_into(_meta_flux(), [writable], torch.float32)
    with caplog.at_level(logging.INFO, logger="diffserve.loader"):
        load_mmapped_into(_meta_flux(), flux_files, torch.float32)
    assert "kept mapped as verified read-only (mode 0444, no write permission)" in caplog.text
