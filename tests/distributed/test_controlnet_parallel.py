"""ControlNets on 2-rank engines (gloo ranks on the CPU) give the one-rank image, same seed, within one
uint8 level (cases: `controlnet_cases.py` next to this file, requests with CFG and a negative prompt):

- CFG-parallel 2 (`enable_cfg_parallel=True`) for FLUX.1, Qwen-Image and SD3: each cfg rank runs the
  ControlNet over its branch's rows, FLUX.1's and Qwen-Image's on the prompt's text (Diffusers adds the
  prompt's residuals to both branches), SD3's on its branch's own text and control rows (an inpainting
  ControlNet's too: one draw of the masked image's latents, both branches' rows);
- Ulysses 2 (`ulysses_degree=2`) for FLUX.1: every rank runs the ControlNet over the whole sequence and
  adds the slice of its residuals that matches its image shard (15 image tokens: the shards are padded).

A control run (another control image, one rank) must move the image by at least `CONTROL_MIN_LEVELS`, so
that the parity is not the ControlNet doing nothing. Qwen-Image and SD3 under Ulysses, and FLUX.1 under
tensor parallelism: test_controlnet_parallel_more.py; ring attention and CFG-parallel x Ulysses:
test_controlnet_parallel_ring.py.
"""

from __future__ import annotations

import pytest
from controlnet_cases import OneRank, assert_ranks_match_one_rank

pytestmark = pytest.mark.usefixtures("controlnet_one_thread")

#: (family, `controlnet_cases.PARALLEL_MODES` name)
CASES = [
    ("flux", "cfg2"), ("flux", "ulysses2"), ("qwen-image", "cfg2"), ("sd3", "cfg2"),
    ("sd3-inpainting-controlnet", "cfg2"),
]  # fmt: skip


@pytest.mark.parametrize(("family", "mode"), CASES, ids=[f"{f}-{m}" for f, m in CASES])
def test_two_ranks_match_one_rank(controlnet_one_rank: OneRank, family: str, mode: str) -> None:
    """The 2-rank engine's image equals the one-rank one within one uint8 level (`controlnet_cases`)."""
    assert_ranks_match_one_rank(controlnet_one_rank, family, mode)
