"""The memory plan (`offload/plan.py`) on a FLUX.1-dev-sized folder whose safetensors files hold only
their headers (sizes come from the headers, nothing is loaded), and the memory model's weight terms.

FLUX.1-dev in bf16, as the fake folder sizes it: DiT 11.9B parameters = 22.17 GiB (19 double blocks of
339.0M, 38 single blocks of 141.6M, 78M outside the blocks), T5-XXL 4.76B = 8.87 GiB, CLIP-L 123M =
0.23 GiB, VAE 83.8M = 0.16 GiB. With 3 GiB kept for activations (0.75 GiB for the encoders' stages):"""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path

import pytest
import torch
from torch import nn

from diffserve.configs.engine_args import EngineArgs
from diffserve.errors import UserError
from diffserve.loader.model_index import read_model_index
from diffserve.offload import install_memory_plan, offload_group
from diffserve.offload.plan import MemoryPlan, log_plan, plan_memory
from diffserve.offload.sizes import read_safetensors_header, size_of
from diffserve.platforms.cpu import CpuPlatform
from diffserve.runtime.contract import PipelineFacts
from diffserve.runtime.memory import (
    PhasePeaks,
    RequestCost,
    WeightResidency,
    estimated_memory_model,
    measured_memory_model,
)
from diffserve.testing.counting_platform import CountingPlatform

GiB = 2**30
RESERVE = 3 * GiB
COMPONENTS = ("text_encoder", "text_encoder_2", "vae", "transformer", "tokenizer", "tokenizer_2", "scheduler")
DOUBLE_ROWS, SINGLE_ROWS, WIDTH = 110_352, 46_094, 3072  # 339.0M and 141.6M parameters per block


