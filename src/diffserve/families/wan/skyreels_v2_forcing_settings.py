"""SkyReels-V2 diffusion forcing's request settings (Diffusers' `__call__` arguments beyond `SamplingParams`,
carried in `SamplingParams.extra`) and the windows they give a request."""

from __future__ import annotations

from dataclasses import dataclass

from diffserve.configs.option import option, settings_from
from diffserve.configs.sampling_params import SamplingParams
from diffserve.families.wan.skyreels_v2_forcing_plan import WindowShape, window_shapes


@dataclass(frozen=True)
class SkyReelsV2DiffusionForcingSettings:
    """One diffusion-forcing request's settings, with Diffusers' defaults: the synchronous (`ar_step` 0) or
    asynchronous mode, the causal block, and long videos' windows (`num_frames` > `base_num_frames` with
    `overlap_history`)."""

    ar_step: int = option(
        0,
        help="asynchronous diffusion forcing: the steps each causal block lags behind the one before (0: "
        "synchronous)",
        min=0,
    )
    causal_block_size: int | None = option(
        None, help="latent frames per causal block (None: the DiT's num_frame_per_block)", min=1
    )
    base_num_frames: int = option(97, help="the frames of one window (97 for 540P, 121 for 720P)", min=1)
    overlap_history: int | None = option(
        None,
        help="long videos (num_frames > base_num_frames): the frames each window starts back in the video "
        "(17 or 37 recommended)",
        min=1,
    )
    addnoise_condition: float = option(
        0.0,
        help="long videos: noise level (x 0.001) given to the frames a window continues from (20 recommended)",
        min=0.0,
    )


def skyreels_v2_df_settings(params: SamplingParams) -> SkyReelsV2DiffusionForcingSettings:
    """The request's settings from `params.extra` (an unknown key or a bad value: InvalidRequestError)."""
    return settings_from(SkyReelsV2DiffusionForcingSettings, params.extra, "extra")


def is_long_video(params: SamplingParams, settings: SkyReelsV2DiffusionForcingSettings) -> bool:
    """Diffusers' test: `overlap_history` set and more frames than one window."""
    return settings.overlap_history is not None and int(params.num_frames) > settings.base_num_frames


def causal_block(settings: SkyReelsV2DiffusionForcingSettings, dit_frames_per_block: int) -> int:
    """The request's frames per causal block: its `causal_block_size`, else the DiT's."""
    return dit_frames_per_block if settings.causal_block_size is None else settings.causal_block_size


def request_windows(
    params: SamplingParams,
    settings: SkyReelsV2DiffusionForcingSettings,
    temporal: int,
    block: int,
    first_prefix: int = 0,
) -> tuple[WindowShape, ...]:
    """The request's windows in latent frames (`temporal`: the VAE's frames per latent frame; `first_prefix`:
    the latent frames an input image gives the first window)."""

    def latent(frames: int) -> int:
        return (frames - 1) // temporal + 1

    total = latent(int(params.num_frames))
    if not is_long_video(params, settings):
        return window_shapes(total, block, first_prefix=first_prefix)
    assert settings.overlap_history is not None
    return window_shapes(
        total, block, latent(settings.base_num_frames), latent(settings.overlap_history), first_prefix
    )
