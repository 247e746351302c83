"""ControlNets for Qwen-Image text-to-image, per request (Diffusers' `QwenImageControlNetPipeline`, one
ControlNet, or one Union ControlNet over several control images as its `QwenImageMultiControlNetModel`).

The engine holds named ControlNets (`loader/controlnets.py`); a request lists the ones it applies
(`SamplingParams.controlnets`; the same name several times is Diffusers' Multi form). Diffusers' recipe:

1. each control image, resized to the output size (Lanczos) and repeated once per output, is encoded by
   the video VAE as one frame with a *sampled* posterior, normalised by the VAE's per-channel statistics,
   in the order listed and before the initial noise is drawn (each draw from the request's generator),
   then packed into 2x2 tokens;
2. at step `i` of `n`, an entry acts unless `i / n < start` or `(i + 1) / n > end`; an acting entry's
   ControlNet reads the noisy latents, its control latents, the prompt's text states (and mask) and the
   timestep, and returns per-block residuals times its scale. A request's entries' residuals are summed in
   order, and added to the DiT's image stream for the prompt's rows and, with true CFG, the same ones for
   the negative prompt's rows.

An inpainting ControlNet (`extra_condition_channels`, Diffusers' `QwenImageControlNetInpaintPipeline`)
takes an entry's image with its `mask`: the image with its repainted area set to black (-1), encoded as in
step 1 but with the posterior drawn apart from the request's generator (Diffusers draws it from torch's
global RNG), with `1 - mask` on the latent grid appended as a 17th channel before packing.

In a step batch, each ControlNet runs once over the rows of every request that applies it at that step;
the DiT adds each request's sum to its own rows only: requests without a ControlNet keep their values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from diffserve.configs.sampling_params import ControlNetChoice
from diffserve.models.controlnets.qwen_image import QwenControlNetBatch, QwenImageControlNetModel
from diffserve.pipelines.cfg_batch import pad_text
from diffserve.pipelines.controlnet_conditioning import ControlImageStage, EncodedControlRunner
from diffserve.pipelines.controlnet_steps import (
    EncodedControl,
    InpaintingControl,
    global_rng_stand_in,
    prompt_request,
)
from diffserve.request import Req
from diffserve.stages.image_to_image import encode_sampled_video_vae
from diffserve.stages.latent_preparation import pack_latents
from diffserve.stages.reference_images import ReferenceImages


@dataclass
class QwenImageConditioning(ReferenceImages):
    """Qwen-Image text-to-image's: `ReferenceImages` (empty here) and the request's ControlNet entries."""

    #: Set by `QwenControlImageEncodingStage`; empty without any.
    controls: list[EncodedControl] = field(default_factory=list)


class QwenControlImageEncodingStage(ControlImageStage):
    """Step 1 above: every control image's packed latents into the conditioning's `controls`. Runs before
    the input image's encoding and the initial noise: its posterior draws come first from the generator.
    It reads no ControlNet: an inpainting entry is the one with a mask (`check_controlnet_entries`)."""

    needs = ("generator",)

    def __init__(self, vae: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(vae, {}, device, dtype)

    def encode_controls(self, req: Req) -> None:
        p = req.params
        inputs = []
        for entry in p.controlnets:
            if entry.mask is not None:  # an inpainting ControlNet (`check_controlnet_entries`)
                latents = self._inpainting_latents(entry, req)
            else:
                pixels = self.control_pixels(entry, req, req.batch_size)
                latents = encode_sampled_video_vae(self.vae, pixels, req.generator)
            packed = pack_latents(latents.to(device=self.device, dtype=self.dtype))
            inputs.append(EncodedControl(entry.name, packed, entry.scale, entry.start, entry.end, entry.mode))
        QwenImageConditioning.of(req).controls = inputs

    def _inpainting_latents(self, entry: ControlNetChoice, req: Req) -> torch.Tensor:
        """Step 1 for an inpainting ControlNet (`QwenImageControlNetInpaintPipeline`): the masked image, one
        row per output, encoded as one frame with a sampled posterior and normalised, with `1 - mask` on
        the latent grid appended as a 17th channel (packed: 68). Diffusers draws that posterior from
        torch's global RNG, not from the request's generator: here it comes from a generator of its own
        seeded with the request's seed (the two agree when the global RNG is seeded with it too), and the
        request's generator, which draws the initial noise, is left alone."""
        p = req.params
        generator = global_rng_stand_in(next(self.vae.parameters()).device, p.seed)
        control = InpaintingControl.of(entry, p.height, p.width)
        latents = encode_sampled_video_vae(
            self.vae, control.masked.repeat(req.batch_size, 1, 1, 1), generator
        )
        return self.with_kept_channel(latents, control)


class QwenControlNetRunner(EncodedControlRunner[QwenImageControlNetModel]):
    """Runs the ControlNets of one step batch and hands the DiT each request's residuals."""

    conditioning_type = QwenImageConditioning

    def run_net(
        self, net: QwenImageControlNetModel, reqs: list[Req], items: list[tuple[int, int, EncodedControl]]
    ) -> list[torch.Tensor]:
        """One forward of `net` over the rows of `items`: its per-block samples."""
        latents, control, texts, timesteps, scales, shapes = [], [], [], [], [], []
        for r, _, entry in items:
            req = reqs[r]
            n, device = req.batch_size, req.latents.device
            height, width = req.latent_size
            latents.append(req.latents)
            control.append(entry.latents)
            texts.append(prompt_request(req).prompt_embeds)  # the prompt's text on both CFG ranks
            timesteps.append(req.schedule.timesteps[req.step_index].expand(n).to(req.latents.dtype) / 1000)
            scales.append(torch.full((n,), float(entry.scale), dtype=torch.float32, device=device))
            shapes.extend([[(1, height // 2, width // 2)]] * n)
        text, text_mask = pad_text(texts)
        batch = QwenControlNetBatch(
            latents=torch.cat(latents),
            control=torch.cat(control),
            text=text,
            text_mask=text_mask,
            timestep=torch.cat(timesteps),
            scales=torch.cat(scales),
            img_shapes=shapes,
        )
        return net(batch)
