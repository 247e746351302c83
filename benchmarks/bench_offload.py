"""DiT offload on a FLUX-shaped DiT: the device's peak memory and the time per denoising step with the DiT
resident, component-offloaded (`--dit-cpu-offload`) and layerwise-offloaded (`--dit-layerwise-offload`),
and on the CPU, with the weights memory-mapped (`--max-memory`).

The DiT has FLUX.1-dev's block shape (24 heads x 128 = 3072 wide, T5 width 4096, 64 latent channels) on
an accelerator, and a small one on the CPU (4 heads x 128, 2 + 8 blocks); `--double`/`--single` set the
depth (`--full`: FLUX.1-dev's 19 + 38, 12B parameters, 24 GB in bf16). Random weights, fused as the
loader leaves them (`fuse_for_inference`); one step is one DiT forward at batch 1 on `--image-tokens`
latent tokens (4096: 1024x1024) and `--text-tokens` T5 tokens.

Modes, each run `--steps` times after one untimed warm-up step:
  none       the DiT on the device (the reference output)
  component  its weights in pinned host memory, moved in whole for a request of `--steps` steps and
             dropped after it (`--dit-cpu-offload`'s mechanics): the step is the request's time / steps
  layerwise  `offload/layerwise.py`: blocks streamed one ahead on a side stream
  mmap       (CPU) the weights saved to a safetensors file, memory-mapped and streamed per block
Each mode's output must equal the reference (torch.equal; `mmap` runs unfused: compared by its max
difference). The device's peak is `Platform.memory_info().peak_bytes` over the timed steps (on the CPU:
the process's RSS peak, where the layerwise offload saves nothing: the mechanics' overhead is what it
measures there).

    .venv/bin/python benchmarks/bench_offload.py                        # CPU: ~1 min
    python benchmarks/bench_offload.py --double 4 --single 8            # an accelerator: ~2.5B params
    python benchmarks/bench_offload.py --full --steps 5                 # FLUX.1-dev size (24 GB bf16)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from diffserve.families.flux.tiny import flux_dit_inputs
from diffserve.loader.mmap_weights import load_mmapped_into
from diffserve.models.dits.flux import FluxTransformer2DModel, FluxTransformerConfig
from diffserve.offload.layerwise import LayerwiseOffload, install_layerwise_offload
from diffserve.platforms import detect_platform
from diffserve.platforms.base import Platform

GB, MB = 2**30, 2**20


@dataclass
class Result:
    mode: str
    step_s: float  # median seconds per step (component: the request's time / steps)
    step_min_s: float
    step_max_s: float
    peak_bytes: int | None  # the device's peak over the timed steps
    equal: bool  # output torch.equal to the resident DiT's
    max_abs_diff: float
    note: str = ""


def _config(args: argparse.Namespace, accelerator: bool) -> FluxTransformerConfig:
    heads = args.heads or (24 if accelerator else 4)
    return FluxTransformerConfig(
        patch_size=1,
        in_channels=64,
        num_layers=19 if args.full else args.double,
        num_single_layers=38 if args.full else args.single,
        attention_head_dim=128,
        num_attention_heads=heads,
        joint_attention_dim=4096 if accelerator else 64,
        pooled_projection_dim=768 if accelerator else 64,
        guidance_embeds=True,
        axes_dims_rope=(16, 56, 56),
    )


def _build(config: FluxTransformerConfig, device: torch.device, dtype: torch.dtype) -> FluxTransformer2DModel:
    """A random DiT on `device` (initialized there, in `dtype`), fused as the loader leaves it."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = FluxTransformer2DModel(config).eval().requires_grad_(False)
    _assign(
        model,
        {
            n: torch.empty(t.shape, dtype=dtype, device=device).normal_(0.0, 0.02)
            for n, t in _tensors(model).items()
        },
    )
    model.fuse_for_inference()
    return model


def _inputs(
    config: FluxTransformerConfig, args: argparse.Namespace, device: torch.device, dtype: torch.dtype
):
    side = int(args.image_tokens**0.5)
    raw = flux_dit_inputs(
        side,
        side,
        args.text_tokens,
        [0.7],
        in_channels=config.in_channels,
        context_dim=config.joint_attention_dim,
        pooled_dim=config.pooled_projection_dim,
    )
    return {
        k: v.to(device, dtype) if k not in ("img_ids", "txt_ids") else v.to(device) for k, v in raw.items()
    }


