"""The text-embedding LRU: repeated prompts skip the text encoder and give the same image."""

from __future__ import annotations

import numpy as np
import torch

from diffserve import DiffGenerator
from diffserve.stages.prompt_cache import PromptEmbeddingCache


def test_lookup_computes_only_missing_prompts_once() -> None:
    cache = PromptEmbeddingCache()
    calls: list[list[str]] = []

    def compute(prompts: list[str]) -> list[torch.Tensor]:
        calls.append(list(prompts))
        return [torch.full((2,), float(len(p))) for p in prompts]

    first = cache.lookup(["a", "bb", "a"], ("s",), compute)
    assert calls == [["a", "bb"]]  # duplicates encoded once
    assert [t[0].item() for t in first] == [1.0, 2.0, 1.0]
    cache.lookup(["bb", "ccc"], ("s",), compute)
    assert calls[-1] == ["ccc"]
    cache.lookup(["a"], ("other settings",), compute)
    assert calls[-1] == ["a"]  # settings are part of the key
    assert cache.hits == 1 and cache.misses == 4  # "bb" the second time; duplicates within a call count once


def test_lru_evicts_the_least_recently_used_within_the_byte_bound() -> None:
    one_entry = 4 * 4  # a float32 tensor of 4 values
    cache = PromptEmbeddingCache(max_bytes=2 * one_entry)
    compute = lambda prompts: [torch.zeros(4) for _ in prompts]  # noqa: E731
    cache.lookup(["a"], (), compute)
    cache.lookup(["b"], (), compute)
    cache.lookup(["a"], (), compute)  # a is now the most recent
    cache.lookup(["c"], (), compute)  # evicts b
    assert len(cache) == 2
    misses = cache.misses
    cache.lookup(["a", "c"], (), compute)
    assert cache.misses == misses
    cache.lookup(["b"], (), compute)
    assert cache.misses == misses + 1


class _CountingEncoder(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.calls = 0

    @property
    def device(self) -> torch.device:
        return self.inner.device

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)


def test_a_repeated_prompt_skips_the_text_encoders(tiny_flux_dir) -> None:
    gen = DiffGenerator.from_pretrained(tiny_flux_dir, device="cpu", show_progress=False)
    stage = next(s for s in gen.pipeline.stages if s.name == "FluxTextEncodingStage")
    stage.t5_encoder = _CountingEncoder(stage.t5_encoder)
    kwargs = dict(height=32, width=32, num_inference_steps=2, true_cfg_scale=2.0, negative_prompt="ugly")
    first = gen.generate(prompt="a red fox", seed=1, **kwargs)
    assert stage.t5_encoder.calls == 1  # prompt and negative prompt in one batch
    second = gen.generate(prompt="a red fox", seed=1, **kwargs)
    assert stage.t5_encoder.calls == 1  # both cached
    third = gen.generate(prompt="a blue bird", seed=1, **kwargs)
    assert stage.t5_encoder.calls == 2  # only the new prompt; the negative is cached
    assert np.array_equal(np.asarray(first.images[0]), np.asarray(second.images[0]))
    assert not np.array_equal(np.asarray(first.images[0]), np.asarray(third.images[0]))
