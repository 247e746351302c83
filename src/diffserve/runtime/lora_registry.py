"""`LoraRegistry`: the LoRA adapters one engine serves, by name.

Loading an adapter reads its file (`loader/lora_formats`), checks every target against the model (a
module of that name, a Linear of that shape), copies the pairs to the device in the model's dtype and
registers them on `LoraLinear`s (layers/lora_linear.py), wrapping the targeted Linears the first time.
Nothing else changes in the model: a request without adapters runs the base weights, bit for bit.

Requests name adapters. An admitted request `hold`s the ones it names until it ends (queued or
running): unloading one is refused meanwhile, and a name of `--lora-dir` is bound to its file from then
on. `acquire` turns names into `AppliedLora`s and pins them until `release` (running requests). Adapters
are known by name (from `--lora`, `load`, or a file name inside `--lora-dir`), at most `--max-loras` of
them, and resident within a byte budget (`--max-lora-memory`): loading past it evicts the least recently
used unpinned adapters, which are read again from their file when a request names them.

Reading a file is the slow part (safetensors_file.py caps what a file may declare), and it never runs
between two denoising steps when it can run before: `prepare` reads, converts and checks a file on the
caller's thread (the admin routes' worker) and `load` then only registers it; the adapters a request
names that are not resident are read by a background reader when it is admitted, and the request
starts once they are read (`ready`). A file that failed is remembered by its identity (path, size,
mtime, inode) and refused at once until it changes.

`merge` is the other mode (`--lora-merge`): the adapters are added into the base weights once, for no
per-step cost; requests then cannot choose adapters.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for_futures
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from diffserve.configs.engine_args import LoraSpec
from diffserve.configs.sampling_params import LoraChoice
from diffserve.errors import LoraBusyError, LoraError, LoraLimitError
from diffserve.layers.fused_linear import FusedLinear
from diffserve.layers.gguf_linear import quantized_layer_kinds
from diffserve.layers.lora_linear import LayerAdapter, LoraLinear, LoraPiece
from diffserve.layers.lora_rows import AppliedLora
from diffserve.layers.tensor_parallel import ParallelLinear
from diffserve.loader.dit_facts import DitFactsTable
from diffserve.loader.lora_formats import convert_lora, read_lora_file
from diffserve.loader.lora_formats.safetensors_file import lora_file_checked
from diffserve.loader.lora_weights import ConvertedLora, LoraWeights

logger = logging.getLogger("diffserve.lora")

#: Adapter names: what a request or the admin route may send (also a file stem inside --lora-dir).
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")  # \Z: "a\n" is no name
#: Components LoRA applies to; the others (text encoders) are reported as ignored.
APPLIED_COMPONENTS = ("transformer",)
DEFAULT_MAX_LORA_BYTES = 2 * 2**30
#: The most adapters one engine knows at once (`--max-loras`).
DEFAULT_MAX_LORAS = 64
#: Failed files remembered (by identity), each refused at once when named again.
MAX_REMEMBERED_FAILURES = 256


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
    in_use: int  # requests naming it, queued or running (unloading it is refused meanwhile)
    queued: int = 0  # of them, the ones still queued

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name, "path": self.path, "family": self.family, "format": self.format,
            "rank": self.rank, "bytes": self.num_bytes, "targets": self.targets, "resident": self.resident,
            "in_use": self.in_use, "queued": self.queued,
        }  # fmt: skip


@dataclass(frozen=True)
class FileIdentity:
    """What tells one state of an adapter file from another: a failed file is refused at once while its
    identity stays the same."""

    path: str
    size: int
    mtime_ns: int
    inode: int

    @classmethod
    def of(cls, path: Path) -> FileIdentity:
        """The identity of the file `path` names (itself, or the one safetensors file of a folder);
        LoraError for a missing file or a path the OS refuses."""
        file = lora_file_checked(path)
        try:
            st = file.stat()
        except OSError as exc:
            raise LoraError(f"LoRA file {file} cannot be read: {exc.strerror or exc}") from None
        return cls(str(file), st.st_size, st.st_mtime_ns, st.st_ino)


@dataclass(frozen=True)
class PreparedLora:
    """An adapter file read, converted and checked against the model, its pairs in the model's dtype on
    the CPU (`plan`: target -> pair): what registering it copies to the device, between two steps."""

    name: str
    path: Path
    identity: FileIdentity
    strict: bool
    format: str
    plan: list[tuple[str, LoraWeights]]
    num_bytes: int
    rank: int


@dataclass
class _Resident:
    """An adapter on the device: its id, layers and size, and how many running requests pin it."""

    adapter_id: int
    format: str
    plan: list[tuple[str, LoraWeights]]
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
        max_count: int = DEFAULT_MAX_LORAS,
    ) -> None:
        self.family, self.dit_class, self.facts = family, dit_class, facts
        self.device, self.dtype = device, dtype
        self.max_bytes = int(max_bytes)
        self.max_count = int(max_count)
        self.lora_dir = None if lora_dir is None else Path(lora_dir).resolve()
        self._modules = {name: modules[name] for name in APPLIED_COMPONENTS if name in modules}
        self._paths: dict[str, Path] = {}  # every known adapter: name -> file
        #: Known only because a request named a file of --lora-dir: forgotten when idle to make room.
        self._from_dir: set[str] = set()
        self._resident: OrderedDict[str, _Resident] = OrderedDict()  # least recently used first
        self._holds: dict[int, tuple[str, ...]] = {}  # an admitted request (its key) -> the adapters it names
        self._reads: dict[str, Future[PreparedLora]] = {}  # files read ahead of `load` / `acquire`, by name
        self._reader: ThreadPoolExecutor | None = None  # reads the adapters of admitted requests
        self._failures: OrderedDict[tuple[FileIdentity, bool], str] = OrderedDict()  # (file, strict) -> why
        self._failures_lock = threading.Lock()
        self._next_id = 0
        self._merged: tuple[str, ...] = ()
        self._lock = threading.RLock()
        self._targets = self._find_targets()
        self._quantized = sum((quantized_layer_kinds(root) for root in self._modules.values()), Counter())
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
            found = next((c for c in candidates if _exists(c)), None)
            if found is None:
                raise LoraError(
                    f"unknown LoRA {name!r}: not loaded, and --lora-dir has no {name}.safetensors "
                    f"(loaded: {', '.join(self.names()) or 'none'})"
                )
            return self.inside_lora_dir(found.relative_to(self.lora_dir))
        return Path(path)

    def inside_lora_dir(self, relative: str | Path) -> Path:
        """`relative` under `--lora-dir`, refusing anything that resolves outside it (and a path the OS
        refuses: a NUL byte, a name too long, a loop of links)."""
        if self.lora_dir is None:
            raise LoraError("this engine has no --lora-dir: adapters can be named by path only at start-up")
        if "\x00" in str(relative):
            raise LoraError("LoRA path must not contain a NUL byte")
        shown = (
            str(relative) if len(str(relative)) <= 200 else f"{str(relative)[:120]}...{str(relative)[-60:]}"
        )
        if Path(relative).is_absolute():
            raise LoraError(f"LoRA path {shown!r} must be relative to --lora-dir")
        try:
            resolved = (self.lora_dir / relative).resolve()
        except (OSError, RuntimeError, ValueError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise LoraError(f"LoRA path {shown!r} cannot be used: {reason}") from None
        if not resolved.is_relative_to(self.lora_dir):
            raise LoraError(f"LoRA path {shown!r} is outside --lora-dir")
        return resolved

    def prepare(self, name: str, path: str | Path, strict: bool = True) -> PreparedLora:
        """Read adapter `name`'s file at `path`, convert it and check it against the model, changing
        nothing: the slow part of `load`, for a thread other than the one that runs the steps (the admin
        routes' worker, `DiffGenerator.load_lora`). The next `load` of `name` from that file (unchanged)
        registers this. A file that failed is refused at once until it changes."""
        check_name(name)
        with self._lock:
            self._check_loadable(name)  # a taken name or no room: refused before reading
        prepared = self._prepare(name, Path(path), strict)
        done: Future[PreparedLora] = Future()
        done.set_result(prepared)
        with self._lock:
            self._reads[name] = done
        return prepared

    def load(self, name: str, path: str | Path, strict: bool = True) -> LoraInfo:
        """Read, check and register adapter `name` from `path` (replacing none: a taken name is an error).
        Registering runs here; reading too, unless `prepare` read this file already."""
        check_name(name)
        path = Path(path)
        with self._lock:
            try:
                self._check_loadable(name)
            except LoraError:
                if name not in self._paths:  # what `prepare` kept for this load (a held name's read stays)
                    self._reads.pop(name, None)
                raise
            prepared = self._take_read(name, path, strict, wait=False)
        if prepared is None:
            prepared = self._prepare(name, path, strict)
        with self._lock:
            self._check_loadable(name)
            resident = self._register(name, prepared)
            self._paths[name] = path
            return self._info(name, resident)

    def know(self, name: str, path: str | Path) -> LoraInfo:
        """Know adapter `name` from `path` without reading it: it is read when a request names it (as a
        file of --lora-dir is). For the adapters a restarted engine gets back (`lora_client.restore`):
        replaying them costs a `stat` each, not a read."""
        check_name(name)
        path = Path(path)
        FileIdentity.of(path)  # a file is there
        with self._lock:
            self._check_loadable(name)
            self._paths[name] = path
            return self._info(name, None)

    def _check_loadable(self, name: str) -> None:
        """(Under the lock.) The name is free, and there is room for one more adapter."""
        if self._merged:
            raise LoraError("this engine merged its LoRAs into the weights (--lora-merge): no others load")
        if name in self._paths:
            raise LoraError(f"a LoRA named {name!r} is already loaded; unload it first")
        self._make_room(name)

    def _make_room(self, name: str) -> None:
        """(Under the lock.) Room for adapter `name` among at most `max_count` known ones: an idle adapter
        known only because a request named its --lora-dir file is forgotten (it is found again by name);
        LoraLimitError when none is."""
        if name in self._paths or len(self._paths) < self.max_count:
            return
        idle = [
            n for n in self._paths
            if n in self._from_dir and not self._held(n) and not getattr(self._resident.get(n), "pins", 0)
        ]  # fmt: skip
        if idle:
            # not resident first, then the least recently used
            order = {n: i for i, n in enumerate(self._resident)}
            self._forget(min(idle, key=lambda n: (n in self._resident, order.get(n, -1))))
            return
        raise LoraLimitError(
            f"cannot load LoRA {name!r}: this engine knows {len(self._paths)} adapters already, its limit "
            f"(--max-loras {self.max_count}); unload one first (DELETE /v1/loras/NAME)"
        )

    def _forget(self, name: str) -> None:
        """(Under the lock.) Drop every trace of adapter `name`."""
        if name in self._resident:
            self._drop(name)
        self._paths.pop(name, None)
        self._from_dir.discard(name)
        future = self._reads.pop(name, None)
        if future is not None:
            future.cancel()

    def _check_usable(self, name: str) -> None:
        if self._quantized:
            kinds = ", ".join(f"{kind} x {n}" for kind, n in self._quantized.most_common())
            raise LoraError(
                f"cannot load LoRA {name!r}: the DiT computes with quantized weights ({kinds} layers: "
                "--quantization, or an FP8 / GGUF --transformer-weights file kept quantized), and LoRA "
                "adapters need its full-precision Linears; load the model without --quantization, or from "
                "full-precision weights"
            )
        if self._tensor_parallel:
            raise LoraError(
                f"cannot load LoRA {name!r}: LoRA adapters do not run with tensor parallelism yet (--tp-size > 1); "
                "use sequence or CFG parallelism (--ulysses-degree, --ring-degree, --enable-cfg-parallel)"
            )

    def _prepare(self, name: str, path: Path, strict: bool) -> PreparedLora:
        """Read, convert and check (no lock needed: the model is only read). LoraErrors are remembered by
        the file's identity."""
        self._check_usable(name)
        identity = FileIdentity.of(path)
        key = (identity, strict)
        with self._failures_lock:
            reason = self._failures.get(key)
        if reason is not None:
            raise LoraError(f"{reason} (this file failed to load before; it is read again once it changes)")
        try:
            state_dict, metadata = read_lora_file(Path(identity.path))
            converted = convert_lora(
                state_dict, metadata, self.dit_class, self.facts, source=f"{name!r} ({path})"
            )
        except LoraError as exc:  # the file itself: whatever `strict` says
            self._remember(str(exc), (identity, True), (identity, False))
            raise
        del state_dict
        try:
            plan = self._plan(name, path, converted, strict)
            num_bytes = sum(w.down.numel() + w.up.numel() for _, w in plan) * self.dtype.itemsize
            if num_bytes > self.max_bytes:
                raise LoraError(
                    f"LoRA {name!r} needs {num_bytes / 2**20:.1f} MiB, more than --max-lora-memory "
                    f"({self.max_bytes / 2**20:.1f} MiB)"
                )
        except LoraError as exc:
            self._remember(str(exc), key)
            raise
        cast = [(k, LoraWeights(w.down.to(self.dtype), w.up.to(self.dtype), w.alpha)) for k, w in plan]
        rank = max(w.rank for _, w in plan)
        return PreparedLora(name, path, identity, strict, converted.format, cast, num_bytes, rank)

    def _remember(self, reason: str, *keys: tuple[FileIdentity, bool]) -> None:
        with self._failures_lock:
            for key in keys:
                self._failures[key] = reason
            while len(self._failures) > MAX_REMEMBERED_FAILURES:
                self._failures.popitem(last=False)

    def _failed_before(self, path: Path, strict: bool) -> str | None:
        """Why the file at `path` failed before, if it did and has not changed since."""
        try:
            identity = FileIdentity.of(path)
        except LoraError as exc:
            return str(exc)
        with self._failures_lock:
            return self._failures.get((identity, strict))

    def _take_read(self, name: str, path: Path, strict: bool, wait: bool) -> PreparedLora | None:
        """(Under the lock.) The read of `name`'s file made ahead, if there is one of that file as it is now
        (`wait`: one still running is waited for); its LoraError when that read failed."""
        future = self._reads.get(name)
        if future is None or not (wait or future.done()):
            return None
        del self._reads[name]
        if future.cancelled():
            return None
        prepared = future.result()  # a failed read raises its LoraError
        if prepared.path != path or prepared.strict != strict or prepared.identity != FileIdentity.of(path):
            return None
        return prepared

    def _register(self, name: str, prepared: PreparedLora) -> _Resident:
        """(Under the lock, between two steps.) Make room in the budget, copy the pairs to the device and
        add them to their layers."""
        self._evict_for(prepared.num_bytes, name)
        adapter_id = self._next_id
        self._next_id += 1
        layers = self._attach(adapter_id, prepared.plan)
        resident = _Resident(
            adapter_id, prepared.format, prepared.plan, layers, prepared.num_bytes, prepared.rank
        )
        self._resident[name] = resident
        logger.info(
            "LoRA %r loaded from %s (%s format): %d layers, rank %d, %.1f MiB",
            name, prepared.path, prepared.format, len(prepared.plan), prepared.rank, prepared.num_bytes / 2**20,
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
        plan = [(k, w) for k, w in sorted(applied.items()) if k in self._targets]
        empty = [k for k, w in plan if w.rank == 0]
        if empty:
            raise LoraError(
                f"LoRA {name!r} ({path}) has rank 0 ({', '.join(empty[:4])}{' ...' if len(empty) > 4 else ''}): "
                "an empty adapter changes nothing"
            )
        return plan

    def _attach(self, adapter_id: int, plan: list[tuple[str, LoraWeights]]) -> list[LoraLinear]:
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
            raise LoraBusyError(
                f"LoRA {loading!r} needs {num_bytes / 2**20:.1f} MiB and the adapters running requests use hold "
                f"{used / 2**20:.1f} MiB of --max-lora-memory ({self.max_bytes / 2**20:.1f} MiB); retry when "
                "they finish"
            )

    def _drop(self, name: str) -> None:
        resident = self._resident.pop(name)
        for layer in resident.layers:
            layer.adapters.pop(resident.adapter_id, None)

    # -- requests ----------------------------------------------------------------------------------

    # -- requests ----------------------------------------------------------------------------------

    def hold(self, key: int, names: Sequence[str]) -> None:
        """An admitted request (`key`, unique while it lives) names `names`: each must be known or a file of
        --lora-dir (bound to that name from now on), and not a file that failed before (refused at once,
        with the reason). Held until `unhold(key)` (the request ended): unloading one is refused meanwhile.
        The ones not resident are read by a background reader now (`ready`)."""
        if not names:
            return
        with self._lock:
            if self._merged:
                raise LoraError(
                    f"this engine merged its LoRAs into the weights ({', '.join(self._merged)}, --lora-merge): "
                    "requests cannot choose adapters"
                )
            bound: list[str] = []
            try:
                for name in names:
                    if name not in self._paths:
                        check_name(name)
                        path = self.resolve_path(name, None)
                        self._make_room(name)
                        self._paths[name] = path
                        self._from_dir.add(name)
                        bound.append(name)
                    if name not in self._resident and name not in self._reads:
                        reason = self._failed_before(self._paths[name], strict=False)
                        if reason is not None:
                            raise LoraError(f"LoRA {name!r} cannot be used: {reason}")
            except LoraError:
                for name in bound:
                    self._forget(name)
                raise
            self._holds[key] = tuple(names)
            for name in names:
                self._read_ahead(name)

    def unhold(self, key: int) -> None:
        """The request `key` ended (finished, cancelled, failed or never queued): its adapters are free to
        unload. A --lora-dir adapter nobody holds that was never read (or failed) is forgotten."""
        with self._lock:
            for name in self._holds.pop(key, ()):
                if self._held(name):
                    continue
                if name not in self._resident:
                    future = self._reads.pop(name, None)
                    if future is not None:
                        future.cancel()
                    if name in self._from_dir:
                        self._paths.pop(name, None)
                        self._from_dir.discard(name)

    def ready(self, key: int) -> bool:
        """Whether the request `key` can start: every adapter it holds is resident or read (a failed read
        counts: starting, it fails with that error), and the ones to register fit the budget beside the
        adapters running requests pin (or none are pinned: then it fails or fits for good)."""
        with self._lock:
            names = self._holds.get(key, ())
            needed = 0
            for name in names:
                if name in self._resident:
                    continue
                future = self._reads.get(name)
                if future is None:
                    self._read_ahead(name)  # evicted since it was admitted
                    return False
                if not future.done():
                    return False
                if not future.cancelled() and future.exception() is None:
                    needed += future.result().num_bytes
            pinned = sum(r.num_bytes for r in self._resident.values() if r.pins)
            return needed == 0 or pinned == 0 or pinned + needed <= self.max_bytes

    def wait_for_reads(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for one of the reads in progress; False when none is."""
        with self._lock:
            pending = [f for f in self._reads.values() if not f.done()]
        if pending:
            wait_for_futures(pending, timeout, return_when=FIRST_COMPLETED)
        return bool(pending)

    def _read_ahead(self, name: str) -> None:
        """(Under the lock.) Start reading known adapter `name` on the background reader, unless it is
        resident or being read."""
        if name in self._resident or name in self._reads or name not in self._paths:
            return
        if self._reader is None:
            self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-read")
        self._reads[name] = self._reader.submit(self._prepare, name, self._paths[name], False)

    def _held(self, name: str) -> int:
        """(Under the lock.) How many admitted requests hold adapter `name`."""
        return sum(name in names for names in self._holds.values())

    def acquire(self, choices: Sequence[LoraChoice]) -> tuple[AppliedLora, ...]:
        """The adapters a request applies, pinned until `release` (unknown names: LoraError naming them;
        one not resident is registered now, from its read made ahead when there is one)."""
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
        new = path is None
        if path is None:  # named by a caller that did not `hold` it
            check_name(name)
            path = self.resolve_path(name, None)
            self._make_room(name)
        prepared = self._take_read(name, path, strict=False, wait=True)
        if prepared is None:
            prepared = self._prepare(name, path, strict=False)
        resident = self._register(name, prepared)
        if new:
            self._paths[name] = path
            self._from_dir.add(name)
        return resident

    def release(self, applied: Iterable[AppliedLora]) -> None:
        """The request no longer runs: unpin its adapters."""
        with self._lock:
            by_id = {r.adapter_id: r for r in self._resident.values()}
            for lora in applied:
                resident = by_id.get(lora.adapter_id)
                if resident is not None and resident.pins:
                    resident.pins -= 1

    def unload(self, name: str) -> None:
        """Forget adapter `name`; refused while a request (queued or running) names it."""
        with self._lock:
            if name not in self._paths:
                raise LoraError(f"unknown LoRA {name!r} (loaded: {', '.join(self.names()) or 'none'})")
            in_use = self._in_use(name)
            if in_use:
                raise LoraError(f"LoRA {name!r} is used by {describe_use(*in_use)}; retry when they finish")
            self._forget(name)
            logger.info("LoRA %r unloaded", name)

    def _in_use(self, name: str) -> tuple[int, int] | None:
        """(Under the lock.) (running, queued) requests naming adapter `name`; None when there is none."""
        resident = self._resident.get(name)
        running = 0 if resident is None else resident.pins
        total = max(self._held(name), running)
        return (running, total - running) if total else None

    # -- merging -----------------------------------------------------------------------------------

    def merge(self, choices: Sequence[LoraChoice]) -> None:
        """Add the named (loaded) adapters into the base weights at their scales, once, and drop them from
        the per-row path: every request runs the merged model, at no per-step cost."""
        with self._lock:
            for choice in choices:
                resident = self._resident.get(choice.name)
                if resident is None:
                    raise LoraError(f"cannot merge unknown LoRA {choice.name!r}")
                plan = resident.plan
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
        running, queued = self._in_use(name) or (0, 0)
        return LoraInfo(
            name=name, path=str(self._paths.get(name, "")), family=self.family,
            format="" if resident is None else resident.format,
            rank=0 if resident is None else resident.rank,
            num_bytes=0 if resident is None else resident.num_bytes,
            targets=0 if resident is None else sum(len(layer.adapters[resident.adapter_id].pieces) for layer in resident.layers),
            resident=resident is not None, in_use=running + queued, queued=queued,
        )  # fmt: skip


def describe_use(running: int, queued: int) -> str:
    """`2 requests (1 running, 1 queued)`."""
    total = running + queued
    return f"{total} request{'' if total == 1 else 's'} ({running} running, {queued} queued)"


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError):  # a name the OS refuses names no file
        return False


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
    max_count: int = DEFAULT_MAX_LORAS,
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
        max_count,
    )
    for spec in specs:
        registry.load(spec.name, spec.path)
    if merge:
        registry.merge([LoraChoice(spec.name, spec.scale) for spec in specs])
    elif compiled and (specs or lora_dir is not None):
        registry.wrap_every_linear()
    return registry
