"""The memory plan: where each component's weights live, decided before anything loads.

A component is *resident* (on the device), *offloaded* (in host memory; it moves to the device for its
stage: `offload/components.py`) or, for the DiT, *layerwise* (its blocks stream to the device one at a
time: `offload/layerwise.py`); under `--max-memory` (or `--offload auto` with too little RAM) the DiT's
weights also stay memory-mapped in their files. The explicit flags place what they name; `--offload
auto` then offloads more, cheapest first, until every stage fits the device's free memory:

1. the text encoders, largest first, then the image encoder: used once per request;
2. the VAE: once per request (twice for image-to-video);
3. the whole DiT: it moves in once per request (back after the encoders or the VAE of a request ran);
4. the DiT layerwise: its blocks move in on every step, the costliest, but the only one that lowers the
   DiT's own peak.

The whole DiT comes before layerwise because it costs one DiT copy per request where layerwise costs one
per step. Once every stage fits, the offloads that a later step made unnecessary are undone, costliest
first (with the DiT out, the VAE and the small encoders fit again). A stage fits when the resident
weights, the component that moves in for it and the activation reserve
(`ACTIVATION_RESERVE_FRACTION` of the free memory; a quarter of it for the encoders' stages) fit the
free memory. Sizes come from the safetensors headers (`offload/sizes.py`), in each component's load
dtype, after `--quantization`."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import psutil
import torch

from diffserve.configs.engine_args import EngineArgs
from diffserve.errors import UserError
from diffserve.loader.model_index import ModelIndex
from diffserve.offload.sizes import ComponentSize, component_entries, size_of
from diffserve.platforms.base import Platform

logger = logging.getLogger("diffserve.offload")

Placement = Literal["resident", "offload", "layerwise"]
Role = Literal["text_encoder", "image_encoder", "vae", "dit"]

#: Free device memory kept for activations when `--offload auto` plans (the DiT's and the VAE's stages).
ACTIVATION_RESERVE_FRACTION = 0.15
#: The encoders' activations (a few hundred tokens, or one image) are this fraction of that reserve.
ENCODER_RESERVE_SHARE = 0.25
GB = 2**30

#: The explicit flags: EngineArgs field -> (the role it offloads, its placement).
_FLAGS: dict[str, tuple[Role, Placement]] = {
    "text_encoder_cpu_offload": ("text_encoder", "offload"),
    "image_encoder_cpu_offload": ("image_encoder", "offload"),
    "vae_cpu_offload": ("vae", "offload"),
    "dit_cpu_offload": ("dit", "offload"),
    "dit_layerwise_offload": ("dit", "layerwise"),
}
#: Why each automatic step costs what it does, for the log.
_AUTO_REASONS: dict[tuple[Role, Placement], str] = {
    ("text_encoder", "offload"): "used once per request",
    ("image_encoder", "offload"): "used once per request",
    ("vae", "offload"): "used once or twice per request",
    ("dit", "offload"): "moves in once per request",
    ("dit", "layerwise"): "streams its blocks every step",
}


def format_bytes(n: float) -> str:
    """`n` bytes in GiB, or MiB / KiB below one (tiny test models)."""
    for unit, scale in (("GiB", GB), ("MiB", 2**20)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 2**10:.1f} KiB"


def component_role(name: str) -> Role | None:
    """The role of a model_index.json component name; None for tokenizers, schedulers, processors."""
    if name.startswith("text_encoder"):
        return "text_encoder"
    if name.startswith("image_encoder"):
        return "image_encoder"
    if name.startswith("vae"):
        return "vae"
    if name.startswith("transformer"):
        return "dit"
    return None


def _flag(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


@dataclass(frozen=True)
class MemoryPlan:
    """Each model component's placement, with what it was decided from (for the log)."""

    mode: str  # "none" (the explicit flags only) or "auto"
    placements: dict[str, Placement]
    roles: dict[str, Role]
    sizes: dict[str, ComponentSize] = field(default_factory=dict)  # empty when nothing was planned
    reasons: dict[str, str] = field(default_factory=dict)  # why each component is not resident
    free_bytes: int | None = None  # the device's free memory the plan was made for
    reserve_bytes: int = 0
    mmap_dit: bool = False  # the DiT's weights stay memory-mapped in their files
    separate_device_memory: bool = True

    def names(self, placement: Placement) -> list[str]:
        return [name for name, p in self.placements.items() if p == placement]

    @property
    def host_components(self) -> frozenset[str]:
        """The components that load into host memory (offloaded or layerwise)."""
        return frozenset(name for name, p in self.placements.items() if p != "resident")

    @property
    def offloads_anything(self) -> bool:
        return bool(self.host_components)

    def resident_bytes(self) -> int:
        """Weights always on the device: resident components, and a layerwise DiT's non-block part."""
        total = 0
        for name, placement in self.placements.items():
            size = self.sizes.get(name)
            if size is not None and placement != "offload":
                total += size.total_bytes if placement == "resident" else size.non_block_bytes
        return total

    def moving_bytes(self, name: str) -> int:
        """What moves to the device while `name` runs: all of it if offloaded, its window if layerwise."""
        size, placement = self.sizes.get(name), self.placements[name]
        if size is None or placement == "resident":
            return 0
        return size.total_bytes if placement == "offload" else size.window_bytes

    def swap_bytes(self) -> int:
        """The most that moves in for one stage."""
        return max((self.moving_bytes(name) for name in self.placements), default=0)

    def stage_need(self, name: str) -> int:
        """Device bytes while `name`'s stage runs: resident weights, what moves in, its activations."""
        share = ENCODER_RESERVE_SHARE if self.roles[name] in ("text_encoder", "image_encoder") else 1.0
        return self.resident_bytes() + self.moving_bytes(name) + int(self.reserve_bytes * share)

    def fits(self) -> bool:
        return self.free_bytes is None or all(self.stage_need(n) <= self.free_bytes for n in self.placements)

    def describe(self) -> list[str]:
        """The plan as log lines."""
        lines = []
        if self.sizes:
            shown = ", ".join(
                f"{n} {format_bytes(s.total_bytes)}"
                for n, s in sorted(self.sizes.items(), key=lambda item: -item[1].total_bytes)
            )
            room = ""
            if self.mode == "auto":
                free = "unknown" if self.free_bytes is None else format_bytes(self.free_bytes)
                room = f"device free {free}, {format_bytes(self.reserve_bytes)} kept for activations; "
            lines.append(
                f"Memory plan (--offload {self.mode}): {room}weights (safetensors headers, load dtypes): {shown}"
            )
        else:
            lines.append(f"Memory plan (--offload {self.mode}): every component resident on the device")
        for name, placement in self.placements.items():
            if placement == "resident":
                continue
            what = "CPU offload (in host memory, moves to the device for its stage)"
            if placement == "layerwise":
                what = "layerwise offload (blocks stream to the device)"
            lines.append(f"Memory plan: {name} -> {what}: {self.reasons.get(name, '')}")
        if self.mmap_dit:
            lines.append("Memory plan: the DiT's weights stay memory-mapped in their files (read per block)")
        if self.mode == "auto" and not self.separate_device_memory:
            lines.append(
                "Memory plan: this device's memory is the host's: --offload auto offloads no component (the "
                "DiT streams from its files only when the weights exceed the free host memory)"
            )
        elif self.host_components and not self.separate_device_memory:
            lines.append(
                "Memory plan: this device's memory is the host's: offloading saves no memory here (the "
                "components still move through the offload hooks)"
            )
        if self.sizes:
            lines.append(
                f"Memory plan: resident weights {format_bytes(self.resident_bytes())}, at most "
                f"{format_bytes(self.swap_bytes())} moving in for a stage"
            )
        lines.append(f"Components that stay resident: {self.names('resident')}")
        return lines


