"""`LoraRegistry`: the LoRA adapters one engine serves, by name.

Loading an adapter reads its file (`loader/lora_formats`), checks every target against the model (a
module of that name, a Linear of that shape), copies the pairs to the device in the model's dtype and
registers them on `LoraLinear`s (layers/lora_linear.py), wrapping the targeted Linears the first time.
Nothing else changes in the model: a request without adapters runs the base weights, bit for bit.

Requests name adapters; `acquire` turns names into `AppliedLora`s and pins them until `release`, so
an adapter is never unloaded under a running request. Adapters are known by name (from `--lora`,
`load`, or a file name inside `--lora-dir`) and resident within a byte budget (`--max-lora-memory`):
loading past it evicts the least recently used unpinned adapters, which are read again from their
file when a request names them.

`merge` is the other mode (`--lora-merge`): the adapters are added into the base weights once, for no
per-step cost; requests then cannot choose adapters.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from diffserve.configs.engine_args import LoraSpec
from diffserve.configs.sampling_params import LoraChoice
from diffserve.distributed.tensor_parallel import ParallelLinear
from diffserve.errors import LoraError
from diffserve.layers.fused_linear import FusedLinear
from diffserve.layers.lora_linear import LayerAdapter, LoraLinear, LoraPiece
from diffserve.layers.lora_rows import AppliedLora
from diffserve.layers.quantized_linear import QuantizedLinear
from diffserve.loader.dit_facts import DitFactsTable
from diffserve.loader.lora_formats import convert_lora, read_lora_file
from diffserve.loader.lora_weights import ConvertedLora, LoraWeights

logger = logging.getLogger("diffserve.lora")

#: Adapter names: what a request or the admin route may send (also a file stem inside --lora-dir).
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
#: Components LoRA applies to; the others (text encoders) are reported as ignored.
APPLIED_COMPONENTS = ("transformer",)
DEFAULT_MAX_LORA_BYTES = 2 * 2**30


@dataclass(frozen=True)
class LoraInfo:
    """What `GET /v1/loras` and `gen.loras()` show of one adapter."""

    name: str
    path: str
    family: str
    format: str
    rank: int
    num_bytes: int
    targets: int
    resident: bool
    in_use: int

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name, "path": self.path, "family": self.family, "format": self.format,
            "rank": self.rank, "bytes": self.num_bytes, "targets": self.targets, "resident": self.resident,
            "in_use": self.in_use,
        }  # fmt: skip


@dataclass
class _Resident:
    """An adapter on the device: its id, layers and size, and how many running requests pin it."""

    adapter_id: int
    converted: ConvertedLora
    layers: list[LoraLinear]
    num_bytes: int
    rank: int
    pins: int = 0
    last_used: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class _Target:
    """Where a Diffusers module path lands: `layer`'s output rows [start, stop)."""

    layer: nn.Linear
    start: int
    stop: int
    owner: nn.Module
    attribute: str


