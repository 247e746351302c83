"""The family-neutral frame of per-request ControlNets around the steps of `pipelines/controlnet_steps.py`:
the stage that encodes a request's control images (`ControlImageStage`: a family's encoding in
`encode_controls`, with the control image as pixels and an inpainting entry's latents with their
kept-area channel), and the runner of the ControlNets of a step batch for families whose requests carry
`EncodedControl` entries and whose ControlNets return double-stream samples only (`EncodedControlRunner`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Generic, Protocol, TypeVar

import torch
from PIL import Image
from torch import nn

from diffserve.configs.sampling_params import ControlNetChoice
from diffserve.models.controlnets.residuals import BlockResiduals
from diffserve.pipelines.controlnet_steps import (
    EncodedControl,
    InpaintingControl,
    double_stream_groups,
    samples_per_request,
)
from diffserve.request import Req
from diffserve.stages.base import Stage
from diffserve.stages.image_tensor import image_to_tensor

NetT = TypeVar("NetT", bound=nn.Module)


class ControlImageStage(Stage):
    """Base of a family's control-image stage: a request's ControlNet entries encoded before the steps
    (`encode_controls`, which sets them on the request's conditioning); a request without entries passes
    through. Holds the VAE, the engine's ControlNets by name (the pipeline's dict, filled after the stages
    are built, so read per request) and the device and dtype the encoded controls go to."""

    def __init__(
        self, vae: nn.Module, nets: Mapping[str, nn.Module], device: torch.device, dtype: torch.dtype
    ) -> None:
        self.vae = vae
        self.nets = nets
        self.device = device
        self.dtype = dtype

    @torch.inference_mode()
    def forward(self, req: Req) -> Req:
        if req.params.controlnets:
            self.encode_controls(req)
        return req

    def encode_controls(self, req: Req) -> None:
        """Encode every entry of `req.params.controlnets` into the request's conditioning."""
        raise NotImplementedError

    @staticmethod
    def control_pixels(entry: ControlNetChoice, req: Req, rows: int) -> torch.Tensor:
        """`entry`'s control image as Diffusers' ControlNet pipelines prepare it: RGB, resized to the
        request's output size (Lanczos), in [-1, 1], repeated to `rows` rows, (rows, 3, height, width)."""
        p = req.params
        image = entry.image.convert("RGB").resize((p.width, p.height), Image.Resampling.LANCZOS)
        return image_to_tensor(image).repeat(rows, 1, 1, 1)

    @staticmethod
    def with_kept_channel(latents: torch.Tensor, control: InpaintingControl) -> torch.Tensor:
        """An inpainting ControlNet's control latents: the masked image's `latents` (B, C, h, w) with
        `1 - mask` on their grid appended as one more channel (B, C + 1, h, w), as Diffusers' inpainting
        ControlNet pipelines append it."""
        kept = control.kept_on(tuple(latents.shape[-2:])).to(latents)
        return torch.cat([latents, kept.expand(latents.shape[0], -1, -1, -1)], dim=1)


class WithControls(Protocol):
    """A family's conditioning that carries its request's encoded ControlNet entries."""

    controls: list[EncodedControl]


class EncodedControlRunner(Generic[NetT]):
    """Runs the ControlNets of one step batch and hands the DiT each request's residuals, for a family
    whose requests carry `EncodedControl` entries on a `conditioning_type` conditioning and whose
    ControlNets return double-stream samples: each ControlNet once over the acting entries' rows
    (`run_net`), each request's samples summed and placed on its rows (`double_stream_groups`, with this
    family's `per_branch` and `truncating`)."""

    conditioning_type: ClassVar[type[WithControls]]
    #: `double_stream_groups`' flags: the samples cover every CFG branch's rows; the DiT's sample arithmetic.
    per_branch: ClassVar[bool] = False
    truncating: ClassVar[bool] = False

    def __init__(self, nets: Mapping[str, NetT]) -> None:
        self.nets = nets

    def controls_of(self, req: Req) -> list[EncodedControl]:
        """`req`'s encoded entries (none when its conditioning is not this family's)."""
        conditioning = req.conditioning
        return conditioning.controls if isinstance(conditioning, self.conditioning_type) else []

    def residuals(self, reqs: list[Req]) -> list[BlockResiduals]:
        """The DiT's residual groups for this step (empty when no entry acts)."""
        per_request = samples_per_request(
            reqs, self.controls_of, lambda name, items: self._samples(self.nets[name], reqs, items)
        )
        if not per_request:
            return []
        return double_stream_groups(reqs, per_request, per_branch=self.per_branch, truncating=self.truncating)

    def _samples(
        self, net: NetT, reqs: list[Req], items: list[tuple[int, int, EncodedControl]]
    ) -> dict[tuple[int, int], list[torch.Tensor]]:
        """`run_net`'s samples split back into each (request, entry) index's rows: a request's outputs, on
        each of its CFG branches with `per_branch`."""
        samples = self.run_net(net, reqs, items)
        result, start = {}, 0
        for r, k, _ in items:
            req = reqs[r]
            stop = start + req.batch_size * (2 if self.per_branch and req.do_cfg else 1)
            result[(r, k)] = [s[start:stop] for s in samples]
            start = stop
        return result

    def run_net(
        self, net: NetT, reqs: list[Req], items: list[tuple[int, int, EncodedControl]]
    ) -> list[torch.Tensor]:
        """One forward of `net` over the rows of `items`, in their order: its per-block samples."""
        raise NotImplementedError