def _auto_steps(plan: MemoryPlan, fixed: set[str]) -> list[tuple[str, Placement]]:
    """The automatic offloads in the order they are tried (the module docstring), skipping the components
    the flags placed."""
    by_size = sorted(plan.placements, key=lambda n: -plan.sizes[n].total_bytes)
    steps: list[tuple[str, Placement]] = []
    for role, placement in _AUTO_REASONS:
        steps += [(n, placement) for n in by_size if plan.roles[n] == role and n not in fixed]
    return steps


def _placed(plan: MemoryPlan, name: str, placement: Placement) -> MemoryPlan:
    reasons = {k: v for k, v in plan.reasons.items() if k != name}
    if placement != "resident":
        reasons[name] = f"--offload auto ({_AUTO_REASONS[(plan.roles[name], placement)]})"
    return replace(plan, placements={**plan.placements, name: placement}, reasons=reasons)


def _auto_place(plan: MemoryPlan, fixed: set[str]) -> MemoryPlan:
    """Offload, cheapest first, until every stage fits; then bring back, costliest first, what the later
    steps made unnecessary (offloading the DiT can leave room for the VAE and the small text encoders). A
    UserError naming the largest stage when even offloading everything does not fit."""
    applied: list[tuple[str, Placement]] = []
    for name, placement in _auto_steps(plan, fixed):
        if plan.fits():
            break
        plan = _placed(plan, name, placement)
        applied.append((name, placement))
    if plan.fits():
        for name, placement in reversed(applied):
            cheaper: list[Placement] = ["resident", "offload"] if placement == "layerwise" else ["resident"]
            for candidate in cheaper:
                if plan.placements[name] == placement and _placed(plan, name, candidate).fits():
                    plan = _placed(plan, name, candidate)
        return plan
    assert plan.free_bytes is not None
    worst = max(plan.placements, key=plan.stage_need)
    if plan.roles[worst] == "dit":
        advice = "use --quantization int8/fp8 (the DiT's weights), a smaller --dtype or a larger device"
    elif plan.roles[worst] in ("text_encoder", "image_encoder"):
        advice = "use a smaller --text-encoder-dtype or a larger device"
    else:
        advice = "use a smaller --dtype or a larger device"
    raise UserError(
        f"--offload auto: the model does not fit this device even with every component offloaded: {worst}'s "
        f"stage needs {format_bytes(plan.stage_need(worst))} ({format_bytes(plan.resident_bytes())} resident, "
        f"{format_bytes(plan.moving_bytes(worst))} moving in, the rest activations), "
        f"{format_bytes(plan.free_bytes)} are free; {advice}"
    )


