"""More ControlNets on 2-rank engines, as test_controlnet_parallel.py (same cases, same bars): Qwen-Image
and SD3 under Ulysses 2 (every rank runs the ControlNet over the whole sequence and adds the slice of its
residuals that matches its image shard; 15 image tokens, padded shards), and FLUX.1 under tensor
parallelism 2 (the ControlNet runs whole on every rank; the TP DiT's image stream is whole on every rank,
so the residuals add as on one rank). Each with a control run (another control image) that must move the
image by at least `CONTROL_MIN_LEVELS`.
"""

from __future__ import annotations

import pytest
from controlnet_cases import OneRank, assert_ranks_match_one_rank

pytestmark = pytest.mark.usefixtures("controlnet_one_thread")

#: (family, `controlnet_cases.PARALLEL_MODES` name)
CASES = [("flux", "tp2"), ("qwen-image", "ulysses2"), ("sd3", "ulysses2")]


@pytest.mark.parametrize(("family", "mode"), CASES, ids=[f"{f}-{m}" for f, m in CASES])
def test_two_ranks_match_one_rank(controlnet_one_rank: OneRank, family: str, mode: str) -> None:
    """The 2-rank engine's image equals the one-rank one within one uint8 level (`controlnet_cases`)."""
    assert_ranks_match_one_rank(controlnet_one_rank, family, mode)
