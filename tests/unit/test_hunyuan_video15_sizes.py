"""HunyuanVideo 1.5's size buckets and image crop against Diffusers' `HunyuanVideo15ImageProcessor`."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from diffusers.pipelines.hunyuan_video1_5.image_processor import (
    HunyuanVideo15ImageProcessor,
    generate_crop_size_list,
)
from PIL import Image

from diffserve.families.hunyuan_video15.sizes import closest_bucket, resize_and_crop, size_buckets


@pytest.mark.parametrize("target_size", [64, 480, 640, 960])
def test_buckets_and_closest_bucket_match_diffusers(target_size: int) -> None:
    processor = HunyuanVideo15ImageProcessor(vae_scale_factor=16)
    buckets = size_buckets(target_size, 16, 4.0)
    assert buckets == generate_crop_size_list(target_size, 16)
    for height, width in itertools.product(range(9, 2000, 97), range(7, 2000, 89)):
        expected = processor.calculate_default_height_width(height, width, target_size)
        assert closest_bucket(height, width, buckets) == tuple(expected), (height, width)
    assert closest_bucket(9, 16, size_buckets(640, 16, 4.0)) == (480, 848)  # the released 480p T2V default


@pytest.mark.parametrize(("height", "width"), [(48, 64), (64, 48), (32, 96), (48, 48)])
def test_resize_and_crop_matches_diffusers(height: int, width: int) -> None:
    processor = HunyuanVideo15ImageProcessor(vae_scale_factor=16, do_resize=False)
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (40, 61, 3), dtype=np.uint8))
    ours = resize_and_crop(image, height, width)
    theirs = processor.resize(image, height=height, width=width, resize_mode="crop")
    assert ours.size == theirs.size == (width, height)
    assert np.array_equal(np.asarray(ours), np.asarray(theirs))
