"""FasterCache's unconditional-branch approximation (`models/cache_methods/unconditional_branch.py`) against
diffusers' own functions: the frequency split, the steps that skip the branch, and the compounding of
the kept difference's scales."""

from __future__ import annotations

import torch
from diffusers.hooks.faster_cache import _split_low_high_freq

from diffserve.configs.cache_settings import FasterCacheSettings
from diffserve.models.cache_methods.unconditional_branch import (
    UnconditionalBranch,
    join_frequencies,
    split_frequencies,
)


def test_split_frequencies_is_diffusers_split_and_joins_back() -> None:
    """Shifting only the spatial dimensions (diffusers shifts every one, batch and channels included)
    selects the same coefficients; the two parts add up to the signal."""
    x = torch.randn(3, 4, 10, 14, generator=torch.Generator().manual_seed(0))
    low, high = split_frequencies(x)
    ref_low, ref_high = _split_low_high_freq(x)
    axes = (0, 1)  # diffusers' shift also rolls these: undo it to compare coefficient by coefficient
    shifts = tuple(x.shape[a] // 2 for a in axes)
    torch.testing.assert_close(torch.roll(low, shifts, axes), ref_low, rtol=0, atol=0)
    torch.testing.assert_close(torch.roll(high, shifts, axes), ref_high, rtol=0, atol=0)
    assert (low != 0).sum() < (high != 0).sum()  # a small disc around the centre
    torch.testing.assert_close(join_frequencies(low, high), x, rtol=0, atol=1e-5)


def test_skipped_steps_follow_diffusers_denoiser_rule() -> None:
    """Skipped: after the first step, inside `low < t < high`, except every N-th step."""
    settings = FasterCacheSettings(
        unconditional_batch_skip_range=3, unconditional_batch_timestep_skip_range=(100, 700)
    )
    branch = UnconditionalBranch(settings)
    timesteps = [999, 800, 650, 600, 550, 500, 450, 400, 300, 150, 90, 50]
    skipped = [branch.decide(t) for t in timesteps]
    expected = [i > 0 and 100 < t < 700 and i % 3 != 0 for i, t in enumerate(timesteps)]
    assert skipped == expected and branch.skipped == sum(expected) > 0


def test_the_kept_difference_scales_compound_over_skipped_steps() -> None:
    """Each skipped step scales the kept low/high difference by its alpha when its timestep is in that
    part's update range, and keeps the scaled one (diffusers' hook does the same)."""
    settings = FasterCacheSettings(alpha_low_frequency=2.0, alpha_high_frequency=3.0)
    branch = UnconditionalBranch(settings)
    positive = torch.randn(1, 2, 8, 8, generator=torch.Generator().manual_seed(1))
    negative = torch.randn(1, 2, 8, 8, generator=torch.Generator().manual_seed(2))
    branch.keep_difference(positive, negative)
    low_delta = split_frequencies(negative)[0] - split_frequencies(positive)[0]
    high_delta = split_frequencies(negative)[1] - split_frequencies(positive)[1]
    # t = 200: the low range (99, 901) scales by 2, the high range (-1, 301) by 3; twice: 4 and 9.
    branch.approximate(positive, 200.0)
    got = branch.approximate(positive, 200.0)
    low, high = split_frequencies(positive)
    expected = join_frequencies(low_delta * 4 + low, high_delta * 9 + high)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # outside both ranges nothing more is scaled: the approximation at t = 950 keeps 4 and 9
    torch.testing.assert_close(branch.approximate(positive, 950.0), expected, rtol=1e-5, atol=1e-5)
    fresh = UnconditionalBranch(settings)
    fresh.keep_difference(positive, negative)
    unscaled = fresh.approximate(positive, 950.0)  # scale 1: the negative branch itself, within rounding
    torch.testing.assert_close(unscaled, negative, rtol=1e-4, atol=1e-5)
