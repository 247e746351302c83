"""An LRU cache of text-encoder outputs, keyed by prompt and every setting that changes the output, so
a repeated prompt (negative prompts, retries, several seeds) skips the encoder. Bounded in bytes and in
entries (each key holds its prompt text, which the byte bound does not count)."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

logger = logging.getLogger("diffserve.stages")

DEFAULT_MAX_BYTES = 256 * 2**20  # a few hundred prompts of a large T5/Qwen encoder's states
DEFAULT_MAX_ENTRIES = 1024


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v) for v in value)
    return 0


class PromptEmbeddingCache:
    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._entries: OrderedDict[Hashable, Any] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0

    def lookup(
        self, prompts: Sequence[str], settings: Hashable, compute: Callable[[list[str]], Sequence[Any]]
    ) -> list[Any]:
        """One value per prompt; `compute(missing_prompts)` runs once, batched, for the prompts not cached."""
        keys = [(prompt, settings) for prompt in prompts]
        cached = [key in self._entries for key in keys]
        self.hits += sum(cached)
        missing = list(dict.fromkeys(p for p, hit in zip(prompts, cached, strict=True) if not hit))
        fresh = {}
        if missing:
            self.misses += len(missing)
            values = compute(missing)
            if len(values) != len(missing):
                raise RuntimeError(f"text encoder returned {len(values)} results for {len(missing)} prompts")
            fresh = {(p, settings): v for p, v in zip(missing, values, strict=True)}
        out = []
        for key in keys:
            if key in fresh:
                out.append(fresh[key])
            else:
                self._entries.move_to_end(key)
                out.append(self._entries[key])
        for key, value in fresh.items():
            self._store(key, value)
        return out

    def _store(self, key: Hashable, value: Any) -> None:
        size = _nbytes(value)
        if size > self.max_bytes:
            return
        if key in self._entries:  # a concurrent lookup stored it first
            self._bytes -= _nbytes(self._entries.pop(key))
        self._entries[key] = value
        self._bytes += size
        while self._bytes > self.max_bytes or len(self._entries) > self.max_entries:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= _nbytes(evicted)

    def __len__(self) -> int:
        return len(self._entries)
