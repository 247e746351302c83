"""Component CPU offload (`--text-encoder-cpu-offload`, `--image-encoder-cpu-offload`, `--vae-cpu-offload`,
`--dit-cpu-offload`): an offloaded component's weights live in host memory (pinned where the platform
has it) and move to the device when the component is used.

Policy: **an offloaded component stays on the device from its first use until another component is
used**, then it is evicted (its parameters point at their host copies again; nothing is copied back, the
weights do not change at inference). So at most one offloaded component is on the device at a time, next
to the resident ones, and it stays there for the whole of its stage (the DiT for all of a request's steps,
the VAE for every decoder call) instead of moving per call. The memory model counts exactly that
(`runtime/memory.py`: resident weights, plus the largest offloaded component moving in).

A use is seen by forward pre-hooks on a component's root, its direct children and every submodule that
owns parameters or buffers directly, so that methods other than `forward` (a VAE's `decode`, a text
encoder's `.model(...)`, Wan's `embed_context`) trigger the move too. A resident component has them too,
so that the offloaded ones leave before its stage's activations need the room, except inside its
repeated blocks (they run from its forward, and `--compile` compiles them: no hooks in the graphs).
An offloaded component's hooks also move tensor arguments that are on another device to
the device: the stages place their inputs where the component's parameters were when they looked, which
was the host when it was offloaded.

Every copy goes through the platform (`Platform.pin_host` / `to_device` / `to_host`), so the code is the
same on every accelerator and a test platform can count what is on its device
(`testing/counting_platform.py`). Single-threaded, as the engine's loop that runs the model is."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from diffserve.offload.layerwise import install_layerwise_offload
from diffserve.offload.plan import MemoryPlan, Placement
from diffserve.offload.sizes import LAYERWISE_WINDOW_BLOCKS
from diffserve.platforms.base import Platform
from diffserve.runtime.compile import find_block_lists
from diffserve.runtime.memory import WeightResidency

logger = logging.getLogger("diffserve.offload")

#: The attribute of an offloaded pipeline's component modules that holds their `OffloadGroup`.
GROUP_ATTRIBUTE = "_diffserve_offload_group"
MB = 2**20


class LayerwiseDit(Protocol):
    """What the group reads of a layerwise-offloaded DiT (`offload/layerwise.py::LayerwiseOffload`)."""

    @property
    def max_block_bytes(self) -> int: ...

    @property
    def resident_block_bytes(self) -> int: ...

    def remove(self) -> None: ...


def _direct_tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    for tensor in [*module._parameters.values(), *module._buffers.values()]:
        if tensor is not None:
            yield tensor


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _assign(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """Make the module's `tensor` object hold `value`'s data, keeping its identity (the modules, tied
    weights and LoRA wrappers that share it see the move). `.data` where the two tensor types allow it
    (CPU, CUDA, ROCm, XPU, MPS); else `torch.utils.swap_tensors` with a fresh alias (out-of-tree backends
    such as NPU and MUSA), so the host copy itself never changes."""
    if torch._has_compatible_shallow_copy_type(tensor, value):
        tensor.data = value
        return
    alias = value.detach()
    if isinstance(tensor, nn.Parameter):
        alias = nn.Parameter(alias, requires_grad=False)
    torch.utils.swap_tensors(tensor, alias)


def _unique_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer of `module` once (a tied weight is one Parameter object)."""
    seen: dict[int, torch.Tensor] = {}
    for sub in module.modules():
        for tensor in _direct_tensors(sub):
            seen.setdefault(id(tensor), tensor)
    return list(seen.values())


def _check_unshared(name: str, tensors: list[torch.Tensor]) -> None:
    """A ValueError when two of `tensors` share a storage: moving them apart would break the sharing."""
    storages: dict[int, int] = {}
    for tensor in tensors:
        ptr = tensor.untyped_storage().data_ptr()
        if ptr and storages.setdefault(ptr, id(tensor)) != id(tensor):
            raise ValueError(f"{name}: two of its tensors share one storage, so it cannot be offloaded")


def _device_bytes(module: nn.Module) -> int:
    """Bytes of `module`'s weights (a tied weight once)."""
    return _nbytes(_unique_tensors(module))


def _hooked_modules(root: nn.Module, inside_blocks: bool) -> list[nn.Module]:
    """Where a component's use shows: its root, direct children and every submodule owning tensors;
    without `inside_blocks`, none inside its repeated blocks (they run from its forward, whose hook has
    fired, and they are what `--compile` compiles: no hooks in the graphs)."""
    skipped: set[int] = set()
    if not inside_blocks:
        for _, blocks in find_block_lists(root):
            skipped.update(id(m) for block in blocks for m in block.modules())
    found = {id(root): root}
    found.update({id(child): child for child in root.children()})
    for module in root.modules():
        if id(module) not in skipped and next(_direct_tensors(module), None) is not None:
            found.setdefault(id(module), module)
    return list(found.values())


