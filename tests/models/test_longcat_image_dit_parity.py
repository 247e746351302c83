"""Native LongCat-Image DiT against Diffusers' `LongCatImageTransformer2DModel` on the same tiny random weights
(fp32): per-sample timesteps, the pipeline's position ids (modality axis, image grid after the text), fused
projections, and a batch row equal to the row alone."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from diffserve.models.dits.longcat_image import LongCatImageTransformer2DModel
from diffserve.testing.parity import assert_parity, assert_same_state_dict_layout, parity_pair

diffusers = pytest.importorskip("diffusers")
from diffusers import LongCatImageTransformer2DModel as DiffusersLongCat  # noqa: E402

TINY_CONFIG: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 16,
    "num_layers": 2,
    "num_single_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,
    "pooled_projection_dim": 32,
    "axes_dims_rope": (4, 6, 6),
}
TEXT = 7


def _ids(h: int, w: int, text: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(txt_ids, img_ids) as LongCat-Image's pipeline makes them: text (0, i, i), image (1, text + row,
    text + col)."""
    txt = torch.zeros(text, 3)
    txt[:, 1] = txt[:, 2] = torch.arange(text)
    img = torch.ones(h, w, 3)
    img[..., 1] = torch.arange(h)[:, None] + text
    img[..., 2] = torch.arange(w)[None, :] + text
    return txt, img.reshape(h * w, 3)


def _inputs(batch: int, h: int, w: int, timesteps: list[float]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    txt_ids, img_ids = _ids(h, w, TEXT)
    return {
        "hidden_states": torch.randn(batch, h * w, TINY_CONFIG["in_channels"], generator=g),
        "encoder_hidden_states": torch.randn(batch, TEXT, TINY_CONFIG["joint_attention_dim"], generator=g),
        "timestep": torch.tensor(timesteps),
        "img_ids": img_ids,
        "txt_ids": txt_ids,
    }


@pytest.fixture(scope="module")
def pair() -> tuple[torch.nn.Module, LongCatImageTransformer2DModel]:
    return parity_pair(DiffusersLongCat, LongCatImageTransformer2DModel, TINY_CONFIG)


def test_state_dict_layout_matches_diffusers(pair) -> None:
    reference, native = pair
    assert_same_state_dict_layout(native, reference)
    assert not list(native.buffers())


@pytest.mark.parametrize("fused", [False, True])
def test_longcat_image_dit_matches_diffusers(pair, fused: bool) -> None:
    reference, native = pair
    if fused:
        native = parity_pair(DiffusersLongCat, LongCatImageTransformer2DModel, TINY_CONFIG)[1]
        native.fuse_for_inference()
    inputs = _inputs(2, 3, 5, [0.15, 0.8])  # two samples at their own timesteps, a non-square grid
    with torch.no_grad():
        expected = reference(**inputs, return_dict=False)[0]
        actual = native(**inputs)
    label = f"LongCat-Image DiT, batch of 2 (fused {fused})"
    assert_parity(actual, expected, label, max_abs=1e-4, min_cos=0.9999)


def test_a_batch_row_equals_the_row_alone(pair) -> None:
    _, native = pair
    inputs = _inputs(2, 4, 4, [0.3, 0.6])
    with torch.no_grad():
        together = native(**inputs)
        alone = native(
            inputs["hidden_states"][1:],
            inputs["encoder_hidden_states"][1:],
            inputs["timestep"][1:],
            inputs["img_ids"],
            inputs["txt_ids"],
        )
    torch.testing.assert_close(together[1:], alone, rtol=1e-5, atol=1e-5)