def _host_bytes(plan: MemoryPlan) -> int:
    """Weights in host memory: the offloaded components (every component where host is the device),
    not a memory-mapped DiT."""
    total = 0
    for name, placement in plan.placements.items():
        in_host = placement != "resident" or not plan.separate_device_memory
        if in_host and not (plan.mmap_dit and plan.roles[name] == "dit"):
            total += plan.sizes[name].total_bytes
    return total


def _map_dit_if_short(plan: MemoryPlan, limit: int, why: str) -> MemoryPlan:
    """Memory-map (and stream per block) the DiT when the host weights exceed `limit`; a UserError when
    even that is not enough."""
    if _host_bytes(plan) <= limit:
        return plan
    dits = [n for n, role in plan.roles.items() if role == "dit"]
    mapped = replace(
        plan,
        mmap_dit=True,
        placements={**plan.placements, **{n: "layerwise" for n in dits}},
        reasons={**plan.reasons, **{n: f"{why}: memory-mapped, streamed per block" for n in dits}},
    )
    if _host_bytes(mapped) > limit:
        raise UserError(
            f"{why}: even with the DiT memory-mapped, the other components' weights take "
            f"{format_bytes(_host_bytes(mapped))} of host memory, over the {format_bytes(limit)} allowed"
        )
    return mapped


def _explicit_placements(
    engine_args: EngineArgs, roles: dict[str, Role]
) -> tuple[dict[str, Placement], dict[str, str]]:
    if engine_args.dit_cpu_offload and engine_args.dit_layerwise_offload:
        raise UserError(
            "--dit-cpu-offload and --dit-layerwise-offload are two ways to offload the DiT: pick one"
        )
    placements: dict[str, Placement] = {name: "resident" for name in roles}
    reasons: dict[str, str] = {}
    for field_name, (role, placement) in _FLAGS.items():
        if not getattr(engine_args, field_name):
            continue
        named = [n for n, r in roles.items() if r == role]
        if not named:
            logger.warning("%s: this pipeline has no %s; the flag does nothing", _flag(field_name), role)
        for name in named:
            placements[name], reasons[name] = placement, _flag(field_name)
    return placements, reasons