def write_header_only(path: Path, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """A safetensors file with its header and no data (the plan reads headers only)."""
    header, offset = {}, 0
    sizes = {"BF16": 2, "F32": 4, "I64": 8}
    for name, (dtype, shape) in tensors.items():
        n = sizes[dtype]
        for dim in shape:
            n *= dim
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


@pytest.fixture(scope="module")
def flux_dev(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("flux-dev-headers")
    dit = {f"transformer_blocks.{i}.attn.weight": ("BF16", (DOUBLE_ROWS, WIDTH)) for i in range(19)}
    dit |= {f"single_transformer_blocks.{i}.linear.weight": ("BF16", (SINGLE_ROWS, WIDTH)) for i in range(38)}
    dit["x_embedder.bias"] = ("BF16", (78_000_000,))
    write_header_only(root / "transformer" / "diffusion_pytorch_model.safetensors", dit)
    write_header_only(
        root / "text_encoder_2" / "model.safetensors", {"encoder.weight": ("BF16", (4_760_000_000,))}
    )
    write_header_only(
        root / "text_encoder" / "model.safetensors", {"text_model.weight": ("BF16", (123_000_000,))}
    )
    write_header_only(
        root / "vae" / "diffusion_pytorch_model.safetensors", {"decoder.weight": ("F32", (83_800_000,))}
    )
    index = {
        "_class_name": "FluxPipeline",
        "text_encoder": ["transformers", "CLIPTextModel"],
        "text_encoder_2": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
        "tokenizer_2": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "FluxTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    }
    (root / "model_index.json").write_text(json.dumps(index))
    return root


def plan_for(root: Path, free: int, platform=None, **args):
    engine_args = EngineArgs(model_path=str(root), **args)
    return plan_memory(
        read_model_index(root), engine_args, platform or CountingPlatform(capacity_bytes=free),
        torch.bfloat16, torch.bfloat16, COMPONENTS, free_bytes=free, host_free_bytes=2**40, reserve_bytes=RESERVE,
    )  # fmt: skip


def offloaded(plan) -> dict[str, str]:
    return {n: p for n, p in plan.placements.items() if p != "resident"}


def test_sizes_come_from_the_headers_in_the_load_dtype(flux_dev) -> None:
    plan = plan_for(flux_dev, 80 * GiB, offload="auto")
    gib = {n: round(s.total_bytes / GiB, 2) for n, s in plan.sizes.items()}
    assert gib == {"text_encoder": 0.23, "text_encoder_2": 8.87, "vae": 0.16, "transformer": 22.17}
    dit = plan.sizes["transformer"]
    assert len(dit.block_bytes) == 57 and dit.non_block_bytes == 78_000_000 * 2
    assert dit.window_bytes == 2 * DOUBLE_ROWS * WIDTH * 2  # the running block and the next
    # The VAE's F32 file loads in bf16: half its stored bytes.
    assert plan.sizes["vae"].total_bytes == 83_800_000 * 2


def test_quantized_sizes_count_one_byte_per_linear_weight_and_a_scale_per_row(tmp_path) -> None:
    path = tmp_path / "w.safetensors"
    write_header_only(path, {"blocks.0.proj.weight": ("F32", (8, 16)), "blocks.0.proj.bias": ("F32", (8,))})
    entries = read_safetensors_header(path)
    assert size_of(entries, torch.bfloat16).total_bytes == (8 * 16 + 8) * 2
    assert size_of(entries, torch.bfloat16, "int8").total_bytes == 8 * 16 + 8 * 4 + 8 * 2


@pytest.mark.parametrize(
    ("free_gib", "expected"),
    [
        (40, {}),  # 31.4 GiB of weights + 3 fit: all resident
        (33, {"text_encoder_2": "offload"}),  # T5 moving in: 22.6 + 8.9 + 0.75 = 32.2
        # The DiT moving in once per request (25.6 with both small encoders and the VAE brought back):
        (26, {"text_encoder_2": "offload", "transformer": "offload"}),
        # The whole DiT (22.2 + 3) no longer fits: layerwise, and then T5 fits resident (13.7).
        (20, {"transformer": "layerwise"}),
        (12, {"text_encoder_2": "offload", "transformer": "layerwise"}),
    ],
)
def test_offload_auto_keeps_resident_what_fits_cheapest_offloads_first(flux_dev, free_gib, expected) -> None:
    plan = plan_for(flux_dev, free_gib * GiB, offload="auto")
    assert offloaded(plan) == expected
    assert plan.fits()
    print(f"{free_gib} GiB free: {offloaded(plan)}; resident {plan.resident_bytes() / GiB:.2f} GiB")


def test_quantization_lets_flux_dev_stay_resident_on_24_gib(flux_dev) -> None:
    assert offloaded(plan_for(flux_dev, 24 * GiB, offload="auto")) == {"transformer": "layerwise"}
    int8 = plan_for(flux_dev, 24 * GiB, offload="auto", quantization="int8")
    assert offloaded(int8) == {} and round(int8.sizes["transformer"].total_bytes / GiB, 2) == 11.17


def test_a_device_too_small_even_for_one_component_is_a_clear_error(flux_dev) -> None:
    with pytest.raises(UserError, match="text_encoder_2's stage needs 9.76 GiB") as info:
        plan_for(flux_dev, 8 * GiB, offload="auto")
    assert "8.00 GiB are free" in str(info.value) and "--text-encoder-dtype" in str(info.value)


def test_explicit_flags_are_kept_and_auto_adds_to_them(flux_dev) -> None:
    plan = plan_for(flux_dev, 40 * GiB, offload="auto", vae_cpu_offload=True)
    assert offloaded(plan) == {"vae": "offload"} and plan.reasons["vae"] == "--vae-cpu-offload"
    flags = plan_for(flux_dev, 40 * GiB, text_encoder_cpu_offload=True)
    assert flags.host_components == {"text_encoder", "text_encoder_2"}
    with pytest.raises(UserError, match="pick one"):
        plan_for(flux_dev, 40 * GiB, dit_cpu_offload=True, dit_layerwise_offload=True)


def test_compile_is_refused_when_the_dit_is_offloaded(flux_dev) -> None:
    with pytest.raises(UserError, match="--compile does not work with the DiT offloaded"):
        plan_for(flux_dev, 26 * GiB, offload="auto", compile=True)
    assert offloaded(plan_for(flux_dev, 26 * GiB, compile=True, text_encoder_cpu_offload=True))


def test_host_memory_short_maps_the_dit(flux_dev) -> None:
    """Where the device is the host (the CPU), auto offloads no component; when the weights do not fit
    the host's free memory (20 - 3 GiB here), or `--max-memory`, the DiT stays memory-mapped."""
    cpu = CpuPlatform()
    plan = plan_memory(
        read_model_index(flux_dev), EngineArgs(model_path=str(flux_dev), offload="auto"), cpu,
        torch.bfloat16, torch.bfloat16, COMPONENTS, free_bytes=20 * GiB, host_free_bytes=20 * GiB,
        reserve_bytes=RESERVE,
    )  # fmt: skip
    assert plan.mmap_dit and offloaded(plan) == {"transformer": "layerwise"}
    assert plan_for(flux_dev, 40 * GiB, platform=cpu, max_memory=12 * GiB).mmap_dit
    assert not plan_for(flux_dev, 40 * GiB, platform=cpu, max_memory=40 * GiB).mmap_dit
    assert not plan_for(
        flux_dev, 40 * GiB, max_memory=12 * GiB
    ).mmap_dit  # all on the device: no host weights
    with pytest.raises(UserError, match="over the 5.00 GiB allowed"):
        plan_for(flux_dev, 40 * GiB, platform=cpu, max_memory=5 * GiB)
    # Quantizing needs the weights in memory: with them kept in their files it is refused up front.
    with pytest.raises(UserError, match="--quantization int8 needs the DiT's weights in memory"):
        plan_for(flux_dev, 40 * GiB, platform=cpu, max_memory=12 * GiB, quantization="int8")


def test_the_plan_is_logged_with_the_components_that_stay_resident(flux_dev, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="diffserve.offload"):
        log_plan(plan_for(flux_dev, 26 * GiB, offload="auto"))
    print(caplog.text)
    assert (
        "Memory plan (--offload auto): device free 26.00 GiB, 3.00 GiB kept for activations; weights "
        "(safetensors headers, load dtypes): transformer 22.17 GiB, text_encoder_2 8.87 GiB, "
        "text_encoder 234.60 MiB, vae 159.84 MiB" in caplog.text
    )
    assert (
        "Memory plan: transformer -> CPU offload" in caplog.text
        and "(moves in once per request)" in caplog.text
    )
    assert "Components that stay resident: ['text_encoder', 'vae']" in caplog.text


# -- the memory model's weight terms ------------------------------------------------------------------------

FACTS = PipelineFacts(
    name="FluxPipeline", pixel_multiple=16, dit_width=3072, dtype=torch.bfloat16, cfg_mode="true_cfg"
)
COST = RequestCost(height=1024, width=1024, pixel_multiple=16, branches=1, outputs=1)


def test_the_largest_offloaded_component_is_counted_once_per_running_set() -> None:
    platform = CountingPlatform(capacity_bytes=40 * GiB)
    plain = estimated_memory_model(FACTS, platform, 1.0)
    weights = WeightResidency(resident_bytes=22 * GiB, swap_bytes=9 * GiB, moved_in_bytes=2 * GiB)
    offloaded_model = estimated_memory_model(FACTS, platform, 1.0, weights)
    assert offloaded_model.estimate(COST) == plain.estimate(COST) + 9 * GiB
    assert offloaded_model.total([COST, COST, COST]) == plain.total([COST, COST, COST]) + 9 * GiB
    # Free memory is read with the moved-in component on the device: it is counted as leaving.
    assert offloaded_model.budget_bytes == plain.budget_bytes + 2 * GiB
    assert offloaded_model.describe()["offload_swap_mb"] == 9 * 1024
    assert offloaded_model.describe()["resident_weights_mb"] == 22 * 1024


def test_calibration_with_offloaded_weights_falls_back_to_the_estimate() -> None:
    platform = CountingPlatform(capacity_bytes=40 * GiB)
    small = RequestCost(height=256, width=256, pixel_multiple=16, branches=1, outputs=1)
    points = [
        PhasePeaks(small, 9 * GiB, 1 * GiB),
        PhasePeaks(COST, 9 * GiB, 2 * GiB),
    ]  # T5's copy hides the DiT
    assert measured_memory_model(FACTS, platform, points, 1.0).source == "measured"
    model = measured_memory_model(FACTS, platform, points, 1.0, WeightResidency(swap_bytes=9 * GiB))
    assert model.source == "estimated" and model.weights.swap_bytes == 9 * GiB


# -- the hooks, on a "device" other than the host's: the meta device -------------------------------------


class MetaPlatform(CpuPlatform):
    """A platform whose device is `meta` (shapes only): a tensor left on the host next to one moved
    there fails to compute, as a host tensor next to a GPU one would."""

    name = "meta-test"

    def device(self, index: int | None = None) -> torch.device:
        return torch.device("meta")

    def has_separate_device_memory(self) -> bool:
        return True

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to("meta")


class TinyVae(nn.Module):
    """A VAE-like component used through `decode`, not `forward`; its root owns a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.decoder = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
        self.register_buffer("scale", torch.full((2,), 0.5))

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.decoder(z) * self.scale


def test_a_method_call_moves_the_component_and_its_host_inputs_and_the_next_use_evicts_it() -> None:
    platform = MetaPlatform()
    vae, dit = TinyVae(), nn.Linear(2, 2, device="meta")  # the DiT resident on the device
    host_weight = vae.decoder[0].weight.detach().clone()
    plan = MemoryPlan(
        "none", {"vae": "offload", "transformer": "resident"}, {"vae": "vae", "transformer": "dit"}
    )
    group = install_memory_plan(plan, {"vae": vae, "transformer": dit}, platform)
    assert group is not None and not group.components["vae"].on_device
    z = torch.randn(3, 4)  # a stage placed it where the VAE's weights were: the host
    out = vae.decode(z)
    assert out.device.type == "meta" and out.shape == (3, 2)
    assert vae.decoder[0].weight.device.type == "meta" and vae.scale.device.type == "meta"
    dit(out)  # another component's use evicts the VAE: its weights are the host copies again
    assert vae.decoder[0].weight.device.type == "cpu" and torch.equal(vae.decoder[0].weight, host_weight)
    assert group.components["vae"].moves_in == 1
    assert group.residency() == WeightResidency(
        resident_bytes=2 * 2 * 4 + 2 * 4, swap_bytes=(4 * 8 + 8 + 8 * 2 + 2 + 2) * 4, moved_in_bytes=0
    )
    group.remove()  # back on the device for good, hooks gone
    assert vae.decoder[0].weight.device.type == "meta" and offload_group({"vae": vae}) is None
