"""Does an image show what its `Attributes` ask for? A simple, deterministic measurement.

    region      = the expected box for the position: its quadrant (32x32), or the central 32x32 box
    background  = per-channel median of the pixels outside the region -> nearest named background;
                  the check passes when that is the asked-for background and at least 85% of the
                  outside pixels lie close to it (noise or a second shape fails it)
    foreground  = pixels far from the measured background colour
    position    = at least MIN_PIXELS foreground pixels in the region and at least 75% of all
                  foreground pixels inside it
    colour      = majority vote of the nearest named shape colour over the foreground pixels in the
                  region equals the asked-for colour

`matches` = colour and position and background. The size (foreground area against a threshold) and
the shape (the rendered template, centred on the foreground's bounding box, with the best overlap)
are reported too, for information; they are not part of `matches`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image

from diffserve.demo.shapes_data import (
    BACKGROUND_COLOURS,
    IMAGE_SIZE,
    SHAPE_COLOURS,
    SHAPES,
    Attributes,
    render,
)

#: A pixel is foreground when its RGB distance to the measured background exceeds this.
FOREGROUND_DISTANCE = 80.0
#: An outside pixel counts as background when within this RGB distance of the named background.
BACKGROUND_DISTANCE = 60.0
BACKGROUND_PURITY = 0.85
POSITION_FRACTION = 0.75
MIN_PIXELS = 30
#: Foreground areas above this (pixels) read as "large": between the largest small shape (~154 px)
#: and the smallest large one (~300 px).
LARGE_AREA = 216.0

_HALF = IMAGE_SIZE // 2
_QUARTER = IMAGE_SIZE // 4
#: (x0, y0, x1, y1), end-exclusive, of the expected region of each position.
REGIONS: dict[str, tuple[int, int, int, int]] = {
    "top left": (0, 0, _HALF, _HALF),
    "top right": (_HALF, 0, IMAGE_SIZE, _HALF),
    "bottom left": (0, _HALF, _HALF, IMAGE_SIZE),
    "bottom right": (_HALF, _HALF, IMAGE_SIZE, IMAGE_SIZE),
    "center": (_QUARTER, _QUARTER, IMAGE_SIZE - _QUARTER, IMAGE_SIZE - _QUARTER),
}

_SHAPE_NAMES = list(SHAPE_COLOURS)
_SHAPE_RGB = np.array([SHAPE_COLOURS[n] for n in _SHAPE_NAMES], dtype=np.float32)
_BACKGROUND_NAMES = list(BACKGROUND_COLOURS)
_BACKGROUND_RGB = np.array([BACKGROUND_COLOURS[n] for n in _BACKGROUND_NAMES], dtype=np.float32)


@dataclass(frozen=True)
class Measurement:
    colour: bool
    position: bool
    background: bool
    size: bool
    shape: bool
    detected_colour: str | None
    detected_background: str
    detected_size: str | None
    detected_shape: str | None
    background_purity: float
    foreground_in_region: int
    foreground_fraction_in_region: float

    @property
    def matches(self) -> bool:
        return self.colour and self.position and self.background


def _as_array(image: Image.Image | np.ndarray) -> np.ndarray:
    array = np.asarray(image.convert("RGB") if isinstance(image, Image.Image) else image, dtype=np.float32)
    if array.shape != (IMAGE_SIZE, IMAGE_SIZE, 3):
        raise ValueError(f"expected a {IMAGE_SIZE}x{IMAGE_SIZE} RGB image, got shape {array.shape}")
    return array


def region_mask(position: str) -> np.ndarray:
    x0, y0, x1, y1 = REGIONS[position]
    mask = np.zeros((IMAGE_SIZE, IMAGE_SIZE), dtype=bool)
    mask[y0:y1, x0:x1] = True
    return mask


def _nearest(colours: np.ndarray, palette: np.ndarray) -> np.ndarray:
    return np.linalg.norm(colours[:, None, :] - palette[None, :, :], axis=-1).argmin(axis=1)


def _closest_shape(foreground: np.ndarray, size: str, colour: str, background: str) -> str | None:
    """The shape whose template, centred on the foreground's bounding box, overlaps it best (IoU)."""
    ys, xs = np.nonzero(foreground)
    if len(xs) < MIN_PIXELS:
        return None
    centre_x, centre_y = (xs.min() + xs.max() + 1) / 2, (ys.min() + ys.max() + 1) / 2
    offset = (round(centre_x - IMAGE_SIZE / 2), round(centre_y - IMAGE_SIZE / 2))
    best, best_iou = None, -1.0
    for shape in SHAPES:
        template = np.asarray(
            render(Attributes(shape, colour, size, "center", background), offset), np.float32
        )
        bg = np.array(BACKGROUND_COLOURS[background], np.float32)
        mask = np.linalg.norm(template - bg, axis=-1) > FOREGROUND_DISTANCE
        iou = (mask & foreground).sum() / max(1, (mask | foreground).sum())
        if iou > best_iou:
            best, best_iou = shape, iou
    return best


def measure(image: Image.Image | np.ndarray, attrs: Attributes) -> Measurement:
    """Check a 64x64 RGB image against `attrs` (see the module docstring for the rules)."""
    pixels = _as_array(image)
    region = region_mask(attrs.position)

    outside = pixels[~region]
    bg_rgb = np.median(outside, axis=0)
    detected_background = _BACKGROUND_NAMES[int(_nearest(bg_rgb[None], _BACKGROUND_RGB)[0])]
    named_bg = np.array(BACKGROUND_COLOURS[detected_background], np.float32)
    purity = float((np.linalg.norm(outside - named_bg, axis=-1) <= BACKGROUND_DISTANCE).mean())
    background_ok = detected_background == attrs.background and purity >= BACKGROUND_PURITY

    foreground = np.linalg.norm(pixels - bg_rgb, axis=-1) > FOREGROUND_DISTANCE
    inside = foreground & region
    n_inside, n_total = int(inside.sum()), int(foreground.sum())
    fraction = n_inside / n_total if n_total else 0.0
    position_ok = n_inside >= MIN_PIXELS and fraction >= POSITION_FRACTION

    detected_colour = detected_size = detected_shape = None
    if n_inside:
        votes = np.bincount(_nearest(pixels[inside], _SHAPE_RGB), minlength=len(_SHAPE_NAMES))
        detected_colour = _SHAPE_NAMES[int(votes.argmax())]
    if n_inside >= MIN_PIXELS:
        detected_size = "large" if n_inside > LARGE_AREA else "small"
        detected_shape = _closest_shape(inside, detected_size, attrs.colour, attrs.background)
    return Measurement(
        colour=detected_colour == attrs.colour,
        position=position_ok,
        background=background_ok,
        size=detected_size == attrs.size,
        shape=detected_shape == attrs.shape,
        detected_colour=detected_colour,
        detected_background=detected_background,
        detected_size=detected_size,
        detected_shape=detected_shape,
        background_purity=purity,
        foreground_in_region=n_inside,
        foreground_fraction_in_region=fraction,
    )


def match_rate(measurements: list[Measurement]) -> float:
    return sum(m.matches for m in measurements) / len(measurements) if measurements else 0.0


def summarize(measurements: list[Measurement]) -> dict[str, float]:
    """Rates of each check over a list of measurements."""
    n = max(1, len(measurements))
    return {
        "matches": match_rate(measurements),
        "colour": sum(m.colour for m in measurements) / n,
        "position": sum(m.position for m in measurements) / n,
        "background": sum(m.background for m in measurements) / n,
        "size": sum(m.size for m in measurements) / n,
        "shape": sum(m.shape for m in measurements) / n,
    }
