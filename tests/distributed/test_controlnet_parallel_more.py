"""More ControlNets on 2-rank engines, as test_controlnet_parallel.py (same cases, same bars): Qwen-Image
and SD3 under Ulysses 2 (every rank runs the ControlNet over the whole sequence and adds the slice of its
residuals that matches its image shard; 15 image tokens, padded shards), and FLUX.1 under tensor
parallelism 2 (the ControlNet runs whole on every rank; the TP DiT's image stream is whole on every rank,
so the residuals add as on one rank). Each with a control run (another control image) that must move the
image by at least `CONTROL_MIN_LEVELS`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from controlnet_cases import (
    CASE_BUILDERS,
    ControlNetCase,
    max_difference_on_two_ranks,
    one_rank_images,
)

OneRank = Callable[[str], tuple[ControlNetCase, np.ndarray, np.ndarray]]

#: A control image must move the image at least this far (max uint8 difference).
CONTROL_MIN_LEVELS = 20
MODES: dict[str, dict[str, object]] = {"ulysses2": dict(ulysses_degree=2), "tp2": dict(tp_size=2)}
CASES = [("flux", "tp2"), ("qwen-image", "ulysses2"), ("sd3", "ulysses2")]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the rank processes take the parent's thread count
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> OneRank:
    """family -> (its case, its one-rank image, its image with the other control image); built once."""
    root = tmp_path_factory.mktemp("controlnet-parallel-more")
    cache: dict[str, tuple[ControlNetCase, np.ndarray, np.ndarray]] = {}

    def get(family: str) -> tuple[ControlNetCase, np.ndarray, np.ndarray]:
        if family not in cache:
            case = CASE_BUILDERS[family](root)
            cache[family] = (case, *one_rank_images(case))
        return cache[family]

    return get


@pytest.mark.parametrize(("family", "mode"), CASES, ids=[f"{f}-{m}" for f, m in CASES])
def test_two_ranks_match_one_rank(one_rank: OneRank, family: str, mode: str) -> None:
    """The 2-rank engine's image equals the one-rank one within one uint8 level; the other control image
    moves the one-rank image by at least `CONTROL_MIN_LEVELS`."""
    case, alone, other = one_rank(family)
    moved = int(np.abs(other - alone).max())
    error = max_difference_on_two_ranks(case, alone, **MODES[mode])
    print(
        f"{family} ControlNet, {mode} vs one rank: max uint8 difference {error}; other control image: {moved}"
    )
    assert moved >= CONTROL_MIN_LEVELS
    assert error <= 1