class LoraRegistry:
    """The adapters of one model (`modules`: its components by name, the DiT as `transformer`)."""

    def __init__(
        self,
        modules: Mapping[str, nn.Module],
        family: str,
        dit_class: str,
        facts: DitFactsTable,
        device: torch.device,
        dtype: torch.dtype,
        max_bytes: int = DEFAULT_MAX_LORA_BYTES,
        lora_dir: Path | None = None,
    ) -> None:
        self.family, self.dit_class, self.facts = family, dit_class, facts
        self.device, self.dtype = device, dtype
        self.max_bytes = int(max_bytes)
        self.lora_dir = None if lora_dir is None else Path(lora_dir).resolve()
        self._modules = {name: modules[name] for name in APPLIED_COMPONENTS if name in modules}
        self._paths: dict[str, Path] = {}  # every known adapter: name -> file
        self._resident: OrderedDict[str, _Resident] = OrderedDict()  # least recently used first
        self._next_id = 0
        self._merged: tuple[str, ...] = ()
        self._lock = threading.RLock()
        self._targets = self._find_targets()
        self._quantized = any(
            isinstance(m, QuantizedLinear) for root in self._modules.values() for m in root.modules()
        )
        self._tensor_parallel = any(
            isinstance(m, ParallelLinear) for root in self._modules.values() for m in root.modules()
        )

    # -- what the model offers ---------------------------------------------------------------------

    def _find_targets(self) -> dict[str, _Target]:
        """Every Diffusers module path a LoRA may target: each Linear, and each part of a fused one."""
        targets: dict[str, _Target] = {}
        for component, root in self._modules.items():
            for path, module in root.named_modules():
                if not isinstance(module, nn.Linear):
                    continue
                owner_path, _, attribute = path.rpartition(".")
                owner = root.get_submodule(owner_path)
                full = f"{component}.{path}"
                if isinstance(module, (FusedLinear, LoraLinear)) and module.part_names:
                    base = f"{component}.{owner_path}." if owner_path else f"{component}."
                    start = 0
                    for part, size in zip(module.part_names, module.part_sizes, strict=True):
                        targets[base + part] = _Target(module, start, start + size, owner, attribute)
                        start += size
                else:
                    targets[full] = _Target(module, 0, module.out_features, owner, attribute)
        return targets

    # -- loading -----------------------------------------------------------------------------------

    def resolve_path(self, name: str, path: str | Path | None) -> Path:
        """The file an adapter is read from. With `--lora-dir`, a request or the admin route may only name
        files inside it (relative, no `..`, no links out); the CLI and Python callers (`trusted`) pass
        any path as `path`."""
        if path is None:
            if self.lora_dir is None:
                raise LoraError(f"unknown LoRA {name!r}: not loaded, and this engine has no --lora-dir")
            candidates = [self.lora_dir / f"{name}.safetensors", self.lora_dir / name]
            found = next((c for c in candidates if c.exists()), None)
            if found is None:
                raise LoraError(
                    f"unknown LoRA {name!r}: not loaded, and --lora-dir has no {name}.safetensors "
                    f"(loaded: {', '.join(self.names()) or 'none'})"
                )
            return self.inside_lora_dir(found.relative_to(self.lora_dir))
        return Path(path)

    def inside_lora_dir(self, relative: str | Path) -> Path:
        """`relative` under `--lora-dir`, refusing anything that resolves outside it."""
        if self.lora_dir is None:
            raise LoraError("this engine has no --lora-dir: adapters can be named by path only at start-up")
        if Path(relative).is_absolute():
            raise LoraError(f"LoRA path {str(relative)!r} must be relative to --lora-dir")
        resolved = (self.lora_dir / relative).resolve()
        if not resolved.is_relative_to(self.lora_dir):
            raise LoraError(f"LoRA path {str(relative)!r} is outside --lora-dir")
        return resolved

    def load(self, name: str, path: str | Path, strict: bool = True) -> LoraInfo:
        """Read, check and register adapter `name` from `path` (replacing none: a taken name is an error)."""
        check_name(name)
        with self._lock:
            if self._merged:
                raise LoraError(
                    "this engine merged its LoRAs into the weights (--lora-merge): no others load"
                )
            if name in self._paths:
                raise LoraError(f"a LoRA named {name!r} is already loaded; unload it first")
            resident = self._read_and_register(name, Path(path), strict)
            self._paths[name] = Path(path)
            return self._info(name, resident)

    def _read_and_register(self, name: str, path: Path, strict: bool) -> _Resident:
        if self._quantized:
            raise LoraError(
                f"cannot load LoRA {name!r}: the DiT was loaded with --quantization (8-bit weights), and LoRA "
                "adapters need its full-precision Linears; load the model without --quantization"
            )
        if self._tensor_parallel:
            raise LoraError(
                f"cannot load LoRA {name!r}: LoRA adapters do not run with tensor parallelism yet (--tp-size > 1); "
                "use sequence or CFG parallelism (--ulysses-degree, --ring-degree, --enable-cfg-parallel)"
            )
        state_dict, metadata = read_lora_file(path)
        converted = convert_lora(
            state_dict, metadata, self.dit_class, self.facts, source=f"{name!r} ({path})"
        )
        plan = self._plan(name, path, converted, strict)
        num_bytes = sum(w.down.numel() + w.up.numel() for _, w in plan) * self.dtype.itemsize
        if num_bytes > self.max_bytes:
            raise LoraError(
                f"LoRA {name!r} needs {num_bytes / 2**20:.1f} MiB, more than --max-lora-memory "
                f"({self.max_bytes / 2**20:.1f} MiB)"
            )
        self._evict_for(num_bytes, name)
        adapter_id = self._next_id
        self._next_id += 1
        layers = self._register(adapter_id, plan)
        rank = max(w.rank for _, w in plan)
        resident = _Resident(adapter_id, converted, layers, num_bytes, rank)
        self._resident[name] = resident
        logger.info(
            "LoRA %r loaded from %s (%s format): %d layers, rank %d, %.1f MiB",
            name, path, converted.format, len(plan), rank, num_bytes / 2**20,
        )  # fmt: skip
        return resident

    def _plan(
        self, name: str, path: Path, converted: ConvertedLora, strict: bool
    ) -> list[tuple[str, LoraWeights]]:
        """The (target, weights) pairs to register; errors for a file that does not fit this model."""
        ignored_components = sorted(converted.components() - set(APPLIED_COMPONENTS))
        if ignored_components:
            logger.warning(
                "LoRA %r carries layers for %s: diffserve applies LoRA to the DiT (transformer) only, so "
                "those are ignored", name, ", ".join(ignored_components),
            )  # fmt: skip
        applied = {k: w for k, w in converted.targets.items() if k.split(".", 1)[0] in APPLIED_COMPONENTS}
        unknown = sorted(k for k in applied if k not in self._targets)
        if not applied or len(unknown) == len(applied):
            shown = ", ".join(sorted(converted.targets)[:4]) or "none"
            raise LoraError(
                f"LoRA {name!r} ({path}) matches no module of this {self.family} model "
                f"({self.dit_class}): it is for another model family. Its targets include: {shown}"
            )
        mismatched = []
        for key, weights in applied.items():
            target = self._targets.get(key)
            if target is None:
                continue
            want = (target.stop - target.start, target.layer.in_features)
            if (weights.out_features, weights.in_features) != want:
                mismatched.append(
                    f"{key} (file {weights.out_features}x{weights.in_features}, model {want[0]}x{want[1]})"
                )
        if mismatched:
            raise LoraError(
                f"LoRA {name!r} ({path}) does not fit this {self.family} model: shapes differ for "
                f"{', '.join(mismatched[:4])}{' ...' if len(mismatched) > 4 else ''}"
            )
        problems = [*unknown, *converted.unsupported]
        if problems and strict:
            raise LoraError(
                f"LoRA {name!r} ({path}) has {len(problems)} entries this {self.family} model cannot apply "
                f"({', '.join(problems[:6])}{' ...' if len(problems) > 6 else ''}); load it with strict=False "
                "to apply the rest"
            )
        if problems:
            logger.warning("LoRA %r: ignoring %d entries: %s", name, len(problems), ", ".join(problems))
        return [(k, w) for k, w in sorted(applied.items()) if k in self._targets]

    def _register(self, adapter_id: int, plan: list[tuple[str, LoraWeights]]) -> list[LoraLinear]:
        """Copy the pairs to the device and add one `LayerAdapter` per layer (parts of a fused layer stack
        their `down`s into one matmul)."""
        by_layer: dict[int, list[tuple[_Target, LoraWeights]]] = {}
        for key, weights in plan:
            target = self._targets[key]
            by_layer.setdefault(id(target.layer), []).append((target, weights))
        layers = []
        for entries in by_layer.values():
            layer = self._wrap(entries[0][0])
            entries.sort(key=lambda entry: entry[0].start)
            downs, pieces, rank_start = [], [], 0
            for target, weights in entries:
                downs.append(weights.down)
                up = weights.up.to(self.device, self.dtype)
                rank_stop = rank_start + weights.rank
                pieces.append(
                    LoraPiece(target.start, target.stop, rank_start, rank_stop, up, weights.scaling)
                )
                rank_start = rank_stop
            down = torch.cat(downs).to(self.device, self.dtype)
            layer.adapters[adapter_id] = LayerAdapter(down, tuple(pieces))
            layers.append(layer)
        return layers

    def _wrap(self, target: _Target) -> LoraLinear:
        """The `LoraLinear` at `target`'s place, made the first time (every part of a fused layer shares it)."""
        if isinstance(target.layer, LoraLinear):
            return target.layer
        layer = LoraLinear(target.layer)
        setattr(target.owner, target.attribute, layer)
        for key, other in list(self._targets.items()):
            if other.layer is target.layer:
                self._targets[key] = _Target(layer, other.start, other.stop, other.owner, other.attribute)
        return layer

    def wrap_every_linear(self) -> int:
        """Wrap every targetable Linear now (before `torch.compile`, so adapters never change the compiled
        modules); returns how many layers were wrapped."""
        with self._lock:
            layers = {id(t.layer): t for t in self._targets.values()}
            for target in layers.values():
                self._wrap(target)
            return len(layers)

    def _evict_for(self, num_bytes: int, loading: str) -> None:
        """Unload least recently used unpinned adapters until `num_bytes` more fit the budget."""
        used = sum(r.num_bytes for r in self._resident.values())
        for name in list(self._resident):
            if used + num_bytes <= self.max_bytes:
                return
            resident = self._resident[name]
            if resident.pins:
                continue
            self._drop(name)
            used -= resident.num_bytes
            logger.info("LoRA %r evicted (least recently used) to make room for %r", name, loading)
        if used + num_bytes > self.max_bytes:
            raise LoraError(
                f"LoRA {loading!r} needs {num_bytes / 2**20:.1f} MiB and the adapters in use hold "
                f"{used / 2**20:.1f} MiB of --max-lora-memory ({self.max_bytes / 2**20:.1f} MiB); retry later"
            )

    def _drop(self, name: str) -> None:
        resident = self._resident.pop(name)
        for layer in resident.layers:
            layer.adapters.pop(resident.adapter_id, None)

    # -- requests ----------------------------------------------------------------------------------

    def acquire(self, choices: Sequence[LoraChoice]) -> tuple[AppliedLora, ...]:
        """The adapters a request applies, pinned until `release` (unknown names: LoraError naming them;
        a name inside `--lora-dir` that is not loaded yet is loaded now)."""
        if not choices:
            return ()
        with self._lock:
            if self._merged:
                raise LoraError(
                    f"this engine merged its LoRAs into the weights ({', '.join(self._merged)}, --lora-merge): "
                    "requests cannot choose adapters"
                )
            seen = set()
            for choice in choices:
                if choice.name in seen:
                    raise LoraError(f"LoRA {choice.name!r} is listed twice in one request")
                seen.add(choice.name)
            applied = []
            try:
                for choice in choices:
                    resident = self._resident_for(choice.name)
                    resident.pins += 1
                    resident.last_used = time.monotonic()
                    self._resident.move_to_end(choice.name)
                    applied.append(AppliedLora(resident.adapter_id, choice.name, float(choice.scale)))
            except LoraError:
                self.release(applied)
                raise
            return tuple(applied)

    def check_known(self, names: Sequence[str]) -> None:
        """LoraError naming the first adapter that is neither loaded nor a file inside `--lora-dir`."""
        with self._lock:
            if self._merged and names:
                self.acquire([LoraChoice(names[0])])  # raises the merged-mode error
            for name in names:
                if name not in self._paths:
                    check_name(name)
                    self.resolve_path(name, None)

    def _resident_for(self, name: str) -> _Resident:
        resident = self._resident.get(name)
        if resident is not None:
            return resident
        path = self._paths.get(name)
        if path is None:
            check_name(name)
            path = self.resolve_path(name, None)
            resident = self._read_and_register(name, path, strict=False)
            self._paths[name] = path
            return resident
        return self._read_and_register(name, path, strict=False)

    def release(self, applied: Iterable[AppliedLora]) -> None:
        """The request no longer runs: unpin its adapters."""
        with self._lock:
            by_id = {r.adapter_id: r for r in self._resident.values()}
            for lora in applied:
                resident = by_id.get(lora.adapter_id)
                if resident is not None and resident.pins:
                    resident.pins -= 1

    def unload(self, name: str) -> None:
        """Forget adapter `name`; refused while a running request uses it."""
        with self._lock:
            if name not in self._paths:
                raise LoraError(f"unknown LoRA {name!r} (loaded: {', '.join(self.names()) or 'none'})")
            resident = self._resident.get(name)
            if resident is not None and resident.pins:
                raise LoraError(
                    f"LoRA {name!r} is used by {resident.pins} running request(s); retry when they finish"
                )
            if resident is not None:
                self._drop(name)
            del self._paths[name]
            logger.info("LoRA %r unloaded", name)

    # -- merging -----------------------------------------------------------------------------------

    def merge(self, choices: Sequence[LoraChoice]) -> None:
        """Add the named (loaded) adapters into the base weights at their scales, once, and drop them from
        the per-row path: every request runs the merged model, at no per-step cost."""
        with self._lock:
            for choice in choices:
                resident = self._resident.get(choice.name)
                if resident is None:
                    raise LoraError(f"cannot merge unknown LoRA {choice.name!r}")
                plan = [(k, w) for k, w in resident.converted.targets.items() if k in self._targets]
                with torch.no_grad():
                    for key, weights in plan:
                        target = self._targets[key]
                        rows = target.layer.weight[target.start : target.stop]
                        delta = weights.delta_weight().to(rows.device) * float(choice.scale)
                        rows.copy_((rows.float() + delta).to(rows.dtype))
                self._drop(choice.name)
            self._merged = tuple(c.name for c in choices)
            logger.info(
                "LoRA merged into the weights: %s (no per-step LoRA cost; requests cannot choose adapters)",
                ", ".join(f"{c.name} x{c.scale:g}" for c in choices),
            )

    # -- reporting ---------------------------------------------------------------------------------

    def names(self) -> list[str]:
        return sorted(self._paths)

    @property
    def merged(self) -> tuple[str, ...]:
        return self._merged

    @property
    def resident_bytes(self) -> int:
        return sum(r.num_bytes for r in self._resident.values())

    def infos(self) -> list[LoraInfo]:
        with self._lock:
            return [self._info(name, self._resident.get(name)) for name in self.names()]

    def _info(self, name: str, resident: _Resident | None) -> LoraInfo:
        return LoraInfo(
            name=name, path=str(self._paths.get(name, "")), family=self.family,
            format="" if resident is None else resident.converted.format,
            rank=0 if resident is None else resident.rank,
            num_bytes=0 if resident is None else resident.num_bytes,
            targets=0 if resident is None else sum(len(layer.adapters[resident.adapter_id].pieces) for layer in resident.layers),
            resident=resident is not None, in_use=0 if resident is None else resident.pins,
        )  # fmt: skip


