"""Layerwise DiT offload (`--dit-layerwise-offload`, and `--max-memory`'s memory-mapped DiT; docs/memory.md).

The DiT's repeated blocks (`repeated_blocks`) live in host memory: pinned where the platform has
pinned memory, or the pages of their memory-mapped files (`loader/mmap_weights.py`). Between uses a
block's parameters and buffers are `meta` placeholders (shape and dtype, no storage); when a block is
about to run its tensors are copied to the device, and when it has run they are dropped again, so the
device holds the non-block weights plus at most `1 + prefetch_blocks` blocks. The copy of the next block
runs on a side stream (`torch.Stream`), overlapping the current block's compute; the compute stream
waits on the copy's event before the block runs, and every copied tensor is `record_stream`-ed on the
compute stream so the allocator cannot hand its memory to the next copy while the block still reads it.
Before a prefetch the host waits for the blocks dropped since the last one to have finished on the
device: without that the host, queueing kernels far ahead of the device, would have the allocator hold
every block it queued (their memory is reusable only once the device is past them), not two.

On the CPU there is no side stream: a block's tensors are its host tensors themselves (no copy), or for
a memory-mapped model the views of its file pages, which the kernel is asked to read ahead
(`MADV_WILLNEED`) for the next block and to drop (`MADV_DONTNEED`) once a block has run.

Which block comes next is learned from the order the blocks run in: after each block, the block that
most often ran next (the declaration order until one has), so a family whose streams run in another
order than they are declared prefetches correctly once it has run: Z-Image's context refiner runs once
per request, before the noise refiner and the layers that run every step, and its first block is then
the one block per request copied without a prefetch. Code that calls a block's submodule outside the
block's own forward (FLUX's unfused adaLN projections, the step cache's first-block signal) still works:
that submodule's own tensors are copied for the call and dropped after it.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from diffserve.errors import UserError
from diffserve.loader.mmap_weights import forget_mapped_tensors, mapped_tensors
from diffserve.platforms.base import Platform
from diffserve.runtime.compile import find_block_lists

logger = logging.getLogger("diffserve.offload")


#: Where `install_layerwise_offload` records the offload on the DiT (read with `layerwise_offload_of`).
_OFFLOAD_ATTR = "_diffserve_layerwise_offload"


class HostSource(Protocol):
    """Where one offloaded tensor's bytes live in host memory between its uses."""

    def host_tensor(self) -> torch.Tensor:
        """The tensor in host memory, in any dtype (it is cast as it is copied to the device)."""
        ...

    def will_need(self) -> None:
        """A hint that it is about to be copied (a memory-mapped file's pages are read ahead)."""
        ...

    def release(self) -> None:
        """After its use: give back what holding it costs (a memory-mapped file's resident pages)."""
        ...


@dataclass(frozen=True)
class HostCopy:
    """A `HostSource` that is a tensor held in (pinned or pageable) host memory."""

    tensor: torch.Tensor

    def host_tensor(self) -> torch.Tensor:
        return self.tensor

    def will_need(self) -> None:
        """Nothing to do: the tensor is resident."""

    def release(self) -> None:
        """Nothing to do: the tensor stays resident in host memory."""


@dataclass
class _Slot:
    """One parameter or buffer of a block: where it is registered, its host source, its placeholder."""

    owner: nn.Module
    name: str
    is_param: bool
    source: HostSource
    placeholder: torch.Tensor  # meta, the tensor's shape and run dtype

    @property
    def nbytes(self) -> int:
        return self.placeholder.numel() * self.placeholder.element_size()

    def install(self, tensor: torch.Tensor) -> None:
        """Register `tensor` (a device copy, or the placeholder) as this slot's tensor."""
        if self.is_param:
            self.owner._parameters[self.name] = nn.Parameter(tensor, requires_grad=False)
        else:
            self.owner._buffers[self.name] = tensor


