"""SkyReels-V2 (Skywork; Diffusers `SkyReelsV2Pipeline`, `SkyReelsV2ImageToVideoPipeline`,
`SkyReelsV2DiffusionForcingPipeline`, `SkyReelsV2DiffusionForcingImageToVideoPipeline`): Wan 2.1's pipelines
over SkyReels-V2's DiT (`models/dits/skyreels_v2.py`), the Wan VAE and UniPC.

Diffusers' text-to-video and image-to-video pipelines are Wan 2.1's (first frame, CLIP image states) step for
step, with their own defaults: 544x960, 97 frames, 50 steps, CFG 6.0 (text-to-video) or 5.0
(image-to-video), 24 fps output. The image-to-video default size is 544x960 whatever the image's aspect
ratio (Diffusers' default), not Wan's area-preserving size. Neither passes `fps` to the DiT.

Diffusion forcing is served in every mode of Diffusers' text-to-video, image-to-video and video-to-video
pipelines (the video extension in `skyreels_v2_v2v.py`; not image-to-video's `last_image`): synchronous (`ar_step` 0) or asynchronous (`ar_step`
> 0, causal blocks of `causal_block_size` frames lagging one another), over one window or, for a long video (`num_frames` > `base_num_frames` with `overlap_history`, `addnoise_condition`), several.
Each row of Diffusers' step matrix is one engine step (`skyreels_v2_forcing_plan.py`): the DiT sees the
window with each frame at its row's timestep, and the frames the row updates are stepped with their own
scheduler state (`skyreels_v2_forcing_step.py`); a window's end starts the next one inside the denoiser. An
input image's latents start the first window as a long video's prefix starts the next ones. A streamed job's
finished windows are decoded and published while its next windows denoise (`skyreels_v2_forcing_decode.py`),
a video extension's after its input frames, which it publishes first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from diffserve.configs.quality import TierPreset
from diffserve.configs.sampling_params import SamplingParams
from diffserve.errors import InvalidRequestError
from diffserve.families.wan.config import WanPipelineConfig
from diffserve.families.wan.pipeline import WanImageToVideoPipeline, WanPipeline
from diffserve.families.wan.skyreels_v2_forcing_decode import (
    ForcingWindowDecoder,
    SkyReelsV2ForcingDecodingStage,
)
from diffserve.families.wan.skyreels_v2_forcing_denoiser import SkyReelsV2DiffusionForcingDenoiser
from diffserve.families.wan.skyreels_v2_forcing_settings import (
    causal_block,
    request_windows,
    skyreels_v2_df_settings,
)
from diffserve.families.wan.skyreels_v2_forcing_stages import (
    SkyReelsV2ForcingLatentStage,
    SkyReelsV2ForcingTimestepStage,
)
from diffserve.families.wan.skyreels_v2_forcing_state import SkyReelsV2ForcingConditioning
from diffserve.families.wan.ti2v_preparation import WanFirstFrameLatentStage
from diffserve.pipelines.base import PipelineContext
from diffserve.stages.base import Stage
from diffserve.stages.input_validation import ImageInputRule, InputValidationStage
from diffserve.stages.latent_preparation import VideoLatentPreparationStage
from diffserve.stages.timestep_preparation import DefaultTimestepPreparationStage
from diffserve.stages.video_vae_decoding import VideoVaeDecodingStage


@dataclass(frozen=True)
class SkyReelsV2PipelineConfig(WanPipelineConfig):
    #: Diffusers' SkyReels-V2 pipelines default to 544x960 (height x width).
    default_height: int = 544
    default_width: int = 960


def skyreels_v2_default_sampling_params(guidance_scale: float = 6.0) -> SamplingParams:
    """Defaults of Diffusers' SkyReelsV2Pipeline.__call__ (image-to-video: guidance 5.0); 24 fps is
    SkyReels-V2's frame rate."""
    return SamplingParams(
        num_inference_steps=50,
        guidance_scale=guidance_scale,
        max_sequence_length=512,
        num_frames=97,
        fps=24,
        video_format="mp4",
    )