def check_name(name: object) -> str:
    """A LoRA name as requests send it: letters, digits, `._-`, at most 128 characters."""
    if not isinstance(name, str) or not NAME_PATTERN.match(name) or ".." in name:
        raise LoraError(
            f"LoRA name {name!r} is not valid: use 1-128 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit"
        )
    return name


def start_lora_registry(
    modules: Mapping[str, nn.Module],
    family: str,
    dit_class: str,
    facts: DitFactsTable,
    device: torch.device,
    dtype: torch.dtype,
    specs: Sequence[LoraSpec] = (),
    lora_dir: str | None = None,
    merge: bool = False,
    max_bytes: int = DEFAULT_MAX_LORA_BYTES,
    compiled: bool = False,
) -> LoraRegistry:
    """The registry an engine starts with: `specs` loaded (strictly) and, with `merge`, merged into the
    weights. With `compiled` and LoRA in use, every DiT Linear is wrapped now, before compilation, so
    that later adapters never change the compiled modules."""
    if lora_dir is not None and not Path(lora_dir).is_dir():
        raise LoraError(f"--lora-dir {lora_dir} is not a directory")
    if merge and not specs:
        raise LoraError("--lora-merge needs at least one --lora to merge")
    registry = LoraRegistry(
        modules,
        family,
        dit_class,
        facts,
        device,
        dtype,
        max_bytes,
        None if lora_dir is None else Path(lora_dir),
    )
    for spec in specs:
        registry.load(spec.name, spec.path)
    if merge:
        registry.merge([LoraChoice(spec.name, spec.scale) for spec in specs])
    elif compiled and (specs or lora_dir is not None):
        registry.wrap_every_linear()
    return registry
