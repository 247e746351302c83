"""What every family serving ControlNets per request shares (FLUX.1's recipe, `families/flux/controlnet.py`,
made family-neutral): a request's encoded entries (`EncodedControl`), the model checks of its `controlnets`,
Diffusers' sum of several ControlNets' samples, and the placement of each request's residuals on its rows
of a step batch (`BlockResiduals`, one group per sample-count signature).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from diffserve.configs.sampling_params import ControlNetChoice, SamplingParams
from diffserve.errors import InvalidRequestError
from diffserve.masks import pipeline_mask
from diffserve.models.controlnets.residuals import BlockResiduals
from diffserve.request import Req
from diffserve.runtime.runner import CfgBranchView
from diffserve.stages.image_tensor import image_to_tensor
from diffserve.stages.mask_preparation import mask_pixels


@dataclass
class EncodedControl:
    """One of a request's ControlNet entries, ready for the steps: the ControlNet's name, the packed control
    latents (one row per output), its scale, start and end fractions and Union mode."""

    name: str
    latents: torch.Tensor
    scale: float
    start: float
    end: float
    mode: int | None = None

    def acts_at(self, step: int, num_steps: int) -> bool:
        """Diffusers' `controlnet_keep` for this entry at `step` of `num_steps` (1.0 in Diffusers)."""
        return not (step / num_steps < self.start or (step + 1) / num_steps > self.end)


def check_controlnet_entries(
    params: SamplingParams, nets: Mapping[str, nn.Module], pipeline_name: str
) -> None:
    """The model checks of a request's `controlnets`: each name loaded, a mode exactly when the
    ControlNet's config has `num_mode` (a Union ControlNet with a mode token), within its modes, and a mask
    exactly when its config is `inpainting` (extra control channels for the masked image's mask)."""
    param = "controlnets"
    for i, entry in enumerate(params.controlnets):
        where = f"controlnets[{i}]"
        net = nets.get(entry.name)
        if net is None:
            loaded = ", ".join(repr(n) for n in nets) or "none (start the engine with --controlnet NAME=PATH)"
            raise InvalidRequestError(
                f"{where}.name {entry.name!r} is not a ControlNet this {pipeline_name} engine loaded; loaded: "
                f"{loaded}",
                param=param,
            )
        modes = getattr(net.config, "num_mode", None)
        if modes is None and entry.mode is not None:
            raise InvalidRequestError(
                f"{where}.mode (control_mode): {entry.name!r} is not a Union ControlNet; leave mode unset",
                param=param,
            )
        if modes is not None and (entry.mode is None or entry.mode >= modes):
            got = "none" if entry.mode is None else entry.mode
            raise InvalidRequestError(
                f"{where}.mode (control_mode): {entry.name!r} is a Union ControlNet; give a mode in "
                f"0..{modes - 1}, got {got}",
                param=param,
            )
        inpainting = bool(getattr(net.config, "inpainting", False))
        if inpainting and entry.mask is None:
            raise InvalidRequestError(
                f"{where}.mask (control_mask): {entry.name!r} is an inpainting ControlNet; send the mask of the "
                "area to repaint (white) with its image",
                param=param,
            )
        if not inpainting and entry.mask is not None:
            raise InvalidRequestError(
                f"{where}.mask (control_mask): {entry.name!r} is not an inpainting ControlNet; leave mask unset",
                param=param,
            )


def global_rng_stand_in(device: torch.device, seed: int | None) -> torch.Generator:
    """A generator for the control-image posterior draws Diffusers' SD3 ControlNet pipelines and Qwen-Image's
    inpainting one take from torch's global RNG: seeded with the request's seed (the draws then agree with
    Diffusers' when its global RNG is seeded with it too), a random seed without one. The request's own
    generator, which draws the initial noise, is left alone."""
    generator = torch.Generator(device)
    if seed is not None:
        generator.manual_seed(int(seed))
    else:
        generator.seed()
    return generator


@dataclass(frozen=True)
class InpaintingControl:
    """An inpainting ControlNet entry's inputs as Diffusers' ControlNet inpainting pipelines make them
    (`prepare_image_with_mask`): `masked` (1, 3, H, W) the control image resized to the output size
    (Lanczos) in [-1, 1], -1 where the mask repaints; `mask` (1, 1, H, W) the binarized mask, 1 = repaint."""

    masked: torch.Tensor
    mask: torch.Tensor

    @classmethod
    def of(cls, entry: ControlNetChoice, height: int, width: int) -> InpaintingControl:
        image = entry.image.convert("RGB").resize((width, height), Image.Resampling.LANCZOS)
        pixels = image_to_tensor(image)
        mask = mask_pixels(pipeline_mask(entry.mask), height, width)
        return cls(pixels.masked_fill(mask > 0.5, -1.0), mask)

    def kept_on(self, size: tuple[int, int]) -> torch.Tensor:
        """1 - the mask, (1, 1, *size), resized to the latent grid `size` by nearest-neighbour interpolation:
        the channel Diffusers appends to the masked image's latents (1 = keep). Qwen-Image's pipeline
        resizes with a frame axis of one, which nearest-neighbour leaves as it is."""
        return 1.0 - F.interpolate(self.mask, size=size)


