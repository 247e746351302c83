"""SANA's resolution binning equals Diffusers': the same bin tables, the same nearest bin for every size, and
the same resize-and-crop back to the requested size."""

from __future__ import annotations

import itertools

import pytest
import torch
from diffusers.image_processor import PixArtImageProcessor
from diffusers.pipelines.pixart_alpha.pipeline_pixart_alpha import ASPECT_RATIO_512_BIN, ASPECT_RATIO_1024_BIN
from diffusers.pipelines.pixart_alpha.pipeline_pixart_sigma import ASPECT_RATIO_2048_BIN
from diffusers.pipelines.sana.pipeline_sana import ASPECT_RATIO_4096_BIN

from diffserve.families.sana.resolution import bins_for_sample_size, nearest_bin, resize_and_crop

#: Diffusers' SanaPipeline: transformer sample_size -> its table.
DIFFUSERS_BINS = {
    16: ASPECT_RATIO_512_BIN,
    32: ASPECT_RATIO_1024_BIN,
    64: ASPECT_RATIO_2048_BIN,
    128: ASPECT_RATIO_4096_BIN,
}
SIZES = [32, 64, 96, 100, 256, 333, 512, 640, 1024, 1536, 2048, 4096]


@pytest.mark.parametrize("sample_size", sorted(DIFFUSERS_BINS))
def test_tables_and_nearest_bins_equal_diffusers(sample_size: int) -> None:
    ours, theirs = bins_for_sample_size(sample_size), DIFFUSERS_BINS[sample_size]
    assert [(key, float(h), float(w)) for key, h, w in ours] == [(k, *v) for k, v in theirs.items()]
    for height, width in itertools.product(SIZES, SIZES):
        expected = PixArtImageProcessor.classify_height_width_bin(height, width, ratios=theirs)
        assert nearest_bin(height, width, ours) == expected, (height, width)


def test_other_sample_sizes_have_no_bins() -> None:
    with pytest.raises(ValueError, match="sample_size of 24"):
        bins_for_sample_size(24)


@pytest.mark.parametrize(("height", "width"), [(64, 96), (96, 64), (416, 608), (100, 333), (700, 300)])
def test_resize_and_crop_equals_diffusers(height: int, width: int) -> None:
    images = torch.randn(2, 3, 416, 608, generator=torch.Generator().manual_seed(0))
    expected = PixArtImageProcessor.resize_and_crop_tensor(images, width, height)
    got = resize_and_crop(images, height, width)
    assert got.shape == (2, 3, height, width)
    assert torch.equal(got, expected)
