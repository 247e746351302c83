"""A PIL image as the tensor every VAE encoder takes."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image


def image_to_tensor(image: Image.Image) -> torch.Tensor:
    """RGB PIL image -> (1, 3, H, W) float32 in [-1, 1]."""
    array = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
    return torch.from_numpy(array).permute(2, 0, 1)[None] * 2.0 - 1.0
