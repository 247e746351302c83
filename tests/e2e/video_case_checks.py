"""What the HunyuanVideo and Mochi pipeline parity files check alike, at each file's bars (`VideoBars`):
one text-to-video request on both sides (final latents in dB, decoded frames as uint8 PSNR, another prompt
as the control), and two outputs per prompt against Diffusers' `num_videos_per_prompt=2`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from diffusers import DiffusionPipeline

from diffserve import SamplingParams
from diffserve.api import DiffGenerator
from diffserve.testing.parity import Closeness, assert_images_match, assert_parity
from diffserve.testing.video_parity import diffusers_latents_and_frames, final_latents_and_frames


@dataclass(frozen=True)
class VideoBars:
    """A parity file's bars: the final latents' SNR and the decoded frames' uint8 PSNR, in dB."""

    latent_min_db: float
    psnr_bar_db: float

    def assert_video_matches(
        self,
        ours: DiffGenerator,
        reference: DiffusionPipeline,
        label: str,
        prompt: str,
        other_prompt: str,
        seed: int,
        **common: Any,
    ) -> tuple[Closeness, float]:
        """`prompt` at `seed` with the keywords `common` on both sides: the latents and the frames must meet
        the bars, and the same request on `other_prompt` must miss the frames' bar. Returns the latents'
        closeness and the frames' PSNR."""
        params = SamplingParams(prompt=prompt, seed=seed, **common)
        got_latents, got = final_latents_and_frames(ours, params)
        want_latents, want = diffusers_latents_and_frames(reference, seed, prompt=prompt, **common)
        db = assert_parity(got_latents, want_latents, f"{label} latents", min_db=self.latent_min_db)
        control_params = SamplingParams(**{**params.__dict__, "prompt": other_prompt})
        control = np.stack(ours.generate_from_params(control_params).frames)
        pixels = assert_images_match(got, want, label, min_db=self.psnr_bar_db, control=control)
        return db, pixels

    def assert_two_outputs_match(
        self,
        ours: DiffGenerator,
        reference: DiffusionPipeline,
        family: str,
        prompt: str,
        negative_prompt: str,
        seed: int,
        **common: Any,
    ) -> None:
        """`num_outputs_per_prompt=2` (`prompt` and `negative_prompt` at `seed`, the keywords `common`)
        against Diffusers' `num_videos_per_prompt=2`: two videos whose latents and frames meet the bars."""
        params = SamplingParams(
            prompt=prompt, negative_prompt=negative_prompt, num_outputs_per_prompt=2, seed=seed, **common
        )
        got_latents, got = final_latents_and_frames(ours, params)
        want_latents, want = diffusers_latents_and_frames(
            reference, seed, prompt=prompt, negative_prompt=negative_prompt, num_videos_per_prompt=2, **common
        )
        assert got.shape[0] == 2
        assert_parity(got_latents, want_latents, f"{family} 2 per prompt latents", min_db=self.latent_min_db)
        assert_images_match(got, want, f"{family} 2 per prompt", min_db=self.psnr_bar_db)
