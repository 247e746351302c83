"""Render the README's grid of images from the shipped demo model, through diffserve.

    .venv/bin/python tools/make_demo_grid.py            # writes outputs/demo-grid.png
    .venv/bin/python tools/make_demo_grid.py --out docs/demo-grid.png --force   # replaces the README's

Every tile is a real generation (the folder's recommended settings, seed = tile index); the prompts
are printed in reading order so the README can list them. CPU float32 results can differ by one level
on a few pixels between machines and thread counts, so the tracked `docs/demo-grid.png` is replaced
only when asked (`--force`), never by a plain run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from PIL import Image

from diffserve import DiffGenerator
from diffserve.configs.demo_model import demo_model_path

PROMPTS = [
    "a large red circle in the center on a black background",
    "a small green square at the top left on a white background",
    "a large blue triangle at the bottom right on a gray background",
    "a small yellow circle at the top right on a black background",
    "a large magenta square at the bottom left on a white background",
    "a small cyan triangle in the center on a gray background",
    "a large yellow square at the top left on a gray background",
    "a small red triangle at the bottom right on a white background",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/demo-grid.png")
    parser.add_argument("--force", action="store_true", help="replace --out if it exists")
    parser.add_argument("--columns", type=int, default=4)
    parser.add_argument("--scale", type=int, default=3, help="nearest-neighbour upscale of each 64x64 tile")
    args = parser.parse_args()
    out = Path(args.out)
    if out.exists() and not args.force:
        parser.exit(2, f"error: {out} exists; pass --force to replace it\n")

    gen = DiffGenerator.from_pretrained(demo_model_path(), device="cpu", show_progress=False)
    tiles = [gen.generate(prompt=p, seed=i).images[0] for i, p in enumerate(PROMPTS)]
    w, h = tiles[0].size
    w, h = w * args.scale, h * args.scale
    rows = (len(tiles) + args.columns - 1) // args.columns
    pad = 4
    grid = Image.new("RGB", (args.columns * (w + pad) + pad, rows * (h + pad) + pad), (255, 255, 255))
    for i, tile in enumerate(tiles):
        r, c = divmod(i, args.columns)
        grid.paste(tile.resize((w, h), Image.NEAREST), (pad + c * (w + pad), pad + r * (h + pad)))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    grid.save(out)
    print(f"wrote {args.out}")
    for i, prompt in enumerate(PROMPTS):
        print(f"{i}: {prompt} (seed {i})")


if __name__ == "__main__":
    main()
