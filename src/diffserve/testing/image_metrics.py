"""PSNR between 8-bit images: the number every parity test, benchmark and quality tier reports."""

from __future__ import annotations

import math

import numpy as np


def psnr_uint8(a, b) -> float:
    """Peak signal-to-noise ratio in dB of two uint8 images (arrays or PIL); inf when identical."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    mse = float(((a - b) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)