class Mode:
    """One way of holding the DiT: `setup()` places the weights and returns the step to time (a request's
    share, for the component mode), `teardown()` frees what `setup` placed; `note` is for the report."""

    name = ""

    def setup(self) -> Callable[[], torch.Tensor]:
        raise NotImplementedError

    def teardown(self) -> None:
        raise NotImplementedError

    def note(self) -> str:
        return ""


class Bench:
    """The model (on meta between modes), its weights in pinned host memory, the inputs."""

    def __init__(self, platform: Platform, model: nn.Module, inputs: dict, steps: int) -> None:
        self.platform, self.model, self.inputs, self.steps = platform, model, inputs, steps
        self.host = {name: platform.pin_host(t.detach().to("cpu")) for name, t in _tensors(model).items()}
        self.placeholders = {name: torch.empty_like(t, device="meta") for name, t in self.host.items()}
        _assign(model, self.placeholders)

    def forward(self) -> torch.Tensor:
        return self.model(**self.inputs)


class Resident(Mode):
    name = "none"

    def __init__(self, bench: Bench) -> None:
        self.bench = bench

    def setup(self) -> Callable[[], torch.Tensor]:
        _assign(self.bench.model, {n: self.bench.platform.to_device(t) for n, t in self.bench.host.items()})
        return self.bench.forward

    def teardown(self) -> None:
        _assign(self.bench.model, self.bench.placeholders)


class Component(Mode):
    """`--dit-cpu-offload`: a request moves the whole DiT in, runs its steps, and drops it."""

    name = "component"

    def __init__(self, bench: Bench) -> None:
        self.bench = bench

    def setup(self) -> Callable[[], torch.Tensor]:
        bench = self.bench

        def request() -> torch.Tensor:
            _assign(bench.model, {n: bench.platform.to_device(t) for n, t in bench.host.items()})
            for _ in range(bench.steps):
                out = bench.forward()
            _assign(bench.model, bench.placeholders)
            return out

        return request

    def teardown(self) -> None:
        _assign(self.bench.model, self.bench.placeholders)

    def note(self) -> str:
        return "moved in once per request: the step is the request's time / steps"


class Layerwise(Mode):
    name = "layerwise"

    def __init__(self, bench: Bench) -> None:
        self.bench = bench
        self.offload: LayerwiseOffload | None = None
        self.missed = self.uses = 0

    def setup(self) -> Callable[[], torch.Tensor]:
        _assign(self.bench.model, self.bench.host)  # in host memory, as the loader leaves it
        self.offload = install_layerwise_offload(self.bench.model, self.bench.platform)
        return self.bench.forward

    def teardown(self) -> None:
        stats = self.offload.stats
        self.missed += stats.missed
        self.uses += stats.hits + stats.missed
        self.note_text = f"{self.offload.host_memory}; {self.missed} of {self.uses} block uses missed"
        self.offload.remove()
        _assign(self.bench.model, self.bench.placeholders)

    def note(self) -> str:
        return self.note_text


class Mapped(Mode):
    """`--max-memory`: the weights memory-mapped from a safetensors file (Diffusers' names), unfused."""

    name = "mmap"

    def __init__(
        self, bench: Bench, config: FluxTransformerConfig, weights: Path, dtype: torch.dtype
    ) -> None:
        self.bench, self.config, self.weights, self.dtype = bench, config, weights, dtype
        self.model: nn.Module | None = None

    def setup(self) -> Callable[[], torch.Tensor]:
        with torch.device("meta"):
            self.model = FluxTransformer2DModel(self.config).eval()
        load_mmapped_into(self.model, [self.weights], self.dtype)
        install_layerwise_offload(self.model, self.bench.platform)
        return lambda: self.model(**self.bench.inputs)

    def teardown(self) -> None:
        self.model = None

    def note(self) -> str:
        return "unfused; pages released after each block, re-read from the page cache"


def _run(platform: Platform, mode: Mode, steps: int) -> tuple[list[float], torch.Tensor, int | None]:
    """Set `mode` up, warm it up, time `steps` steps (the device's peak over them), tear it down."""
    step = mode.setup()
    step()  # warm-up (and, for the layerwise modes, the blocks' order)
    platform.synchronize()
    platform.empty_cache()
    platform.reset_peak_memory()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        out = step()
        platform.synchronize()
        times.append(time.perf_counter() - start)
    peak = platform.memory_info().peak_bytes
    mode.teardown()
    platform.empty_cache()
    return times, out, peak