def plan_memory(
    index: ModelIndex,
    engine_args: EngineArgs,
    platform: Platform,
    dtype: torch.dtype,
    text_dtype: torch.dtype,
    components: Sequence[str],
    *,
    free_bytes: int | None = None,
    host_free_bytes: int | None = None,
    reserve_bytes: int | None = None,
) -> MemoryPlan:
    """The plan for loading `components` (the pipeline's, present in `index`) onto `platform`. The device's
    free memory, the host's and the activation reserve default to what the platform and the OS report
    now and `ACTIVATION_RESERVE_FRACTION` of the free memory (tests pass small ones)."""
    roles = {n: r for n in components if n in index.components and (r := component_role(n)) is not None}
    placements, reasons = _explicit_placements(engine_args, roles)
    separate = platform.has_separate_device_memory()
    plan = MemoryPlan(
        engine_args.offload, placements, roles, reasons=reasons, separate_device_memory=separate
    )
    if engine_args.offload == "auto" or engine_args.max_memory is not None or plan.offloads_anything:
        plan = _sized(plan, index, engine_args, platform, dtype, text_dtype, free_bytes, reserve_bytes)
    if engine_args.offload == "auto":
        if plan.free_bytes is None:
            raise UserError(
                f"--offload auto: {platform.name} does not report its free memory; use the explicit flags"
            )
        if separate:
            plan = _auto_place(plan, {n for n, p in placements.items() if p != "resident"})
    if engine_args.max_memory is not None:
        plan = _map_dit_if_short(
            plan, engine_args.max_memory, f"--max-memory {format_bytes(engine_args.max_memory)}"
        )
    elif engine_args.offload == "auto":
        host_free = psutil.virtual_memory().available if host_free_bytes is None else host_free_bytes
        limit = host_free if separate else host_free - plan.reserve_bytes
        plan = _map_dit_if_short(
            plan, limit, f"--offload auto: {format_bytes(host_free)} of host memory free"
        )
    if plan.mmap_dit and engine_args.quantization is not None:
        raise UserError(
            f"--quantization {engine_args.quantization} needs the DiT's weights in memory to quantize them, "
            "but the host-memory limit keeps them in their files (--max-memory or --offload auto on a host "
            "short of RAM): drop one, or raise --max-memory"
        )
    moved_dits = [n for n, p in plan.placements.items() if p != "resident" and roles[n] == "dit"]
    if engine_args.compile and moved_dits:
        raise UserError(
            f"--compile does not work with the DiT offloaded ({', '.join(moved_dits)}: "
            f"{', '.join(plan.reasons[n] for n in moved_dits)}): the offload hooks would run inside the "
            "compiled blocks; drop --compile, or offload only the encoders and the VAE"
        )
    return plan


def _sized(
    plan: MemoryPlan,
    index: ModelIndex,
    engine_args: EngineArgs,
    platform: Platform,
    dtype: torch.dtype,
    text_dtype: torch.dtype,
    free_bytes: int | None,
    reserve_bytes: int | None,
) -> MemoryPlan:
    """`plan` with its components' sizes (from their headers), the free memory and the reserve."""
    weights_file = None if engine_args.transformer_weights is None else Path(engine_args.transformer_weights)
    sizes = {}
    for name, role in plan.roles.items():
        spec = index.components[name]
        # --transformer-weights replaces the first DiT's weights only (not Wan 2.2's second expert's).
        entries = component_entries(spec, weights_file if name == "transformer" else None)
        load_dtype = text_dtype if spec.library == "transformers" else dtype
        quantization = engine_args.quantization if role == "dit" else None
        sizes[name] = size_of(entries, load_dtype, quantization)
    free = platform.memory_info().available_bytes if free_bytes is None else free_bytes
    reserve = reserve_bytes
    if reserve is None:
        reserve = 0 if free is None else int(free * ACTIVATION_RESERVE_FRACTION)
    return replace(plan, sizes=sizes, free_bytes=free, reserve_bytes=reserve)


def log_plan(plan: MemoryPlan) -> None:
    for line in plan.describe():
        logger.info("%s", line)