@dataclass(eq=False)
class ManagedComponent:
    """One component under the group: its placement and, offloaded, its tensors' host copies."""

    name: str
    module: nn.Module
    placement: Placement
    tensors: list[torch.Tensor] = field(default_factory=list)  # the module's own tensor objects
    host: list[torch.Tensor] = field(default_factory=list)  # their host copies (offloaded only)
    nbytes: int = 0
    on_device: bool = True
    moves_in: int = 0
    handles: list[RemovableHandle] = field(default_factory=list)


class OffloadGroup:
    """The components of one pipeline under a memory plan, and which offloaded one is on the device."""

    def __init__(self, plan: MemoryPlan, platform: Platform) -> None:
        self.plan = plan
        self.platform = platform
        self.device = platform.device()
        self.components: dict[str, ManagedComponent] = {}
        self.layerwise: dict[str, LayerwiseDit] = {}
        self.active: ManagedComponent | None = None
        self.bytes_moved_in = 0
        self._pin_failed = False

    # -- setting up ------------------------------------------------------------------------------------

    def add(self, name: str, module: nn.Module, placement: Placement) -> ManagedComponent:
        """Manage `module`: offloaded, its tensors move to (pinned) host copies now."""
        component = ManagedComponent(name, module, placement)
        if placement == "offload":
            component.tensors = _unique_tensors(module)
            _check_unshared(name, component.tensors)
            with torch.inference_mode(False), torch.no_grad():
                component.host = [self._host_copy(t) for t in component.tensors]
                for tensor, host in zip(component.tensors, component.host, strict=True):
                    _assign(tensor, host)
            component.nbytes = _nbytes(component.tensors)
            component.on_device = False
        elif placement == "resident":
            component.nbytes = _device_bytes(module)
        self.components[name] = component
        setattr(module, GROUP_ATTRIBUTE, self)
        return component

    def _host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        host = tensor.detach() if tensor.device.type == "cpu" else self.platform.to_host(tensor)
        if self._pin_failed or not self.platform.has_separate_device_memory():
            return host
        try:
            return self.platform.pin_host(host)
        except RuntimeError as exc:  # e.g. the locked-memory limit: slower copies, not a failure
            logger.warning(
                "Offload: cannot pin host memory (%s); host copies stay pageable (slower copies)", exc
            )
            self._pin_failed = True
            return host

    def attach_hooks(self) -> None:
        """The forward pre-hooks that see each component's use (the module docstring)."""
        for component in self.components.values():
            offloaded = component.placement == "offload"
            hook = self._hook_for(component, align=offloaded)
            modules = _hooked_modules(component.module, inside_blocks=offloaded)
            component.handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in modules]

    def _hook_for(self, component: ManagedComponent, align: bool):  # noqa: ANN202 - a forward pre-hook
        def hook(
            module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]
        ) -> tuple[tuple[object, ...], dict[str, object]] | None:
            if self.active is not component:
                self.use(component)
            return self._aligned(args, kwargs) if align else None

        return hook

    def _wrong_device(self, value: object) -> bool:
        return isinstance(value, torch.Tensor) and value.device != self.device

    def _aligned(
        self, args: tuple[object, ...], kwargs: dict[str, object]
    ) -> tuple[tuple[object, ...], dict[str, object]] | None:
        """The call's tensor arguments on the device, or None when they all are (the usual case)."""
        if not any(map(self._wrong_device, args)) and not any(map(self._wrong_device, kwargs.values())):
            return None

        def moved(value: object) -> object:
            return self.platform.to_device(value) if self._wrong_device(value) else value  # type: ignore[arg-type]

        return tuple(moved(a) for a in args), {k: moved(v) for k, v in kwargs.items()}

    # -- moving ----------------------------------------------------------------------------------------

    def use(self, component: ManagedComponent) -> None:
        """`component` is about to run: evict the other offloaded ones, then move it in if it is offloaded."""
        for other in self.components.values():
            if other is not component and other.on_device and other.placement == "offload":
                self._evict(other)
        if component.placement == "offload" and not component.on_device:
            self._move_in(component)
        self.active = component

    def _move_in(self, component: ManagedComponent) -> None:
        with torch.inference_mode(False), torch.no_grad():
            for tensor, host in zip(component.tensors, component.host, strict=True):
                _assign(tensor, self.platform.to_device(host))
        component.on_device = True
        component.moves_in += 1
        self.bytes_moved_in += component.nbytes
        logger.debug("Offload: %s moved to the device (%.1f MB)", component.name, component.nbytes / MB)

    def _evict(self, component: ManagedComponent) -> None:
        with torch.inference_mode(False), torch.no_grad():
            for tensor, host in zip(component.tensors, component.host, strict=True):
                _assign(tensor, host)
        component.on_device = False
        logger.debug("Offload: %s back in host memory", component.name)

    def evict_all(self) -> None:
        """Every offloaded component back in host memory (e.g. before measuring free memory)."""
        for component in self.components.values():
            if component.placement == "offload" and component.on_device:
                self._evict(component)
        self.active = None

    def remove(self) -> None:
        """Undo the offload: hooks removed, every component back on the device for good."""
        for component in self.components.values():
            for handle in component.handles:
                handle.remove()
            component.handles = []
            if component.placement == "offload" and not component.on_device:
                self._move_in(component)
            component.placement = "resident"
            if GROUP_ATTRIBUTE in vars(component.module):
                delattr(component.module, GROUP_ATTRIBUTE)
        for layerwise in self.layerwise.values():
            layerwise.remove()
        self.layerwise.clear()
        self.active = None

    # -- reporting -------------------------------------------------------------------------------------

    def residency(self) -> WeightResidency:
        """The weights as the device holds them now, for the memory model."""
        resident = sum(c.nbytes for c in self.components.values() if c.placement == "resident")
        swap = max((c.nbytes for c in self.components.values() if c.placement == "offload"), default=0)
        moved_in = sum(c.nbytes for c in self.components.values() if c.placement == "offload" and c.on_device)
        for name, layerwise in self.layerwise.items():
            size = self.plan.sizes.get(name)
            resident += size.non_block_bytes if size is not None else 0
            swap = max(swap, LAYERWISE_WINDOW_BLOCKS * layerwise.max_block_bytes)
            moved_in += layerwise.resident_block_bytes
        return WeightResidency(resident_bytes=resident, swap_bytes=swap, moved_in_bytes=moved_in)

    def offloaded_sizes(self) -> dict[str, int]:
        """The offloaded and layerwise components' bytes, in plan order."""
        sizes = {}
        for name, component in self.components.items():
            if component.placement == "offload":
                sizes[name] = component.nbytes
            elif component.placement == "layerwise":
                size = self.plan.sizes.get(name)
                sizes[name] = size.total_bytes if size is not None else 0
        return sizes


