"""Wan image-to-video's last frame (Diffusers' `last_image`, sent as a second input image): which folders
take one, and the request checks.

Diffusers' `WanImageToVideoPipeline` (and SkyReels-V2's) conditions on a last frame as well as the first
when given `last_image`: the conditioning video is [first, black frames, last], its mask marks both ends,
and a DiT with image cross-attention gets the CLIP states of both images. Whether that runs depends on the
DiT:

- FLF2V (`image_dim` and `pos_embed_seq_len`: Wan2.1-FLF2V-14B): its image embedder adds learned positions
  over both images' CLIP states, so it needs the last frame (Diffusers fails without one);
- `image_dim` alone (Wan 2.1 I2V): its image embedder takes one image's states (Diffusers fails with two);
- no `image_dim` (Wan 2.2 A14B I2V): the last frame only enters the conditioning video; optional;
- `expand_timesteps` (Wan 2.2 TI2V): Diffusers ignores it (the first frame alone conditions), so it is refused.
"""

from __future__ import annotations

from typing import Literal

from diffserve.configs.sampling_params import SamplingParams
from diffserve.errors import InvalidRequestError
from diffserve.models.dits.wan import WanTransformerConfig
from diffserve.stages.input_validation import ImageInputRule, InputValidationStage

#: How a folder takes a last frame: never, optionally, or always (FLF2V).
LastImageUse = Literal["refused", "optional", "required"]


def last_image_use(dit: WanTransformerConfig, expand_timesteps: bool) -> LastImageUse:
    """How an image-to-video folder with DiT config `dit` takes a last frame (module docstring)."""
    if expand_timesteps:
        return "refused"
    if dit.image_dim is None:
        return "optional"
    return "required" if dit.pos_embed_seq_len is not None else "refused"


def image_input_rule(pipeline_name: str, use: LastImageUse) -> ImageInputRule:
    """The input images of an image-to-video folder: the first frame, and the last one where `use` allows."""
    if use == "required":
        return ImageInputRule(pipeline_name=pipeline_name, min_images=2, max_images=2)
    return ImageInputRule(pipeline_name=pipeline_name, min_images=1, max_images=2 if use == "optional" else 1)


class WanImageToVideoValidationStage(InputValidationStage):
    """The shared validation, with FLF2V's two images named in its refusal and a clip long enough for two
    given frames (Diffusers fills `num_frames - 2` black frames between them and fails below two frames)."""

    #: Set by the pipeline from its DiT (`last_image_use`).
    last_image: LastImageUse = "refused"

    def probe_frames(self) -> int:
        """With a last frame required, the fewest frames holding both given ones: temporal factor + 1."""
        if self.last_image == "required" and self.video is not None:
            return self.video.temporal_factor + 1
        return super().probe_frames()

    def resolve(self, params: SamplingParams) -> SamplingParams:
        if self.last_image == "required" and len(params.input_images or []) == 1:
            raise InvalidRequestError(
                f"{self.image_inputs.pipeline_name}: this first-last-frame model (its DiT sets "
                "pos_embed_seq_len) needs two input images, the first frame and the last one",
                param="image",
            )
        resolved = super().resolve(params)
        frames = resolved.num_frames
        if len(resolved.input_images or []) == 2 and isinstance(frames, int) and frames < 2:
            raise InvalidRequestError(
                f"num_frames must be at least 2 with a last frame (the first and last frames are given), got "
                f"{frames}",
                param="num_frames",
            )
        return resolved
