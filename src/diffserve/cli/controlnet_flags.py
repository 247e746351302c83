"""`diffserve generate`'s ControlNet flags: `--control-image PATH` with Diffusers' keyword names
(`--controlnet-conditioning-scale`, `--control-guidance-start` / `--control-guidance-end`, `--control-mode`,
an inpainting ControlNet's `--control-mask`),
applied to the one ControlNet the run loads (`--controlnet NAME=PATH`, an engine flag, or a pipeline folder's
own `controlnet` component, named "default"). They make `SamplingParams.controlnets` (one entry); the
values are checked here, before the model loads, each error naming its flag."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path

from diffserve.configs.sampling_params import MAX_CONTROLNET_SCALE, ControlNetChoice
from diffserve.errors import UserError

#: The ControlNet flags besides `--control-image`, by `argparse` dest: what each needs the image for.
_NEEDS_IMAGE = {
    "controlnet_conditioning_scale": "--controlnet-conditioning-scale",
    "control_guidance_start": "--control-guidance-start",
    "control_guidance_end": "--control-guidance-end",
    "control_mode": "--control-mode",
    "control_mask": "--control-mask",
}


def add_controlnet_flags(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--control-image", default=None, metavar="PATH",
        help="the control image of the ControlNet loaded with --controlnet NAME=PATH (or of a ControlNet "
        "pipeline folder's own); resized to the output size")  # fmt: skip
    add("--controlnet-conditioning-scale", type=float, default=None, metavar="SCALE",
        help=f"the ControlNet's scale, 0..{MAX_CONTROLNET_SCALE:g} (default 1.0)")  # fmt: skip
    add("--control-guidance-start", type=float, default=None, metavar="FRACTION",
        help="fraction of the schedule where the ControlNet starts acting, 0..1 (default 0)")  # fmt: skip
    add("--control-guidance-end", type=float, default=None, metavar="FRACTION",
        help="fraction of the schedule where it stops, 0..1, above the start (default 1)")  # fmt: skip
    add("--control-mode", type=int, default=None, metavar="MODE",
        help="a Union ControlNet's control mode, an integer >= 0 (other ControlNets take none)")  # fmt: skip
    add("--control-mask", default=None, metavar="PATH",
        help="the mask of an inpainting ControlNet (other ControlNets take none): white = repaint, black = "
        "keep (or, with alpha, transparent = repaint); resized to the output size")  # fmt: skip


def _folder_controlnet(model_path: str | None) -> bool:
    """Whether the model folder's model_index.json lists a `controlnet` component (a pipeline folder)."""
    if not model_path:
        return False
    try:
        index = json.loads((Path(model_path).expanduser() / "model_index.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(index, dict) and "controlnet" in index


def controlnet_name(args: argparse.Namespace) -> str:
    """The name of the one ControlNet the run loads; UserError when it loads none or several."""
    loaded = list(getattr(args, "controlnets", None) or [])
    if len(loaded) > 1:
        raise UserError(
            f"--control-image applies to one ControlNet, but --controlnet was given {len(loaded)} times; "
            "load only the one to apply (several per request: the server's controlnets field)"
        )
    if loaded:
        from diffserve.configs.engine_args import controlnet_specs

        return controlnet_specs(loaded)[0].name
    if _folder_controlnet(getattr(args, "model_path", None)):
        return "default"
    raise UserError("--control-image needs a ControlNet: load one with --controlnet NAME=PATH")


def controlnet_choices_from(args: argparse.Namespace) -> list[ControlNetChoice]:
    """The run's `controlnets` (empty without --control-image), its image and mask not yet read (`image`
    and `mask` None: the caller loads `args.control_image` and `args.control_mask` after the checks:
    `with_control_inputs`). UserError naming the flag for a bad value."""
    if args.control_image is None:
        stray = [flag for dest, flag in _NEEDS_IMAGE.items() if getattr(args, dest) is not None]
        if stray:
            raise UserError(
                f"{stray[0]} needs --control-image PATH (and a ControlNet: --controlnet NAME=PATH)"
            )
        return []
    scale = 1.0 if args.controlnet_conditioning_scale is None else args.controlnet_conditioning_scale
    start = 0.0 if args.control_guidance_start is None else args.control_guidance_start
    end = 1.0 if args.control_guidance_end is None else args.control_guidance_end
    if not (math.isfinite(scale) and 0 <= scale <= MAX_CONTROLNET_SCALE):
        raise UserError(
            f"--controlnet-conditioning-scale must be a number in [0, {MAX_CONTROLNET_SCALE:g}], got {scale:g}"
        )
    for flag, value in (("--control-guidance-start", start), ("--control-guidance-end", end)):
        if not (math.isfinite(value) and 0 <= value <= 1):
            raise UserError(f"{flag} must be a number in [0, 1], got {value:g}")
    if not start < end:
        raise UserError(
            f"--control-guidance-start ({start:g}) must be below --control-guidance-end ({end:g})"
        )
    if args.control_mode is not None and args.control_mode < 0:
        raise UserError(f"--control-mode must be an integer >= 0, got {args.control_mode}")
    return [ControlNetChoice(controlnet_name(args), None, scale, start, end, args.control_mode)]


def with_control_inputs(choice: ControlNetChoice, args: argparse.Namespace) -> ControlNetChoice:
    """`choice` with `--control-image` read and `--control-mask`, if given, read as the pipelines read it
    (`pipeline_mask`: white or transparent pixels repaint); paths only, errors naming the flag."""
    from diffserve.image_inputs import load_images
    from diffserve.masks import pipeline_mask

    image = load_images(Path(args.control_image), param="--control-image")[0]
    mask = None
    if args.control_mask is not None:
        mask = pipeline_mask(load_images(Path(args.control_mask), param="--control-mask", as_mask=True)[0])
    return replace(choice, image=image, mask=mask)
