"""Z-Image's blocks in ranges (`models/dits/z_image_block_range.py`), what DBCache runs them through:
the noise refiner then the main layers, cut anywhere, give each row what the model's own forward gives it,
with samples of different image sizes and caption lengths (the unified sequence is joined and split at
every cut); DBCache's Fn/Bn index the main layers; and a request reusing its middle layers next to others
whose captions are longer, then absent (another caption width each step), gets what it gets alone."""

from __future__ import annotations

import pytest
import torch

from diffserve.configs.cache_settings import DBCacheSettings
from diffserve.models.cache_methods.batch import BatchStepCache, CacheRows
from diffserve.models.cache_methods.dbcache import DBCacheState
from diffserve.models.dits.z_image import ZImageTransformer2DModel, ZImageTransformerConfig

STEPS = 20
TINY = {
    "all_patch_size": (2,),
    "all_f_patch_size": (1,),
    "in_channels": 16,
    "dim": 64,
    "n_layers": 4,
    "n_refiner_layers": 1,
    "n_heads": 2,
    "n_kv_heads": 2,
    "cap_feat_dim": 32,
    "axes_dims": (8, 12, 12),
    "axes_lens": (1536, 512, 512),
}


@pytest.fixture(scope="module")
def dit() -> ZImageTransformer2DModel:
    torch.manual_seed(0)
    return ZImageTransformer2DModel(ZImageTransformerConfig(**TINY)).eval()


def _inputs(sizes: list[tuple[int, int]], captions: list[int], t: list[float], seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "x": [torch.randn(16, 1, h, w, generator=g) for h, w in sizes],
        "t": torch.tensor(t),
        "cap_feats": [torch.randn(n, 32, generator=g) for n in captions],
    }


def _dbcache(threshold: float, Fn: int = 1, Bn: int = 1) -> DBCacheState:
    settings = DBCacheSettings(
        Fn_compute_blocks=Fn, Bn_compute_blocks=Bn, residual_diff_threshold=threshold, max_warmup_steps=1
    )
    return DBCacheState(settings, num_blocks=5, range_offset=1)


def test_the_main_layers_are_what_dbcache_counts(dit) -> None:
    assert dit.cache_block_count() == 5 and dit.cache_range_offset() == 1
    assert "dbcache" in dit.cache_methods
    assert _dbcache(0.1, Fn=1, Bn=1).span() == (2, 4) and _dbcache(0.1).probe_base == 1


@pytest.mark.parametrize("Fn", [1, 2, 3])
def test_a_step_that_computes_every_layer_in_ranges_is_the_models_own_output(dit, Fn) -> None:
    """Samples of another image size and caption length in one batch; DBCache cuts at the refiner's end,
    after Fn main layers and before the last: every sample's output equals the uncut forward's."""
    inputs = _inputs([(8, 6), (4, 6), (8, 6)], [7, 40, 12], [0.1, 0.5, 0.85])
    with torch.no_grad():
        exact = dit(**inputs)
        cache = BatchStepCache([CacheRows(_dbcache(0.0, Fn=Fn), 1, 0, STEPS) for _ in range(3)])
        cut = dit(**inputs, step_cache=cache)
    for a, b in zip(cut, exact, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_reusing_request_next_to_changing_captions_gets_its_own_output(dit) -> None:
    """Row 0 runs DBCache (Fn=1, Bn=1: reuses main layers 2-3 after one computed step). Step 0 it shares
    the forward with a request whose caption is longer (a wider caption stream), step 1 it runs alone:
    the cached caption residual is cut to the new width, and both steps give what it gets alone."""
    mine = _inputs([(8, 6)], [7], [0.4], seed=3)
    other = _inputs([(8, 6)], [70], [0.6], seed=4)
    together = {k: [*mine[k], *other[k]] for k in ("x", "cap_feats")} | {"t": torch.tensor([0.4, 0.6])}
    with torch.no_grad():
        batched = _dbcache(1.0)
        first = dit(
            **together,
            step_cache=BatchStepCache([CacheRows(batched, 1, 0, STEPS), CacheRows(None, 1, 0, STEPS)]),
        )
        second = dit(**mine, step_cache=BatchStepCache([CacheRows(batched, 1, 1, STEPS)]))
        alone = _dbcache(1.0)
        first_alone = dit(**mine, step_cache=BatchStepCache([CacheRows(alone, 1, 0, STEPS)]))
        second_alone = dit(**mine, step_cache=BatchStepCache([CacheRows(alone, 1, 1, STEPS)]))
    assert batched.history == alone.history == [True, False]
    torch.testing.assert_close(first[0], first_alone[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second[0], second_alone[0], rtol=1e-5, atol=1e-5)
    # Same inputs both steps: the reused residual rebuilds the middle layers' output.
    torch.testing.assert_close(second[0], first_alone[0], rtol=1e-5, atol=1e-5)
    assert batched.blocks_computed == 5 + 3 and batched.blocks_reused == 2
