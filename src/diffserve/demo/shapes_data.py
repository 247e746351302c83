"""A procedural dataset of coloured shapes, made in code (no downloads), for the shipped demo model.

Every image is 64x64 RGB: one shape (circle, square or triangle) in a named colour and size, at one
of five positions, on a plain background. Its caption names all five attributes, e.g.

    "a small red circle at the top left on a black background"

Shape colours are the six saturated corners of the RGB cube and backgrounds are black, white and
gray, so every pair of named colours is far apart and a shape never has its background's colour
(the colour words of the two roles are disjoint, too).

Some attribute *combinations* are held out of training entirely: for each (colour, position) pair
one (shape, background) pair is chosen with a fixed seed, 30 of the 270 (shape, colour, position,
background) combinations (11%), both sizes. The demo model's adherence is measured on those
captions, which it never saw.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from itertools import product
from typing import NamedTuple

import numpy as np
from PIL import Image, ImageDraw

IMAGE_SIZE = 64
#: Shapes are drawn this many times larger, then box-filtered down: smooth (anti-aliased) edges.
SUPERSAMPLE = 4

SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
SHAPE_COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (255, 0, 0),
    "green": (0, 255, 0),
    "blue": (0, 0, 255),
    "yellow": (255, 255, 0),
    "magenta": (255, 0, 255),
    "cyan": (0, 255, 255),
}
BACKGROUND_COLOURS: dict[str, tuple[int, int, int]] = {
    "black": (0, 0, 0),
    "white": (255, 255, 255),
    "gray": (128, 128, 128),
}
#: Shape radius in pixels (circle radius; squares and triangles are scaled to look alike in size).
SIZES: dict[str, float] = {"small": 7.0, "large": 12.0}
#: Shape centre (x, y) in pixels for each position.
POSITIONS: dict[str, tuple[float, float]] = {
    "top left": (16.0, 16.0),
    "top right": (48.0, 16.0),
    "bottom left": (16.0, 48.0),
    "bottom right": (48.0, 48.0),
    "center": (32.0, 32.0),
}
#: How a position reads in a caption.
POSITION_PHRASES: dict[str, str] = {
    "top left": "at the top left",
    "top right": "at the top right",
    "bottom left": "at the bottom left",
    "bottom right": "at the bottom right",
    "center": "in the center",
}

#: Held-out split: one (shape, background) per (colour, position), drawn with this seed.
HELD_OUT_SEED = 20240601
#: Training images are shifted by up to this many pixels in x and y (the eval regions allow it).
MAX_OFFSET = 2


@dataclass(frozen=True)
class Attributes:
    """What one image shows; `caption(attrs)` says it in words."""

    shape: str
    colour: str
    size: str
    position: str
    background: str

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("shape", self.shape, SHAPES),
            ("colour", self.colour, SHAPE_COLOURS),
            ("size", self.size, SIZES),
            ("position", self.position, POSITIONS),
            ("background", self.background, BACKGROUND_COLOURS),
        ):
            if value not in allowed:
                raise ValueError(f"unknown {name} {value!r}; choose one of: {', '.join(allowed)}")

    @property
    def combination(self) -> Combination:
        """The attributes the held-out split is defined on (size left out)."""
        return Combination(self.shape, self.colour, self.position, self.background)


class Combination(NamedTuple):
    shape: str
    colour: str
    position: str
    background: str


def caption(attrs: Attributes) -> str:
    """'a {size} {colour} {shape} {position phrase} on a {background} background'."""
    return (
        f"a {attrs.size} {attrs.colour} {attrs.shape} {POSITION_PHRASES[attrs.position]} "
        f"on a {attrs.background} background"
    )


def all_combinations() -> list[Attributes]:
    """Every attribute set, in a fixed order (3 shapes x 6 colours x 2 sizes x 5 positions x 3 backgrounds)."""
    return [
        Attributes(shape, colour, size, position, background)
        for shape, colour, size, position, background in product(
            SHAPES, SHAPE_COLOURS, SIZES, POSITIONS, BACKGROUND_COLOURS
        )
    ]


def vocabulary() -> list[str]:
    """Every word of every caption, in order of first appearance (deterministic)."""
    words: dict[str, None] = {}
    for attrs in all_combinations():
        for word in caption(attrs).split():
            words.setdefault(word, None)
    return list(words)


def held_out_combinations() -> list[Combination]:
    """The (shape, colour, position, background) combinations never shown in training (30 of 270):
    for each (colour, position), in a fixed order, one (shape, background) drawn with HELD_OUT_SEED."""
    rng = random.Random(HELD_OUT_SEED)
    pairs = list(product(SHAPES, BACKGROUND_COLOURS))
    held = []
    for colour, position in product(SHAPE_COLOURS, POSITIONS):
        shape, background = rng.choice(pairs)
        held.append(Combination(shape, colour, position, background))
    return held


def is_held_out(attrs: Attributes) -> bool:
    return attrs.combination in set(held_out_combinations())


def training_combinations() -> list[Attributes]:
    """`all_combinations()` without the held-out combinations (480 of 540)."""
    held = set(held_out_combinations())
    return [a for a in all_combinations() if a.combination not in held]


def held_out_attributes() -> list[Attributes]:
    """Both sizes of every held-out combination (60 attribute sets), in a fixed order."""
    return [
        Attributes(c.shape, c.colour, size, c.position, c.background)
        for c in held_out_combinations()
        for size in SIZES
    ]


def _shape_polygon(shape: str, cx: float, cy: float, r: float) -> list[tuple[float, float]] | None:
    if shape == "square":
        half = r * 0.886  # same area as the circle of radius r
        return [
            (cx - half, cy - half),
            (cx + half, cy - half),
            (cx + half, cy + half),
            (cx - half, cy + half),
        ]
    if shape == "triangle":
        half_base, height = r * 1.1, r * 1.1 * 3**0.5  # equilateral, pointing up, centred on its box
        return [(cx, cy - height / 2), (cx + half_base, cy + height / 2), (cx - half_base, cy + height / 2)]
    return None


def render(attrs: Attributes, offset: tuple[int, int] = (0, 0)) -> Image.Image:
    """Draw the image for `attrs` (deterministic); `offset` shifts the shape by (dx, dy) pixels."""
    s = SUPERSAMPLE
    canvas = Image.new("RGB", (IMAGE_SIZE * s, IMAGE_SIZE * s), BACKGROUND_COLOURS[attrs.background])
    draw = ImageDraw.Draw(canvas)
    cx, cy = POSITIONS[attrs.position]
    cx, cy, r = (cx + offset[0]) * s, (cy + offset[1]) * s, SIZES[attrs.size] * s
    fill = SHAPE_COLOURS[attrs.colour]
    polygon = _shape_polygon(attrs.shape, cx, cy, r)
    if polygon is None:
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    else:
        draw.polygon(polygon, fill=fill)
    return canvas.resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BOX)


@dataclass
class ShapesDataset:
    images: np.ndarray  # (N, 64, 64, 3) uint8
    captions: list[str]
    attributes: list[Attributes]


def make_dataset(num_images: int, seed: int = 0, max_offset: int = MAX_OFFSET) -> ShapesDataset:
    """`num_images` training images: attribute sets drawn uniformly from `training_combinations()`,
    each shifted by a random offset of up to `max_offset` pixels. Same seed, same dataset."""
    rng = random.Random(seed)
    combos = training_combinations()
    images = np.empty((num_images, IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
    attributes: list[Attributes] = []
    cache: dict[tuple[Attributes, tuple[int, int]], np.ndarray] = {}
    for i in range(num_images):
        attrs = rng.choice(combos)
        offset = (rng.randint(-max_offset, max_offset), rng.randint(-max_offset, max_offset))
        key = (attrs, offset)
        if key not in cache:
            cache[key] = np.asarray(render(attrs, offset))
        images[i] = cache[key]
        attributes.append(attrs)
    return ShapesDataset(images=images, captions=[caption(a) for a in attributes], attributes=attributes)
