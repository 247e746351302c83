"""`CausalConv3d` on one frame behind zero temporal padding (an image, a clip's first frame) runs as a 2-D
convolution with the kernel's last temporal slice: the same values as the padded 3-D convolution."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from diffserve.models.vaes.causal3d_blocks import CausalCache, CausalConv3d


@pytest.mark.parametrize(
    ("kernel", "stride", "padding"),
    [(3, 1, 1), ((3, 3, 3), (1, 2, 2), (1, 0, 0)), ((3, 1, 1), 1, (1, 0, 0)), (1, 1, 0)],
)
def test_one_frame_equals_the_padded_3d_convolution(kernel, stride, padding) -> None:
    torch.manual_seed(0)
    conv = CausalConv3d(5, 7, kernel, stride=stride, padding=padding)
    x = torch.randn(2, 5, 1, 11, 9)
    pad_t, pad_h, pad_w = (padding,) * 3 if isinstance(padding, int) else padding
    expected = F.conv3d(
        F.pad(x, (pad_w, pad_w, pad_h, pad_h, 2 * pad_t, 0)), conv.weight, conv.bias, conv.stride
    )
    with torch.no_grad():
        for cache in (None, CausalCache()):  # alone, and as the first chunk of a cached decode
            got = conv(x, cache)
            assert got.shape == expected.shape
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_a_second_frame_uses_the_cached_first() -> None:
    """After a one-frame chunk, the next chunk's temporal padding is that frame (not zeros): the 3-D path."""
    torch.manual_seed(1)
    conv = CausalConv3d(3, 4, 3, padding=1)
    frames = torch.randn(1, 3, 2, 6, 6)
    cache = CausalCache()
    with torch.no_grad():
        chunked = torch.cat([conv(frames[:, :, :1], cache), conv(frames[:, :, 1:], cache)], dim=2)
        whole = conv(frames)
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-6)