def prompt_request(req: Req) -> Req:
    """The request whose `prompt_embeds` / `pooled_prompt_embeds` are the prompt's: `req` itself, or under
    CFG-parallel the request a `CfgBranchView` stands for. FLUX.1's and Qwen-Image's ControlNets read the
    prompt's text for both CFG branches (Diffusers adds the same residuals to the negative rows), so the
    negative branch's rank must run them on the prompt's text too, not on its own branch's."""
    if isinstance(req, CfgBranchView):
        assert req.source is not None
        return req.source
    return req


def merge_samples(total: list[torch.Tensor] | None, samples: list[torch.Tensor]) -> list[torch.Tensor]:
    """Diffusers' sum of several ControlNets' (or control images') samples: pairwise, as many as both have."""
    if total is None:
        return samples
    if not total or not samples:
        return total
    return [a + b for a, b in zip(total, samples)]  # noqa: B905 - Diffusers pairs them as zip does


def acting_entries(reqs: list[Req], inputs_of) -> list[tuple[int, int, EncodedControl]]:
    """(request index, entry index, entry) of every entry acting at its request's current step;
    `inputs_of(req)` lists a request's entries."""
    acting = []
    for r, req in enumerate(reqs):
        for k, entry in enumerate(inputs_of(req)):
            if entry.acts_at(req.step_index, req.num_steps):
                acting.append((r, k, entry))
    return acting


def samples_per_request(
    reqs: list[Req],
    inputs_of: Callable[[Req], list[EncodedControl]],
    run: Callable[[str, list[tuple[int, int, EncodedControl]]], dict[tuple[int, int], list[torch.Tensor]]],
) -> dict[int, list[torch.Tensor]]:
    """Each request's residual samples for this step, by request index (empty when no entry acts): the
    acting entries (`acting_entries`) grouped by ControlNet, each group run once (`run(name, entries)`: the
    samples per (request, entry) index), then summed per request in the order it listed its entries."""
    acting = acting_entries(reqs, inputs_of)
    by_net: dict[str, list[tuple[int, int, EncodedControl]]] = {}
    for item in acting:
        by_net.setdefault(item[2].name, []).append(item)
    samples: dict[tuple[int, int], list[torch.Tensor]] = {}
    for name, items in by_net.items():
        samples.update(run(name, items))
    per_request: dict[int, list[torch.Tensor]] = {}
    for r, k, _ in acting:
        per_request[r] = merge_samples(per_request.get(r), samples[(r, k)])
    return per_request


def double_stream_groups(
    reqs: list[Req],
    per_request: Mapping[int, list[torch.Tensor]],
    *,
    per_branch: bool = False,
    truncating: bool = False,
) -> list[BlockResiduals]:
    """Each request's summed samples on its rows of the step batch (`gather_branches` order: its prompt rows,
    then with CFG its negative rows, which get the same samples, as Diffusers adds them to both branches);
    requests whose sample counts agree share one group. `per_branch`: the samples already cover every row of
    the request (the ControlNet ran on each branch with its own text, as SD3's pipeline does); `truncating`:
    the DiT's sample arithmetic (`BlockResiduals`)."""
    offsets, offset = [], 0
    for req in reqs:
        offsets.append(offset)
        offset += req.batch_size * (2 if req.do_cfg else 1)
    total_rows = offset
    groups: dict[int, list[tuple[list[int], list[torch.Tensor]]]] = {}
    for r, samples in per_request.items():
        req, start = reqs[r], offsets[r]
        branches = 2 if req.do_cfg else 1
        rows = list(range(start, start + branches * req.batch_size))
        if branches == 2 and not per_branch:
            samples = [torch.cat([s, s]) for s in samples]
        groups.setdefault(len(samples), []).append((rows, samples))
    out = []
    for count, members in groups.items():
        rows = [row for member in members for row in member[0]]
        out.append(
            BlockResiduals(
                double=[torch.cat([m[1][j] for m in members]) for j in range(count)],
                single=(),
                rows=None if rows == list(range(total_rows)) else tuple(rows),
                truncating=truncating,
            )
        )
    return out