@dataclass(eq=False)
class _Group:
    """One repeated block: its tensors, grouped by the submodule that registers them."""

    index: int
    name: str
    module: nn.Module
    slots: list[_Slot]
    by_owner: dict[nn.Module, list[_Slot]]
    resident: bool = False
    ready: torch.Event | None = None  # the prefetch copy's completion, until the compute stream waits on it
    touched: list[nn.Module] = field(default_factory=list)  # owners copied for a call outside the block

    @property
    def nbytes(self) -> int:
        return sum(slot.nbytes for slot in self.slots)


@dataclass
class LayerwiseStats:
    """What the offload did since it was installed (or since `reset_stats`)."""

    onloads: int = 0  # blocks copied to the device
    prefetched: int = 0  # of which ahead of their use, on the side stream (or read ahead on the CPU)
    hits: int = 0  # block uses that found their block already resident (prefetched)
    missed: int = 0  # block uses whose block was not resident: copied synchronously
    touches: int = 0  # submodule calls outside their block's forward (their own tensors copied)
    bytes_copied: int = 0
    peak_resident_block_bytes: int = 0  # the most block bytes on the device at once (own bookkeeping)


def layerwise_offload_of(dit: nn.Module) -> LayerwiseOffload | None:
    """The layerwise offload installed on `dit`, or None."""
    return dit.__dict__.get(_OFFLOAD_ATTR)


def repeated_blocks(dit: nn.Module) -> list[tuple[str, nn.Module]]:
    """The DiT's repeated blocks as (state-dict prefix, block), list by list in registration order: the
    blocks `--compile` compiles (`find_block_lists`: FLUX's double- and single-stream blocks, SD3's and
    Qwen-Image's `transformer_blocks`, Z-Image's refiners and `layers`, Wan's `blocks`)."""
    return [
        (f"{name}.{i}", block) for name, blocks in find_block_lists(dit) for i, block in enumerate(blocks)
    ]


def _direct_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """(name, tensor, is_param) of the tensors `module` registers itself (not its children's)."""
    for name, param in module._parameters.items():
        if param is not None:
            yield name, param, True
    for name, buffer in module._buffers.items():
        if buffer is not None:
            yield name, buffer, False


def _current_stream(device: torch.device) -> torch.Stream:
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "current_stream"):
        return accelerator.current_stream(device)
    return getattr(torch, device.type).current_stream(device)


