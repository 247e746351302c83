"""The diffusion-forcing denoiser: one DiT call a step for a batch of SkyReels-V2 diffusion-forcing requests,
each at its own row of its own plan (synchronous or asynchronous, any window of a long video)."""

from __future__ import annotations

from typing import Any

import torch

from diffserve.families.wan.pipeline import WanDenoiser
from diffserve.families.wan.skyreels_v2_forcing_decode import ForcingWindowDecoder
from diffserve.families.wan.skyreels_v2_forcing_state import SkyReelsV2ForcingConditioning
from diffserve.families.wan.skyreels_v2_forcing_step import advance_forcing, forcing_inputs
from diffserve.models.dits.wan import EmbeddedContext
from diffserve.pipelines.cfg_batch import step_cache_for
from diffserve.request import Req


class SkyReelsV2DiffusionForcingDenoiser(WanDenoiser):
    """Every latent frame of a request's window at its own timestep (Diffusers' diffusion-forcing DiT call),
    with the fps index (0 for 16 fps, 1 otherwise) and the requests' causal block; each request then steps the
    frames its row updates (`advance_forcing`). With a `window_decoder` (set by the pipeline), a streamed
    request's finished windows are then decoded a frame per step and published while it goes on."""

    #: Decodes streamed requests' finished windows between their steps; None: none are (the final decode
    #: decodes every frame, as Diffusers does).
    window_decoder: ForcingWindowDecoder | None = None

    def _step(self, expert: int, reqs: list[Req]) -> None:
        latents, timesteps = [], []
        for req in reqs:  # rows in `cfg_batch` order: the branches of a request share its inputs
            model_input, t = forcing_inputs(req, self.dtype)
            for _branch in range(2 if req.do_cfg else 1):
                latents.append(model_input)
                timesteps.append(t)
        contexts = [self.context_for(req, expert) for req in reqs]
        prediction = self.transformers[expert](
            hidden_states=torch.cat(latents).to(self.dtype),
            timestep=torch.cat(timesteps),
            encoder_hidden_states=None,
            context=EmbeddedContext(torch.cat([c.states for c in contexts]), contexts[0].image_len),
            step_cache=step_cache_for(reqs),
            **self.extra_dit_inputs(reqs),
        )
        for req, guided in zip(reqs, self._guided(prediction.float(), reqs, expert), strict=True):
            advance_forcing(self.scheduler, req, guided, self.dtype)
        if self.window_decoder is not None:  # once every request of the batch has advanced
            for req in reqs:
                self.window_decoder.after_step(req)

    def extra_dit_inputs(self, reqs: list[Req]) -> dict[str, Any]:
        rows = []
        for req in reqs:
            index = 0 if req.params.fps == 16 else 1
            rows += [index] * (req.batch_size * (2 if req.do_cfg else 1))
        blocks = {SkyReelsV2ForcingConditioning.of(req).causal_block_size for req in reqs}
        if len(blocks) != 1:
            raise ValueError(
                f"requests with different causal blocks ({sorted(map(str, blocks))}) share a step"
            )
        return {
            "fps": torch.tensor(rows, dtype=torch.long, device=reqs[0].latents.device),
            "num_frame_per_block": blocks.pop(),
        }