def _result(
    mode: str, times: list[float], peak: int | None, out: torch.Tensor, ref: torch.Tensor, note: str = ""
) -> Result:
    diff = (out.float() - ref.float()).abs().max().item()
    return Result(
        mode, statistics.median(times), min(times), max(times), peak, torch.equal(out, ref), diff, note
    )


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The module's own tensors by their (fused) module path: what the offload modes move."""
    return dict([*model.named_parameters(), *model.named_buffers()])


def _assign(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Register `tensors` (by `_tensors` name) in `model` in place of the ones it has."""
    for name, tensor in tensors.items():
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        if leaf in owner._parameters:
            owner._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
        else:
            owner._buffers[leaf] = tensor


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--double", type=int, default=2, help="double-stream blocks (default 2; FLUX.1-dev: 19)"
    )
    parser.add_argument(
        "--single", type=int, default=8, help="single-stream blocks (default 8; FLUX.1-dev: 38)"
    )
    parser.add_argument("--heads", type=int, default=0, help="attention heads of 128 (default 24, CPU 4)")
    parser.add_argument("--full", action="store_true", help="FLUX.1-dev's depth: 19 + 38 blocks")
    parser.add_argument("--image-tokens", type=int, default=0, help="latent tokens (default 4096, CPU 256)")
    parser.add_argument("--text-tokens", type=int, default=0, help="T5 tokens (default 512, CPU 64)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per mode and round (a request's)")
    parser.add_argument("--rounds", type=int, default=0, help="rounds over the modes (default 1, CPU 3)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    platform = detect_platform()
    accelerator = platform.device_type != "cpu"
    args.image_tokens = args.image_tokens or (4096 if accelerator else 256)
    args.text_tokens = args.text_tokens or (512 if accelerator else 64)
    args.rounds = args.rounds or (1 if accelerator else 3)
    device, dtype = platform.device(), platform.default_dtype
    config = _config(args, accelerator)

    model = _build(config, device, dtype)
    weight_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    inputs = _inputs(config, args, device, dtype)
    print(
        f"{platform.device_name()}: FLUX-shaped DiT {config.num_layers} + {config.num_single_layers} blocks, "
        f"width {config.inner_dim}, {weight_bytes / GB:.2f} GiB in {str(dtype).removeprefix('torch.')}; "
        f"{args.image_tokens} image + {args.text_tokens} text tokens, {args.steps} steps"
    )
    with tempfile.TemporaryDirectory() as tmp:
        weights = Path(tmp) / "weights.safetensors"
        if not accelerator:  # Diffusers' names: the fused tensors split back (cloned: one file entry each)
            save_file({k: v.clone() for k, v in model.state_dict().items()}, str(weights))
        bench = Bench(platform, model, inputs, args.steps)
        modes: list[Mode] = [Resident(bench), Component(bench), Layerwise(bench)]
        if not accelerator:
            modes.append(Mapped(bench, config, weights, dtype))
        times: dict[str, list[float]] = {m.name: [] for m in modes}
        peaks: dict[str, list[int]] = {m.name: [] for m in modes}
        outs: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for round_index in range(args.rounds):  # rotated, so machine drift reaches every mode alike
                for mode in modes[round_index % len(modes) :] + modes[: round_index % len(modes)]:
                    step_times, outs[mode.name], peak = _run(
                        platform, mode, 1 if mode.name == "component" else args.steps
                    )
                    if mode.name == "component":
                        step_times = [t / args.steps for t in step_times]
                    times[mode.name] += step_times
                    if peak is not None:
                        peaks[mode.name].append(peak)
    ref = outs["none"]
    results = [
        _result(m.name, times[m.name], max(peaks[m.name], default=None), outs[m.name], ref, m.note())
        for m in modes
    ]

    base = results[0].step_s
    print(f"{'mode':<10} {'step s':>8} {'(min-max)':>16} {'vs none':>8} {'peak':>10}  equal  max|diff|  note")
    for r in results:
        peak = f"{r.peak_bytes / MB:.0f} MiB" if r.peak_bytes is not None else "n/a"
        print(
            f"{r.mode:<10} {r.step_s:>8.3f} {f'({r.step_min_s:.3f}-{r.step_max_s:.3f})':>16} "
            f"{r.step_s / base - 1:>+7.1%} {peak:>10}  {str(r.equal):<5}  {r.max_abs_diff:.1e}  {r.note}"
        )
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")


if __name__ == "__main__":
    main()
