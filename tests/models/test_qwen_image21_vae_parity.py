"""Native Qwen-Image 2.1 VAE against Diffusers' `AutoencoderKLQwenImage21` on the same tiny random weights:
decode and encode (its mode) of a non-square RGBA image batch; the released layout builds on meta with
Diffusers' state-dict keys."""

from __future__ import annotations

import pytest
import torch

from diffserve.models.vaes.autoencoder_kl_qwen_image21 import AutoencoderKLQwenImage21
from diffserve.testing.parity import assert_parity, assert_same_state_dict_layout, parity_pair

diffusers = pytest.importorskip("diffusers")

MIN_DB = 80.0
TINY = {
    "base_dim": 8,
    "decoder_base_dim": 12,
    "z_dim": 8,
    "dim_mult": [1, 2, 2],
    "num_res_blocks": 1,
    "temperal_downsample": [False, True],
    "latents_mean": [0.0] * 8,
    "latents_std": [1.0] * 8,
}


@pytest.fixture(scope="module")
def pair():
    reference, native = parity_pair(diffusers.AutoencoderKLQwenImage21, AutoencoderKLQwenImage21, TINY)
    assert_same_state_dict_layout(native, reference)
    return reference, native


def test_decode_matches(pair) -> None:
    reference, native = pair
    z = torch.randn(2, 8, 1, 3, 5, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_parity(
            native.decode(z), reference.decode(z).sample, "qwen-image-2.1 vae decode", min_db=MIN_DB
        )


def test_encode_matches(pair) -> None:
    reference, native = pair
    x = torch.rand(2, 4, 1, 16, 24, generator=torch.Generator().manual_seed(1)) * 2 - 1
    with torch.no_grad():
        want = reference.encode(x).latent_dist.mode()
        assert_parity(native.encode(x).mode(), want, "qwen-image-2.1 vae encode", min_db=MIN_DB)


def test_released_layout_builds_on_meta_with_diffusers_keys() -> None:
    with torch.device("meta"):
        reference = diffusers.AutoencoderKLQwenImage21()
        ours = AutoencoderKLQwenImage21.from_config(dict(reference.config))
    assert_same_state_dict_layout(ours, reference)
    assert ours.spatial_compression_ratio == 16


def test_video_input_is_refused(pair) -> None:
    _, native = pair
    with pytest.raises(ValueError, match="one frame"):
        native.decode(torch.zeros(1, 8, 2, 3, 5))
