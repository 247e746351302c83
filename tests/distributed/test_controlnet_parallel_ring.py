"""ControlNets under ring attention and under CFG-parallel x Ulysses, as test_controlnet_parallel.py (same
cases, same bars):

- Ring 2 (`ring_degree=2`) for FLUX.1, Qwen-Image and SD3: the image sequence is sharded as under Ulysses
  (15 image tokens, padded shards), so every rank runs the ControlNet over the whole sequence and adds the
  slice of its residuals that matches its shard; only the attention's exchange differs (K/V passed around
  the ring instead of heads all-to-all).
- CFG-parallel 2 x Ulysses 2 on 4 ranks (`enable_cfg_parallel=True, ulysses_degree=2`): each cfg group
  runs the ControlNet over its branch's rows, and within the group each rank adds its shard's slice.

And SD3.5-Large's kind of SD3 ControlNet (single-stream blocks on the DiT's positions) under CFG-parallel 2
and Ulysses 2. Each with a control run (another control image) that must move the image by at least
`CONTROL_MIN_LEVELS`.
"""

from __future__ import annotations

import pytest
from controlnet_cases import OneRank, assert_ranks_match_one_rank

pytestmark = pytest.mark.usefixtures("controlnet_one_thread")

#: (family, `controlnet_cases.PARALLEL_MODES` name)
CASES = [
    ("flux", "ring2"),
    ("qwen-image", "ring2"),
    ("sd3", "ring2"),
    ("flux", "cfg2-ulysses2"),
    ("qwen-image", "cfg2-ulysses2"),
    ("sd3", "cfg2-ulysses2"),
    ("sd3-large-controlnet", "cfg2"),
    ("sd3-large-controlnet", "ulysses2"),
]


@pytest.mark.parametrize(("family", "mode"), CASES, ids=[f"{f}-{m}" for f, m in CASES])
def test_ranks_match_one_rank(controlnet_one_rank: OneRank, family: str, mode: str) -> None:
    """The multi-rank engine's image equals the one-rank one within one uint8 level (`controlnet_cases`)."""
    assert_ranks_match_one_rank(controlnet_one_rank, family, mode)