def _module(value: object) -> nn.Module | None:
    """A component's module: a `LoadedComponent`'s value, or the module itself; None for tokenizers etc."""
    module = getattr(value, "value", value)
    return module if isinstance(module, nn.Module) else None


def install_memory_plan(
    plan: MemoryPlan, components: Mapping[str, object], platform: Platform
) -> OffloadGroup | None:
    """Apply `plan` to the loaded `components` ({name: LoadedComponent or module}): offloaded ones to host
    copies with their hooks, layerwise DiTs to `install_layerwise_offload`. None when nothing is offloaded.
    Call it before LoRA wraps the DiT's Linears (the wrappers share the offloaded Parameters) and before
    anything runs."""
    if not plan.offloads_anything:
        return None
    group = OffloadGroup(plan, platform)
    for name, placement in plan.placements.items():
        module = _module(components.get(name))
        if module is None:
            continue
        if placement == "layerwise":
            group.layerwise[name] = install_layerwise_offload(module, platform)
        group.add(name, module, placement)
    if any(c.placement == "offload" for c in group.components.values()):
        group.attach_hooks()
    residency = group.residency()
    logger.info(
        "Offload installed: %s; resident weights %.1f MB, at most %.1f MB moving in for a stage",
        ", ".join(f"{n} {c.placement}" for n, c in group.components.items()),
        residency.resident_bytes / MB,
        residency.swap_bytes / MB,
    )
    return group


def offload_group(components: Mapping[str, object]) -> OffloadGroup | None:
    """The group installed on these components (`install_memory_plan`), or None."""
    for value in components.values():
        module = _module(value)
        group = None if module is None else vars(module).get(GROUP_ATTRIBUTE)
        if isinstance(group, OffloadGroup):
            return group
    return None


def weight_residency(components: Mapping[str, object]) -> WeightResidency:
    """The memory model's view of the weights: the group's, or every module's bytes resident (no offload)."""
    group = offload_group(components)
    if group is not None:
        return group.residency()
    modules = [m for v in components.values() if (m := _module(v)) is not None]
    return WeightResidency(resident_bytes=sum(_device_bytes(m) for m in modules))


def components_that_can_stay_resident(
    components: Mapping[str, object], total_bytes: int | None, peak_bytes: float | None
) -> list[str]:
    """The offloaded components that would have fit next to the peak (the device's total less the peak
    memory of the run), taken in plan order while room is left: the ones worth keeping resident."""
    group = offload_group(components)
    if group is None or total_bytes is None or peak_bytes is None:
        return []
    room = total_bytes - peak_bytes
    fitting = []
    for name, nbytes in group.offloaded_sizes().items():
        if nbytes <= room:
            fitting.append(name)
            room -= nbytes
    return fitting


def log_resident_candidates(
    components: Mapping[str, object], platform: Platform, peak_bytes: float | None
) -> None:
    """The end-of-run line, as SGLang Diffusion prints it next to its peak memory."""
    total = platform.memory_info().total_bytes
    fitting = components_that_can_stay_resident(components, total, peak_bytes)
    remaining = "" if total is None or peak_bytes is None else f"{(total - peak_bytes) / 2**30:.2f} GiB"
    logger.info(
        "Remaining device memory at peak: %s. Components that can stay resident: %s",
        remaining or "unknown",
        fitting,
    )
