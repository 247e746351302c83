"""`layers/shape_cache.BoundedCache`: the bound, least-recently-used eviction, the device in every key,
hits returning the object first built, and the DiTs' caches staying out of their state dicts."""

from __future__ import annotations

import pytest
import torch

from diffserve.layers.shape_cache import BoundedCache
from diffserve.models.dits.wan import WanTransformer3DModel, WanTransformerConfig

CPU = torch.device("cpu")
META = torch.device("meta")


class Builds:
    """A build function that counts its calls and returns a fresh object each time."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> torch.Tensor:
        self.calls += 1
        return torch.full((2,), float(self.calls))


def test_a_second_call_returns_the_same_object_without_building() -> None:
    cache: BoundedCache[torch.Tensor] = BoundedCache(4)
    build = Builds()
    first = cache.get_or_build((3, 4), CPU, build)
    again = cache.get_or_build((3, 4), "cpu", build)
    assert again is first
    assert build.calls == 1


def test_capacity_bounds_the_entries() -> None:
    cache: BoundedCache[torch.Tensor] = BoundedCache(3)
    build = Builds()
    for n in range(10):
        cache.get_or_build(n, CPU, build)
        assert len(cache) == min(n + 1, 3)
    assert cache.keys() == [(7, CPU), (8, CPU), (9, CPU)]
    assert build.calls == 10


def test_the_least_recently_used_entry_is_evicted() -> None:
    cache: BoundedCache[torch.Tensor] = BoundedCache(2)
    build = Builds()
    a = cache.get_or_build("a", CPU, build)
    cache.get_or_build("b", CPU, build)
    assert cache.get_or_build("a", CPU, build) is a  # a hit makes "a" the most recent
    cache.get_or_build("c", CPU, build)  # evicts "b", not "a" (the oldest inserted)
    assert cache.keys() == [("a", CPU), ("c", CPU)]
    assert cache.get_or_build("a", CPU, build) is a
    calls = build.calls
    cache.get_or_build("b", CPU, build)  # rebuilt
    assert build.calls == calls + 1
    assert ("c", CPU) not in cache  # "c" was the least recently used


def test_the_key_includes_the_device() -> None:
    cache: BoundedCache[torch.Tensor] = BoundedCache(4)
    on_cpu = cache.get_or_build((8, 8), CPU, lambda: torch.zeros(2))
    on_meta = cache.get_or_build((8, 8), META, lambda: torch.zeros(2, device=META))
    assert on_meta is not on_cpu
    assert on_meta.device == META and on_cpu.device == CPU
    assert cache.keys() == [((8, 8), CPU), ((8, 8), META)]


def test_a_failed_build_stores_nothing() -> None:
    cache: BoundedCache[torch.Tensor] = BoundedCache(2)
    cache.get_or_build("kept", CPU, lambda: torch.zeros(1))

    def fail() -> torch.Tensor:
        raise ValueError("too large")

    with pytest.raises(ValueError, match="too large"):
        cache.get_or_build("bad", CPU, fail)
    assert cache.keys() == [("kept", CPU)]


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="capacity"):
        BoundedCache(0)


def test_a_dit_cache_is_per_instance_and_not_in_the_state_dict() -> None:
    config = WanTransformerConfig(
        num_attention_heads=2, attention_head_dim=8, num_layers=1, ffn_dim=16, text_dim=8, freq_dim=8
    )
    a, b = WanTransformer3DModel(config), WanTransformer3DModel(config)
    keys = set(a.state_dict())
    tables = a.rope_tables(2, 3, 4, CPU)
    assert a.rope_tables(2, 3, 4, CPU) is tables
    assert set(a.state_dict()) == keys
    assert len(b._rope_cache) == 0