class SkyReelsV2Pipeline(WanPipeline):
    """Text-to-video."""

    config = SkyReelsV2PipelineConfig()
    pipeline_name = "SkyReelsV2Pipeline"
    #: Diffusers' SkyReels-V2 pipelines size the latents by the VAE's network, not its scale_factor_* keys.
    latent_size_from_vae_config = False

    @staticmethod
    def default_sampling_params() -> SamplingParams:
        return skyreels_v2_default_sampling_params()


class SkyReelsV2ImageToVideoPipeline(WanImageToVideoPipeline):
    """Animates one input image; a last frame (Diffusers' `last_image`) only where the DiT takes one, as for
    Wan (`last_image.py`: an FLF2V-style DiT with `pos_embed_seq_len`; the released ones take none)."""

    config = SkyReelsV2PipelineConfig()
    pipeline_name = "SkyReelsV2ImageToVideoPipeline"
    latent_size_from_vae_config = False

    @staticmethod
    def default_sampling_params() -> SamplingParams:
        return skyreels_v2_default_sampling_params(guidance_scale=5.0)

    def default_size(self, params: SamplingParams) -> tuple[int, int]:
        return self.config.default_height, self.config.default_width


class SkyReelsV2DiffusionForcingValidationStage(InputValidationStage):
    """The shared validation plus the diffusion-forcing settings (`SkyReelsV2DiffusionForcingSettings`): a
    long video needs `overlap_history` shorter than a window, and every window's latent frames must be whole
    causal blocks (Diffusers' schedule leaves a partial block's frames pure noise, and its DiT fails on one)."""

    takes_family_settings = True
    #: The DiT's frames per causal block and the VAE's temporal factor, set by the pipeline.
    frames_per_block: int = 1
    temporal: int = 4

    def probe_given_latent_frames(self) -> int:
        """Latent frames a probe request's window starts with already given: the input image's one
        (image-to-video), none from text."""
        return 1 if self.image_inputs.min_images > 0 else 0

    def probe_frames(self) -> int:
        """The fewest frames whose window (whole causal blocks of the DiT's `num_frame_per_block`) holds a
        block after the given latent frames cut to whole blocks (`probe_given_latent_frames`): with one
        frame, an image-to-video probe's window is the input image alone and denoises nothing."""
        block = self.frames_per_block
        latent_frames = (self.probe_given_latent_frames() // block + 1) * block
        return self.temporal * (latent_frames - 1) + 1

    def resolve(self, params: SamplingParams) -> SamplingParams:
        resolved = super().resolve(params)
        settings = skyreels_v2_df_settings(resolved)
        frames = int(resolved.num_frames)
        if frames > settings.base_num_frames and settings.overlap_history is None:
            raise InvalidRequestError(
                f"num_frames {frames} exceeds base_num_frames {settings.base_num_frames}: a long video needs "
                "overlap_history (17 or 37 recommended)",
                param="extra",
            )
        block = causal_block(settings, self.frames_per_block)
        try:
            windows = request_windows(resolved, settings, self.temporal, block)
        except ValueError as error:
            raise InvalidRequestError(
                f"overlap_history {settings.overlap_history} with base_num_frames {settings.base_num_frames}: "
                f"{error}",
                param="extra",
            ) from error
        for index, window in enumerate(windows):
            if window.frames % block:
                where = f"num_frames {frames} gives" if len(windows) == 1 else f"window {index} has"
                raise InvalidRequestError(
                    f"{where} {window.frames} latent frames, not a multiple of the causal block ({block} "
                    "frames: causal_block_size, else the DiT's num_frame_per_block)",
                    param="num_frames",
                )
        return resolved


class SkyReelsV2DiffusionForcingPipeline(SkyReelsV2Pipeline):
    """Text-to-video with the diffusion-forcing DiT (Diffusers' `SkyReelsV2DiffusionForcingPipeline`): every
    mode, each latent frame's tokens at its frame's timestep, fps injected. No quality tiers (block-causal
    attention runs every block)."""

    pipeline_name = "SkyReelsV2DiffusionForcingPipeline"
    conditioning_type = SkyReelsV2ForcingConditioning
    denoiser_cls = SkyReelsV2DiffusionForcingDenoiser
    input_validation_cls = SkyReelsV2DiffusionForcingValidationStage
    step_cache_policies: ClassVar[dict[str, TierPreset]] = {}

    def __init__(self, context: PipelineContext) -> None:
        super().__init__(context)
        self._stream_windows()

    def _stream_windows(self) -> None:
        """Streamed jobs' finished windows decoded while they denoise (`skyreels_v2_forcing_decode.py`),
        where the decode is Wan's plain one (exactly `VideoVaeDecodingStage`; the output's leading frames,
        video-to-video's input video, are the forcing decode's too: `with_leading`); done once every
        subclass has built its stages, so a subclass that decodes otherwise keeps its own decode and
        streams at the final decode."""
        index = self._denoising_index + 1
        stage = self.stages[index]
        if type(stage) is VideoVaeDecodingStage:
            self.stages[index] = SkyReelsV2ForcingDecodingStage(stage.vae)
            self.denoiser.window_decoder = ForcingWindowDecoder(stage.vae)

    def build_stages(self, context: PipelineContext) -> list[Stage]:
        stages = super().build_stages(context)
        frames_per_block = int(context.get("transformer").config.num_frame_per_block)
        validation = self.input_validation
        assert isinstance(validation, SkyReelsV2DiffusionForcingValidationStage)
        validation.frames_per_block = frames_per_block
        validation.temporal = self.temporal
        return [self._forcing_stage(stage, context, frames_per_block) for stage in stages]

    def _forcing_stage(self, stage: Stage, context: PipelineContext, frames_per_block: int) -> Stage:
        """Wan's latent and timestep stages replaced by their diffusion-forcing versions; others kept."""
        if isinstance(stage, VideoLatentPreparationStage):
            latents = SkyReelsV2ForcingLatentStage(
                stage.channels, stage.spatial, stage.temporal, stage.device, stage.dtype
            )
            latents.dit_frames_per_block = frames_per_block
            latents.dit_dtype = self.denoiser.dtype
            return latents
        if isinstance(stage, DefaultTimestepPreparationStage):
            timesteps = SkyReelsV2ForcingTimestepStage(context.get("scheduler"), stage.patch_size)
            timesteps.dit_frames_per_block = frames_per_block
            timesteps.temporal = self.temporal
            return timesteps
        return stage


class SkyReelsV2DiffusionForcingImageToVideoPipeline(SkyReelsV2DiffusionForcingPipeline):
    """Diffusion forcing from one input image (Diffusers' `SkyReelsV2DiffusionForcingImageToVideoPipeline`): the
    image's latents, resized to the output size, are the first window's first latent frame, given like a long
    video's prefix (Diffusers' optional `last_image` is not served)."""

    pipeline_name = "SkyReelsV2DiffusionForcingImageToVideoPipeline"

    @staticmethod
    def default_sampling_params() -> SamplingParams:
        return skyreels_v2_default_sampling_params(guidance_scale=5.0)

    def image_input_rule(self) -> ImageInputRule:
        return ImageInputRule(pipeline_name=self.pipeline_name, min_images=1, max_images=1)

    def default_size(self, params: SamplingParams) -> tuple[int, int]:
        return self.config.default_height, self.config.default_width

    def before_denoising_stages(self, context: PipelineContext) -> list[Stage]:
        return [WanFirstFrameLatentStage(context.get("vae"))]
