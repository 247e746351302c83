"""`BoundedCache`: the one cache of tables that depend only on a batch's shapes (RoPE tables, position
embeddings, gather layouts), built on first use and reused by every later step and same-shape request.

Why one class: each DiT used to keep its own dict with its own bound and eviction rule (oldest-first,
clear-when-full, or none). Here the capacity is fixed per instance and the rule is least-recently-used:
a server alternating between a few sizes keeps exactly those, and an unbounded stream of new shapes (text
lengths, resolutions) cannot grow memory. Evicting only costs a rebuild: the builders are deterministic,
so outputs are the same bits whichever entries are kept.

Every key is stored with its `torch.device`: a table built on one device is never handed to another.
An instance belongs to one module instance (no process-wide state); it is a plain attribute, not a
buffer, so it is not in the state dict and `Module.to()` leaves it alone (its entries name their device).
It is plain Python, run in the eager code between a DiT's blocks (`runtime/compile.py` compiles the
blocks only), so it is never traced by dynamo. Not thread-safe, like the dicts it replaces: a DiT runs
one forward at a time.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

import torch

V = TypeVar("V")

#: Entries a cache keeps unless its owner asks for another bound.
DEFAULT_CAPACITY = 16


class BoundedCache(Generic[V]):
    """At most `capacity` values keyed by (key, device); the least recently used entry is evicted first."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"a BoundedCache needs a capacity of at least 1, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[tuple[Hashable, torch.device], V] = OrderedDict()

    def get_or_build(self, key: Hashable, device: torch.device | str, build: Callable[[], V]) -> V:
        """The value cached for (`key`, `device`), or `build()`'s, stored (evicting the least recently
        used entry when full). A hit returns the very object built first and marks it most recent."""
        full_key = (key, torch.device(device))
        if full_key in self._entries:
            self._entries.move_to_end(full_key)
            return self._entries[full_key]
        value = build()  # may raise (e.g. a shape the model cannot take): nothing is stored then
        self._entries[full_key] = value
        if len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return value

    def keys(self) -> list[tuple[Hashable, torch.device]]:
        """The cached (key, device) pairs, least recently used first."""
        return list(self._entries)

    def clear(self) -> None:
        """Drop every entry (their tensors are freed once nothing else holds them)."""
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        """Whether a (key, device) pair is cached (does not count as a use)."""
        return key in self._entries

    def __repr__(self) -> str:
        return f"BoundedCache({len(self._entries)}/{self.capacity})"
