"""The shared parity helpers (`diffserve.testing.parity`) measure what their names say and fail with
the measures in the message: every model and pipeline parity test rests on them."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from diffserve.testing.parity import (
    assert_images_match,
    assert_parity,
    closeness,
    psnr_db,
    psnr_range_db,
    snr_db,
)


def test_db_metrics_on_known_values() -> None:
    expected = torch.tensor([3.0, -4.0, 1.0, 0.0])
    actual = expected + torch.tensor([0.1, 0.0, 0.0, 0.0])
    # signal energy 26, error energy 0.01; peak 4 (range 7), mean squared error 0.0025
    assert snr_db(actual, expected) == pytest.approx(10 * math.log10(26 / 0.01))
    assert psnr_db(actual, expected) == pytest.approx(10 * math.log10(16 / 0.0025))
    assert psnr_range_db(actual, expected) == pytest.approx(10 * math.log10(49 / 0.0025))
    assert snr_db(expected, expected) == psnr_db(expected, expected) == math.inf
    assert snr_db(np.ones(3), np.zeros(3)) == -math.inf  # numpy in, no signal: no parity
    result = closeness(actual.to(torch.bfloat16), expected)
    assert result.max_abs == pytest.approx(0.1, abs=1e-2) and 0.99 < result.cosine <= 1  # bf16 rounds 3.1


def test_assert_parity_checks_shape_and_every_bar_and_reports_all_measures() -> None:
    expected = torch.linspace(-1, 1, 64)
    actual = expected + 1e-3
    assert assert_parity(actual, expected, "ok", min_db=40, max_abs=2e-3, min_cos=0.999).db > 40
    with pytest.raises(AssertionError, match=r"close: .* dB < 80 dB \(.* dB, max abs diff 1.000e-03"):
        assert_parity(actual, expected, "close", min_db=80)
    with pytest.raises(AssertionError, match="max abs diff 1.000e-03 > 0.0001"):
        assert_parity(actual, expected, "close", max_abs=1e-4)
    with pytest.raises(AssertionError, match="shape"):
        assert_parity(actual[:10], expected, "cut", min_db=0)
    with pytest.raises(ValueError, match="needs a bar"):
        assert_parity(actual, expected, "no bar")


def test_assert_images_match_needs_detail_and_a_failing_control() -> None:
    rng = np.random.default_rng(0)
    reference = rng.integers(0, 256, size=(1, 8, 8, 3), dtype=np.uint8)
    ours = reference.copy()
    ours[0, 0, 0, 0] ^= 1
    other = rng.integers(0, 256, size=reference.shape, dtype=np.uint8)
    assert assert_images_match(ours, reference, "near", min_db=40, shape=(1, 8, 8, 3), control=other) > 40
    with pytest.raises(AssertionError, match="control scores"):
        assert_images_match(ours, reference, "blind", min_db=40, control=reference)
    with pytest.raises(AssertionError, match="flat"):
        flat = np.full_like(reference, 128)
        assert_images_match(flat, flat, "flat", min_db=40)
