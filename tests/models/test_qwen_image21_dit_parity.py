"""Native Qwen-Image 2.1 DiT against Diffusers' `QwenImage21Transformer2DModel` on the same tiny random
weights: two samples at different timesteps on a non-square latent grid with odd text lengths, samples of
different text lengths in one (padded) forward against each run alone by Diffusers, and without
`causal_condition`; the released config builds on meta with Diffusers' state-dict keys."""

from __future__ import annotations

import pytest
import torch
from qwen_image21_dit_cases import GRID, MIN_DB, TINY, assert_moved, text_only_prediction

from diffserve.models.dits.qwen_image21 import QwenImage21Transformer2DModel
from diffserve.testing.parity import assert_parity, assert_same_state_dict_layout, parity_pair

diffusers = pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def pair():
    reference, native = parity_pair(
        diffusers.QwenImage21Transformer2DModel, QwenImage21Transformer2DModel, TINY
    )
    assert_same_state_dict_layout(native, reference)
    return reference, native


def test_batch_of_two_matches(pair) -> None:
    reference, native = pair
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, GRID[0] * GRID[1], 8, generator=g)
    text = torch.randn(2, 7, 24, generator=g)
    t = torch.tensor([0.15, 0.85])
    with torch.no_grad():
        want = text_only_prediction(reference, x, text, t)
        got = native(x, text, [7, 7], t, GRID)
        other = native(x, torch.randn(2, 7, 24, generator=g), [7, 7], t, GRID)
    assert_parity(got, want, "qwen-image-2.1 dit, batch of 2", min_db=MIN_DB)
    # Other text moves the output ~2% (~34 dB): far below the bar, so the text is really read.
    assert_moved(other, want, "the text is unused")


def test_rows_of_different_lengths_match_each_alone(pair) -> None:
    """Padded to the longest, each row gives what Diffusers gives for its unpadded text alone."""
    reference, native = pair
    g = torch.Generator().manual_seed(2)
    lengths = [5, 11]
    x = torch.randn(2, GRID[0] * GRID[1], 8, generator=g)
    texts = [torch.randn(1, n, 24, generator=g) for n in lengths]
    padded = torch.cat([torch.nn.functional.pad(t, (0, 0, 0, 11 - t.shape[1])) for t in texts])
    t = torch.tensor([0.3, 0.6])
    with torch.no_grad():
        got = native(x, padded, lengths, t, GRID)
        for row in range(2):
            want = text_only_prediction(reference, x[row : row + 1], texts[row], t[row : row + 1])
            assert_parity(
                got[row : row + 1], want, f"qwen-image-2.1 dit, row of {lengths[row]} tokens", min_db=MIN_DB
            )


def test_without_causal_condition_matches() -> None:
    reference, native = parity_pair(
        diffusers.QwenImage21Transformer2DModel,
        QwenImage21Transformer2DModel,
        {**TINY, "num_layers": 1, "causal_condition": False},
    )
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, GRID[0] * GRID[1], 8, generator=g)
    text = torch.randn(2, 9, 24, generator=g)
    t = torch.tensor([0.05, 0.95])
    with torch.no_grad():
        assert_parity(
            native(x, text, [9, 9], t, GRID),
            text_only_prediction(reference, x, text, t),
            "no causal_condition",
            min_db=MIN_DB,
        )


def test_released_layout_builds_on_meta_with_diffusers_keys() -> None:
    with torch.device("meta"):
        reference = diffusers.QwenImage21Transformer2DModel(num_layers=2)
        ours = QwenImage21Transformer2DModel.from_config(dict(reference.config))
    assert_same_state_dict_layout(ours, reference)
