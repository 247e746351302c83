"""ControlNets for SD3 text-to-image, per request (Diffusers' `StableDiffusion3ControlNetPipeline`, one
ControlNet or several as its `SD3MultiControlNetModel`).

The engine holds named ControlNets (`loader/controlnets.py`); a request lists the ones it applies
(`SamplingParams.controlnets`). Diffusers' recipe, which differs from FLUX.1's and Qwen-Image's:

1. each control image, resized to the output size (Lanczos) and repeated once per output and, with CFG,
   once per branch (the negative branch's rows first), is VAE-encoded with a *sampled* posterior, then
   `(z - shift) * scale` (shift 0 for the InstantX ControlNets, `force_zeros_for_pooled_projection`).
   Diffusers draws that posterior noise from torch's global RNG; here it comes from a generator of its own
   seeded with the request's seed, so that the two agree when the global RNG is seeded with it too (the
   request's generator, which draws the initial noise, is left alone);
2. at step `i` of `n`, an entry acts unless `i / n < start` or `(i + 1) / n > end`; an acting entry's
   ControlNet runs on every branch with that branch's latents, control latents, text and pooled embedding
   (zeros with `force_zeros_for_pooled_projection`) and timestep, and returns per-block residuals times its
   scale; a request's entries' residuals are summed in order, each branch its own. SD3.5-Large's
   ControlNets (`SD3SingleStreamControlNetModel`) read no text and patch the latents with a copy of the
   DiT's `pos_embed`, handed to them by the pipeline's `use_controlnets`.

An inpainting ControlNet (`extra_conditioning_channels`, Diffusers' `StableDiffusion3ControlNetInpainting
Pipeline`) takes an entry's image with its `mask` instead: the image with its repainted area set to black
(-1) is encoded once per output (`(z - shift) * scale`, the shift always), `1 - mask` on the latent grid is
appended as a 17th channel, both CFG branches take those same rows, and its pooled projection is zeros.

In a step batch, each ControlNet runs once over the rows of every request that applies it at that step;
the DiT adds each request's sums to its own rows only.

A deliberate difference: Diffusers' `SD3MultiControlNetModel` call reads `force_zeros_for_pooled_projection`
(zeros for the pooled projection, no VAE shift) from its first ControlNet's config for all of them; here
each entry follows its own ControlNet's config, which is what that ControlNet was trained with. They differ
only for a request listing ControlNets of both kinds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from diffserve.configs.sampling_params import ControlNetChoice
from diffserve.models.controlnets.sd3 import SD3ControlNetModel
from diffserve.pipelines.controlnet_conditioning import ControlImageStage, EncodedControlRunner
from diffserve.pipelines.controlnet_steps import EncodedControl, InpaintingControl, global_rng_stand_in
from diffserve.request import Conditioning, Req
from diffserve.runtime.runner import CfgBranchView
from diffserve.stages.base import to_module


@dataclass
class SD3Conditioning(Conditioning):
    """SD3's per-request conditioning: its ControlNet entries (set by `SD3ControlImageEncodingStage`)."""

    controls: list[EncodedControl] = field(default_factory=list)


class SD3ControlImageEncodingStage(ControlImageStage):
    """Step 1 above: every control image's latents, one row per output and branch in the DiT batch's row
    order (prompt rows, then the negative prompt's), into the conditioning's `controls`."""

    def encode_controls(self, req: Req) -> None:
        p = req.params
        generator = global_rng_stand_in(next(self.vae.parameters()).device, p.seed)
        branches = 2 if req.do_cfg else 1
        scaling = float(self.vae.config["scaling_factor"])
        inputs = []
        for entry in p.controlnets:
            net = self.nets[entry.name]
            if net.config.inpainting:
                latents = self._inpainting_latents(entry, req, generator).repeat(branches, 1, 1, 1)
            else:
                shift = 0.0 if net.config.force_zeros_for_pooled_projection else self._shift()
                pixels = self.control_pixels(entry, req, req.batch_size * branches)
                latents = self.vae.encode(to_module(self.vae, pixels)).sample(generator)
                latents = (latents - shift) * scaling
                # Diffusers' rows are [negative; prompt]; the DiT batch's [prompt; negative].
                if branches == 2:
                    n = req.batch_size
                    latents = torch.cat([latents[n:], latents[:n]])
            latents = latents.to(device=self.device, dtype=self.dtype)
            inputs.append(
                EncodedControl(entry.name, latents, entry.scale, entry.start, entry.end, entry.mode)
            )
        SD3Conditioning.of(req).controls = inputs

    def _shift(self) -> float:
        return float(self.vae.config.get("shift_factor") or 0.0)

    def _inpainting_latents(
        self, entry: ControlNetChoice, req: Req, generator: torch.Generator
    ) -> torch.Tensor:
        """Step 1 for an inpainting ControlNet (`StableDiffusion3ControlNetInpaintingPipeline`): the masked
        image, one row per output, VAE-encoded with a sampled posterior, `(z - shift) * scale` (the shift
        always), and `1 - mask` on the latent grid appended as a channel; both CFG branches take the same
        rows (one draw, not one per branch)."""
        p = req.params
        control = InpaintingControl.of(entry, p.height, p.width)
        pixels = control.masked.repeat(req.batch_size, 1, 1, 1)
        latents = self.vae.encode(to_module(self.vae, pixels)).sample(generator)
        latents = (latents - self._shift()) * float(self.vae.config["scaling_factor"])
        return self.with_kept_channel(latents, control)


class SD3ControlNetRunner(EncodedControlRunner[SD3ControlNetModel]):
    """Runs the ControlNets of one step batch and hands the DiT each request's residuals."""

    conditioning_type = SD3Conditioning
    per_branch = True
    truncating = True

    def run_net(
        self, net: SD3ControlNetModel, reqs: list[Req], items: list[tuple[int, int, EncodedControl]]
    ) -> list[torch.Tensor]:
        """One forward of `net` over every branch row of `items`: its per-block samples."""
        latents, control, texts, pooled, timesteps, scales = [], [], [], [], [], []
        # The inpainting pipeline hands every ControlNet zeros (its `controlnet_pooled_projections`).
        zero_pooled = net.config.force_zeros_for_pooled_projection or net.config.inpainting
        for r, _, entry in items:
            req = reqs[r]
            cond = entry.latents
            if isinstance(req, CfgBranchView):
                # CFG-parallel: the view's text is its branch's; its control rows are that branch's of
                # the request's [prompt rows; negative rows].
                n = req.batch_size
                cond = cond[req.branch * n : (req.branch + 1) * n]
            branches = [(req.prompt_embeds, req.pooled_prompt_embeds)]
            if req.do_cfg:
                branches.append((req.negative_prompt_embeds, req.negative_pooled_prompt_embeds))
            t = req.schedule.timesteps[req.step_index]
            for text, pool in branches:
                latents.append(req.latents)
                texts.append(text)
                pooled.append(torch.zeros_like(pool) if zero_pooled else pool)
                timesteps.append(t.expand(req.batch_size))
            control.append(cond)
            rows = req.batch_size * len(branches)
            scales.append(
                torch.full((rows,), float(entry.scale), dtype=torch.float32, device=req.latents.device)
            )
        return net(
            hidden_states=torch.cat(latents),
            controlnet_cond=torch.cat(control),
            encoder_hidden_states=torch.cat(texts),
            pooled_projections=torch.cat(pooled),
            timestep=torch.cat(timesteps).to(latents[0].dtype),
            scales=torch.cat(scales),
        )