class LayerwiseOffload:
    """The installed layerwise offload of one DiT (`install_layerwise_offload` builds it).

    `resident_block_bytes` is its own count of the block bytes on the device; `stats` what it did;
    `remove()` puts every block back on the device for good and removes the hooks.
    """

    def __init__(
        self,
        dit: nn.Module,
        platform: Platform,
        groups: list[_Group],
        prefetch_blocks: int,
        side_stream: torch.Stream | None,
        host_memory: str,
    ) -> None:
        self.dit = dit
        self.platform = platform
        self.device = platform.device()
        #: The CPU computing on the host tensors themselves (nothing to copy: its memory is the host's).
        self.in_place = _in_place(platform)
        self.groups = groups
        self.prefetch_blocks = prefetch_blocks
        self.host_memory = host_memory  # where the blocks live, for logs and reports
        self.stats = LayerwiseStats()
        self._side = side_stream
        self._next: dict[int, Counter[int]] = {}  # block index -> how often each block ran after it
        self._last: int | None = None
        self._resident_bytes = 0
        self._handles: list[RemovableHandle] = []
        #: With a side stream: the compute stream's events after blocks that were dropped since the last
        #: prefetch (their memory is free once the device is past them).
        self._dropped: list[torch.Event] = []

    # ------------------------------------------------------------------------------------ queries

    @property
    def block_bytes(self) -> int:
        """Bytes of all the blocks (what lives in host memory)."""
        return sum(group.nbytes for group in self.groups)

    @property
    def max_block_bytes(self) -> int:
        return max((group.nbytes for group in self.groups), default=0)

    @property
    def resident_block_bytes(self) -> int:
        """Block bytes on the device now (blocks resident, and submodules copied for a call)."""
        return self._resident_bytes

    def reset_stats(self) -> None:
        self.stats = LayerwiseStats()

    # ------------------------------------------------------------------------------- the mechanics

    def _copy(self, slots: list[_Slot]) -> list[torch.Tensor]:
        """The device tensors of `slots`, copied through the platform on the current stream; on the CPU
        the host tensors themselves where they are in the run dtype (a memory-mapped one then reads its
        pages in as the block runs, at the file's alignment, as the normal load's tensors are)."""
        tensors = []
        for slot in slots:
            host = slot.source.host_tensor()
            if host.dtype != slot.placeholder.dtype:
                host = host.to(slot.placeholder.dtype)  # a mapped file in another dtype: cast on the host
            tensors.append(host if self.in_place else self.platform.to_device(host))
        return tensors

    def _materialize(self, slots: list[_Slot]) -> None:
        """Copy `slots` to the device on the current (compute) stream and register them: blocking for the
        host, ordered for the device."""
        for slot, tensor in zip(slots, self._copy(slots), strict=True):
            slot.install(tensor)
        self._count(slots, +1)

    def _count(self, slots: list[_Slot], sign: int) -> None:
        moved = sum(slot.nbytes for slot in slots)
        self._resident_bytes += sign * moved
        if sign > 0:
            self.stats.bytes_copied += moved
            self.stats.peak_resident_block_bytes = max(
                self.stats.peak_resident_block_bytes, self._resident_bytes
            )

    def _drop(self, slots: list[_Slot]) -> None:
        for slot in slots:
            slot.install(slot.placeholder)
            slot.source.release()
        self._count(slots, -1)

    def _onload(self, group: _Group, ahead: bool) -> None:
        """Make `group` resident: `ahead` (a prefetch) on the side stream where there is one."""
        self.stats.onloads += 1
        if not ahead or self._side is None:
            if ahead:
                for slot in group.slots:
                    slot.source.will_need()
                self.stats.prefetched += 1
            self._materialize(group.slots)
        else:
            self.stats.prefetched += 1
            compute = _current_stream(self.device)
            with self._side:
                tensors = self._copy(group.slots)
                group.ready = self._side.record_event()
            for slot, tensor in zip(group.slots, tensors, strict=True):
                tensor.record_stream(compute)  # freed only once the compute stream is past its use
                slot.install(tensor)
            self._count(group.slots, +1)
        group.resident = True

    def _offload(self, group: _Group) -> None:
        if group.ready is not None:  # copied but never used: let the copy finish before releasing
            group.ready.synchronize()
            group.ready = None
        self._drop(group.slots)
        group.resident = False

    def _wait(self, group: _Group) -> None:
        """Order the compute stream after `group`'s prefetch copy (once)."""
        if group.ready is not None:
            _current_stream(self.device).wait_event(group.ready)
            group.ready = None

    def _following(self, index: int) -> list[int]:
        """The `prefetch_blocks` blocks expected to run after block `index`."""
        following, current = [], index
        for _ in range(min(self.prefetch_blocks, len(self.groups) - 1)):
            seen = self._next.get(current)
            current = seen.most_common(1)[0][0] if seen else (current + 1) % len(self.groups)
            if current == index or current in following:
                break
            following.append(current)
        return following

    # ------------------------------------------------------------------------------------- hooks

    def _enter_block(self, group: _Group) -> None:
        if self._last is not None and self._last != group.index:
            self._next.setdefault(self._last, Counter())[group.index] += 1
        self._last = group.index
        if group.resident:
            self.stats.hits += 1
            self._wait(group)
        else:
            self.stats.missed += 1
            self._onload(group, ahead=False)
        keep = {group.index, *self._following(group.index)}
        for other in self.groups:
            if other.resident and other.index not in keep:
                self._offload(other)
        ahead = [i for i in keep - {group.index} if not self.groups[i].resident]
        if ahead:
            for event in self._dropped:  # their memory is reused by the copies below
                event.synchronize()
            self._dropped.clear()
        for index in sorted(ahead, key=lambda i: (i - group.index) % len(self.groups)):
            self._onload(self.groups[index], ahead=True)

    def _exit_block(self, group: _Group) -> None:
        if group.resident:
            self._offload(group)
            if self._side is not None:
                self._dropped.append(_current_stream(self.device).record_event())

    def _enter_owner(self, group: _Group, owner: nn.Module) -> None:
        if torch.compiler.is_compiling():  # inside a compiled block: its block hook ran outside the graph
            return
        if group.resident:
            self._wait(group)
            return
        self.stats.touches += 1
        self._materialize(group.by_owner[owner])
        group.touched.append(owner)

    def _exit_owner(self, group: _Group, owner: nn.Module) -> None:
        if torch.compiler.is_compiling():
            return
        if group.touched and group.touched[-1] is owner:
            group.touched.pop()
            self._drop(group.by_owner[owner])

    def _hook(self, module: nn.Module, enter: Callable[[], None], exit_: Callable[[], None]) -> None:
        self._handles.append(module.register_forward_pre_hook(lambda _module, _args: enter()))
        self._handles.append(module.register_forward_hook(lambda _module, _args, _out: exit_()))

    def attach_hooks(self) -> None:
        for group in self.groups:
            self._hook(
                group.module,
                lambda g=group: self._enter_block(g),
                lambda g=group: self._exit_block(g),
            )
            for owner in group.by_owner:
                if owner is not group.module:  # the block's own tensors come with the block
                    self._hook(
                        owner,
                        lambda g=group, o=owner: self._enter_owner(g, o),
                        lambda g=group, o=owner: self._exit_owner(g, o),
                    )

    def remove(self) -> None:
        """Undo the offload: every block's tensors put on the device for good, the hooks removed (the
        stats stay as they were)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for group in self.groups:
            if group.resident:
                self._wait(group)
            else:
                for slot, tensor in zip(group.slots, self._copy(group.slots), strict=True):
                    slot.install(tensor)
            group.resident = False  # no longer managed here
        self._resident_bytes = 0
        self.dit.__dict__.pop(_OFFLOAD_ATTR, None)


def _in_place(platform: Platform) -> bool:
    """Whether blocks run on their host tensors (the CPU: its device memory is the host's)."""
    return platform.device().type == "cpu" and not platform.has_separate_device_memory()


def _side_stream(device: torch.device) -> torch.Stream | None:
    """A stream for the copies, or None on the CPU (copies are synchronous there)."""
    if device.type == "cpu":
        return None
    try:
        return torch.Stream(device=device)
    except (RuntimeError, NotImplementedError) as exc:
        logger.warning(
            "DiT layerwise offload: no side stream on %s (%s): blocks are copied on the compute stream, "
            "without overlap",
            device,
            exc,
        )
        return None


def _place_non_block(
    dit: nn.Module, block_modules: set[nn.Module], platform: Platform, mapped: dict[str, HostSource]
) -> int:
    """Put every tensor outside `block_modules` (the blocks' submodules) on the device for good
    (memory-mapped ones materialized: on the CPU, the views themselves, kept); returns their bytes."""
    total, device, in_place = 0, platform.device(), _in_place(platform)
    for prefix, module in dit.named_modules():
        if module in block_modules:
            continue
        for name, tensor, is_param in list(_direct_tensors(module)):
            key = f"{prefix}.{name}" if prefix else name
            if key in mapped:
                source = mapped[key]
                value = source.host_tensor().to(tensor.dtype)  # the view itself when no cast is needed
                if not in_place:
                    value = platform.to_device(value)
                if value is not source.host_tensor():
                    source.release()  # copied: the file's pages are no longer needed
            elif tensor.is_meta:
                raise UserError(f"layerwise offload: {type(dit).__name__}.{key} has no weights (meta)")
            elif tensor.device != device:
                value = platform.to_device(tensor.detach())
            else:
                total += tensor.numel() * tensor.element_size()
                continue
            if is_param:
                module._parameters[name] = nn.Parameter(value, requires_grad=False)
            else:
                module._buffers[name] = value
            total += value.numel() * value.element_size()
    return total


def _build_group(
    index: int, prefix: str, block: nn.Module, mapped: dict[str, HostSource], platform: Platform, pin: bool
) -> _Group:
    """A block's slots: each tensor's host source (its mapped view, or a host copy: pinned when `pin`),
    then a placeholder registered in its place, so the device copy it had (if any) is freed as the
    block is gathered."""
    slots, by_owner = [], {}
    for sub_prefix, owner in block.named_modules():
        if owner is block:
            continue  # the block's own tensors stay resident (see `install_layerwise_offload`)
        for name, tensor, is_param in list(_direct_tensors(owner)):
            key = ".".join(part for part in (prefix, sub_prefix, name) if part)
            if key in mapped:
                source = mapped[key]
            elif tensor.is_meta:
                raise UserError(f"layerwise offload: {key} has no weights (meta)")
            else:
                host = tensor.detach()
                host = platform.to_host(host) if host.device.type != "cpu" else host
                source = HostCopy(platform.pin_host(host) if pin else host)
            placeholder = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
            slot = _Slot(owner, name, is_param, source, placeholder)
            slot.install(placeholder)
            slots.append(slot)
            by_owner.setdefault(owner, []).append(slot)
    return _Group(index, prefix, block, slots, by_owner)


def install_layerwise_offload(
    dit: nn.Module, platform: Platform, prefetch_blocks: int = 1
) -> LayerwiseOffload:
    """Stream `dit`'s repeated blocks to `platform`'s device, `prefetch_blocks` ahead of their use.

    The DiT may be loaded on the host (preferred: the device never holds it whole), on the device, or
    memory-mapped (`loader/mmap_weights.py`: its blocks then stream from the files' pages). Its
    non-block weights are placed on the device for good, and so are the tensors a block registers
    itself rather than through a submodule (Wan's per-block `scale_shift_table`, a few KB): code reads
    them outside the block's forward (the step cache's first-block signal), where no hook sees it.
    Returns the offload (stats, `remove()`).
    """
    if prefetch_blocks < 1:
        raise ValueError(f"prefetch_blocks must be at least 1, got {prefetch_blocks}")
    if layerwise_offload_of(dit) is not None:
        raise RuntimeError(f"{type(dit).__name__} already has a layerwise offload installed")
    blocks = repeated_blocks(dit)
    if not blocks:
        raise UserError(
            f"--dit-layerwise-offload: {type(dit).__name__} has no repeated blocks (no nn.ModuleList child "
            "whose items share one model class)"
        )
    device = platform.device()
    mapped: dict[str, HostSource] = dict(mapped_tensors(dit) or {})
    in_place = _in_place(platform)
    pin = not in_place and not mapped  # mapped blocks stream from their files' pages, never pinned
    block_modules = {m for _, block in blocks for m in block.modules() if m is not block}
    resident = _place_non_block(dit, block_modules, platform, mapped)
    groups = [
        _build_group(i, prefix, block, mapped, platform, pin) for i, (prefix, block) in enumerate(blocks)
    ]
    forget_mapped_tensors(dit)
    platform.empty_cache()  # the device copies of the blocks, if the DiT was loaded there
    side = _side_stream(device)
    if mapped:
        host_memory = "memory-mapped files"
    elif in_place:
        host_memory = "host memory (the CPU is the device: blocks run in place)"
    else:
        host_memory = "host memory (pinned where the platform pins)"
    offload = LayerwiseOffload(dit, platform, groups, prefetch_blocks, side, host_memory)
    offload.attach_hooks()
    dit.__dict__[_OFFLOAD_ATTR] = offload
    logger.info(
        "DiT layerwise offload: %d blocks (%.3f GiB, the largest %.1f MiB) in %s, streamed to %s %d ahead "
        "%s; resident: %.3f GiB of non-block weights",
        len(groups),
        offload.block_bytes / 2**30,
        offload.max_block_bytes / 2**20,
        host_memory,
        device,
        prefetch_blocks,
        "on a side stream" if side is not None else "(synchronously)",
        resident / 2**30,
    )
    if mapped:
        logger.info(
            "DiT layerwise offload: every step reads each block's pages from its file again, at page-cache "
            "speed while the cache holds them and at disk speed when the model is larger than the RAM left"
        )
    return offload
