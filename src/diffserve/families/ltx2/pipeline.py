"""LTX-2 (Diffusers `LTX2Pipeline`, `LTX2ImageToVideoPipeline`): a video and its soundtrack from one joint
audio-video DiT, with Diffusers' guidance, and the batched denoising step.

Per step and request the DiT predicts both modalities' velocities for up to four rows: the prompt, the
negative prompt (CFG, when `guidance_scale` or the audio's scale is above 1), the prompt with STG's
perturbed self-attention (when an STG scale is set and the DiT has perturbable attention in one of the
listed blocks) and the prompt with the audio<->video attention off (modality guidance, scale above 1).
Guidance runs on x0 = x - sigma * v per modality, as Diffusers:

    x0 = x0_pos + (cfg - 1)(x0_pos - x0_neg) + stg (x0_pos - x0_stg) + (mod - 1)(x0_pos - x0_iso)

rescaled towards x0_pos's std by `guidance_rescale`, turned back into a velocity and taken as one Euler
step for the video tokens and one for the audio tokens (image-to-video keeps its first latent frame).
The first three kinds of row of every request in the batch share one DiT forward (STG rows through a
per-row perturbation mask); the modality rows need their own forward (the cross-modal switch is per
forward). Requests share a batch only with the same latent grid, audio length, text length, frame rate
and STG blocks (`batch_key`).

The settings beyond SamplingParams (audio scales, STG, modality guidance, rescale, decode noise, ...) are
read from `SamplingParams.extra` (`families/ltx2/config.py`). STG on a DiT whose attention cannot be perturbed
(`perturbed_attn` false, LTX-2.0) or at blocks it does not have changes nothing in Diffusers but costs a
forward; here those rows are not run and the term is 0.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from diffserve.configs.cache_settings import TeaCacheSettings
from diffserve.configs.quality import TierPreset
from diffserve.configs.sampling_params import SamplingParams
from diffserve.errors import InvalidRequestError
from diffserve.families.ltx2.conditioning import LTX2Conditioning
from diffserve.families.ltx2.config import (
    DEFAULT_IMAGE_CRF,
    GEMMA4_IMAGE_CRF,
    LTX2Guidance,
    LTX2PipelineConfig,
    ltx2_default_sampling_params,
    ltx2_guidance,
)
from diffserve.families.ltx2.decoding import LTX2DecodingStage
from diffserve.families.ltx2.folder_checks import check_ltx2_folder
from diffserve.families.ltx2.latent_preparation import (
    FirstFrameCondition,
    LTX2LatentPreparationStage,
    audio_latent_steps,
)
from diffserve.families.ltx2.text_encoding import LTX2TextEncodingStage, register_multiple
from diffserve.loader.folder_defaults import apply_overrides
from diffserve.models.dits.ltx2 import LTX2VideoTransformer3DModel
from diffserve.models.schedulers.flow_match_euler import FlowMatchEulerScheduler
from diffserve.models.step_cache import BatchStepCache, batch_step_cache
from diffserve.pipelines.base import Pipeline, PipelineContext
from diffserve.pipelines.cfg_batch import request_cache_rows
from diffserve.request import Req
from diffserve.runtime.runner import CfgBranchView
from diffserve.stages.base import Stage
from diffserve.stages.denoising import DenoisingStage
from diffserve.stages.input_validation import ImageInputRule, InputValidationStage, VideoRule
from diffserve.stages.timestep_preparation import TimestepPreparationStage

logger = logging.getLogger("diffserve.pipeline")


def rescale_toward(guided: torch.Tensor, reference: torch.Tensor, rescale: float) -> torch.Tensor:
    """Diffusers' `rescale_noise_cfg`: blend `guided` with itself scaled to `reference`'s per-sample std."""
    dims = list(range(1, reference.ndim))
    matched = guided * (reference.std(dim=dims, keepdim=True) / guided.std(dim=dims, keepdim=True))
    return rescale * matched + (1 - rescale) * guided


@dataclass(frozen=True)
class ModalityScales:
    """One modality's guidance scales for a request (0 turns a term off; CFG and modality run above 1)."""

    cfg: float
    stg: float
    modality: float
    rescale: float


@dataclass(frozen=True)
class RequestGuidance:
    """What a request's step runs: which rows, and each modality's scales."""

    video: ModalityScales
    audio: ModalityScales
    stg_rows: bool
    modality_rows: bool
    settings: LTX2Guidance


class LTX2InputValidationStage(InputValidationStage):
    """The shared validation, plus LTX-2's: its `extra` settings, the text length the connectors' registers
    need, a clip long enough for one audio latent, an image-to-video input image H.264 can re-compress, and
    CFG on when either modality's scale is above 1 (Diffusers' rule)."""

    takes_family_settings = True

    def __init__(
        self,
        *args,
        image_to_video: bool,
        registers: int | None,
        min_side: int,
        audio_latents_per_second: float,
        default_image_crf: int | None = None,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.image_to_video = image_to_video
        self.registers = registers
        #: The smallest height and width the VAE decodes: its decoder's reflect padding needs latents at
        #: least two wide (one latent row cannot be reflected).
        self.min_side = min_side
        #: The soundtrack's latent steps a second: a clip must be long enough for one of them.
        self.audio_latents_per_second = audio_latents_per_second
        #: Image-to-video: the CRF the input image is re-compressed at when the request sets none.
        self.default_image_crf = default_image_crf

    def resolve(self, params: SamplingParams) -> SamplingParams:
        resolved = super().resolve(params)
        settings = ltx2_guidance(resolved, self.image_to_video)  # raises on unknown keys or bad values
        for name in ("height", "width"):
            value = getattr(resolved, name)
            if value is not None and value < self.min_side:
                raise InvalidRequestError(
                    f"{name} must be at least {self.min_side} for this model (two latents: its VAE decoder "
                    f"pads by reflection), got {value}",
                    param=name,
                )
        self._check_audio_length(resolved)
        if self.image_to_video:
            self._check_recompressible(resolved, settings.image_crf)
        msl = resolved.max_sequence_length
        if self.registers and msl % self.registers:
            lower = max(self.registers, msl - msl % self.registers)
            raise InvalidRequestError(
                f"max_sequence_length must be a multiple of {self.registers} (the text connectors' learnable "
                f"registers), got {msl}; try {lower} or {lower + self.registers}",
                param="max_sequence_length",
            )
        return resolved

    def _check_audio_length(self, params: SamplingParams) -> None:
        """The clip must hold at least one audio latent step (round(num_frames / fps * steps a second)):
        Diffusers fails on an empty soundtrack deep inside its audio unpacking, and so would the audio VAE."""
        frames, fps = params.num_frames, params.fps
        if audio_latent_steps(frames, float(fps), self.audio_latents_per_second) >= 1:
            return
        max_fps = math.ceil(2 * frames * self.audio_latents_per_second) - 1
        raise InvalidRequestError(
            f"a clip of {frames} frame(s) at {fps} fps ({frames / fps:.3f} s) is too short for LTX-2's soundtrack "
            f"({self.audio_latents_per_second:g} audio latents a second, at least one needed): use more frames "
            f"or an fps of at most {max_fps}",
            param="fps",
        )

    def _check_recompressible(self, params: SamplingParams, crf: int | None) -> None:
        """H.264 re-compression (a CRF other than 0) crops the input image to even sides: a side of 1 pixel
        leaves nothing to encode (Diffusers fails inside PyAV). `crf`: the request's `image_crf` (None: the
        folder's default)."""
        crf = self.default_image_crf if crf is None else crf
        width, height = params.input_images[0].size
        if crf and min(width, height) < 2:
            raise InvalidRequestError(
                f"the input image is {width}x{height}: re-compressing it as an H.264 frame (image_crf {crf}) "
                "needs both sides at least 2 pixels; send a larger image, or set extra's image_crf to 0",
                param="image",
            )

    def forward(self, req: Req) -> Req:
        req = super().forward(req)
        p = req.params
        audio_scale = ltx2_guidance(p, self.image_to_video).resolved_audio(float(p.guidance_scale))[0]
        req.do_cfg = p.guidance_scale > 1 or audio_scale > 1
        req.cfg_scale = float(p.guidance_scale)
        if req.do_cfg and p.negative_prompt is None:
            p.negative_prompt = ""
        return req


class LTX2Denoiser:
    """One step over a list of LTX-2 requests of one `batch_key`, each at its own timestep."""

    def __init__(
        self,
        transformer: LTX2VideoTransformer3DModel,
        scheduler: FlowMatchEulerScheduler,
        image_to_video: bool,
    ) -> None:
        self.transformer = transformer
        self.scheduler = scheduler
        self.image_to_video = image_to_video
        self.dtype = next(transformer.parameters()).dtype
        config = transformer.config
        self.num_layers = int(config.num_layers)
        self.perturbable = bool(config.perturbed_attn)

    def stg_blocks(self, settings: LTX2Guidance) -> tuple[int, ...]:
        """The STG blocks that perturb anything on this DiT (none without perturbable attention)."""
        if not self.perturbable:
            return ()
        return tuple(b for b in settings.spatio_temporal_guidance_blocks if b < self.num_layers)

    def guidance(self, req: Req) -> RequestGuidance:
        p = req.params
        settings = ltx2_guidance(p, self.image_to_video)
        scale = float(p.guidance_scale)
        audio_cfg, audio_stg, audio_mod, audio_rescale = settings.resolved_audio(scale)
        video = ModalityScales(scale, settings.stg_scale, settings.modality_scale, settings.guidance_rescale)
        audio = ModalityScales(audio_cfg, audio_stg, audio_mod, audio_rescale)
        stg = (video.stg > 0 or audio.stg > 0) and bool(self.stg_blocks(settings))
        modality = video.modality > 1 or audio.modality > 1
        return RequestGuidance(video, audio, stg, modality, settings)

    def conditioning_fps(self, req: Req) -> float:
        return float(req.params.fps) / ltx2_guidance(req.params, self.image_to_video).motion_speed

    def video_timesteps(self, req: Req, t: torch.Tensor) -> torch.Tensor:
        """(batch,) for text-to-video; per token (batch, tokens) for image-to-video, 0 on the first frame."""
        n = req.batch_size
        if not self.image_to_video:
            return t.expand(n)
        first = req.latent_size.height * req.latent_size.width
        keep = torch.ones(req.latents.shape[1], device=t.device, dtype=t.dtype)
        keep[:first] = 0
        return (t * keep).expand(n, -1)

    @torch.inference_mode()
    def __call__(self, reqs: list[Req]) -> None:
        if any(isinstance(req, CfgBranchView) for req in reqs):
            raise RuntimeError("LTX-2 does not run CFG-parallel: its guidance needs every branch on one rank")
        plans = [self.guidance(req) for req in reqs]
        main_kinds = [
            ["pos"] + (["neg"] if req.do_cfg else []) + (["stg"] if plan.stg_rows else [])
            for req, plan in zip(reqs, plans, strict=True)
        ]
        # The main rows (positive, negative, STG) run with the requests' caches; the modality-isolation rows
        # run their own forward, exact: a request's cache counts one forward per step.
        main = self._forward(reqs, main_kinds, isolate=False, plans=plans, cached=True)
        iso_reqs = [(req, plan) for req, plan in zip(reqs, plans, strict=True) if plan.modality_rows]
        iso = {}
        if iso_reqs:
            outputs = self._forward(
                [r for r, _ in iso_reqs], [["iso"]] * len(iso_reqs), True, [p for _, p in iso_reqs]
            )
            iso = {id(r): out for (r, _), out in zip(iso_reqs, outputs, strict=True)}
        for req, plan, rows in zip(reqs, plans, main, strict=True):
            if id(req) in iso:
                rows.update(iso[id(req)])
            self._step(req, plan, rows)

    def _forward(
        self,
        reqs: list[Req],
        kinds: list[list[str]],
        isolate: bool,
        plans: list[RequestGuidance],
        cached: bool = False,
    ) -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """One DiT forward over the listed rows; per request {kind: (video velocity, audio velocity)} in float32.
        `cached`: with the requests' cache methods (each request's rows, all its kinds, decide together)."""
        video, audio, text, audio_text, masks, t_video, t_audio, perturb = ([] for _ in range(8))
        for req, req_kinds in zip(reqs, kinds, strict=True):
            t = req.schedule.timesteps[req.step_index]
            c = LTX2Conditioning.of(req)
            for kind in req_kinds:
                negative = kind == "neg"
                video.append(req.latents)
                audio.append(c.audio_latents)
                text.append(req.negative_prompt_embeds if negative else req.prompt_embeds)
                audio_text.append(c.negative_audio_prompt_embeds if negative else c.audio_prompt_embeds)
                masks.append(c.negative_prompt_embeds_mask if negative else c.prompt_embeds_mask)
                t_video.append(self.video_timesteps(req, t))
                t_audio.append(t.expand(req.batch_size))
                perturb.append(torch.full((req.batch_size,), 0.0 if kind == "stg" else 1.0, device=t.device))
        first = reqs[0]
        h, w = first.latent_size
        # Requests with STG rows share their blocks (`batch_key`), as they share the cross-timestep switch.
        with_stg = [plan for plan, req_kinds in zip(plans, kinds, strict=True) if "stg" in req_kinds]
        stg_rows = bool(with_stg)
        blocks = self.stg_blocks(with_stg[0].settings) if stg_rows else None
        timestep, audio_timestep = torch.cat(t_video), torch.cat(t_audio)
        video_out, audio_out = self.transformer(
            hidden_states=torch.cat(video).to(self.dtype),
            audio_hidden_states=torch.cat(audio).to(self.dtype),
            encoder_hidden_states=torch.cat(text),
            audio_encoder_hidden_states=torch.cat(audio_text),
            timestep=timestep,
            audio_timestep=audio_timestep if self.image_to_video else None,
            sigma=audio_timestep,
            encoder_attention_mask=torch.cat(masks),
            audio_encoder_attention_mask=torch.cat(masks),
            num_frames=first.latents.shape[1] // (h * w),
            height=h,
            width=w,
            fps=self.conditioning_fps(first),
            audio_num_frames=LTX2Conditioning.of(first).audio_latents.shape[1],
            isolate_modalities=isolate,
            spatio_temporal_guidance_blocks=blocks,
            perturbation_mask=torch.cat(perturb) if stg_rows else None,
            use_cross_timestep=plans[0].settings.use_cross_timestep,
            step_cache=self._step_cache(reqs, kinds) if cached else None,
        )
        video_out, audio_out = video_out.float(), audio_out.float()
        out, offset = [], 0
        for req, req_kinds in zip(reqs, kinds, strict=True):
            rows = {}
            for kind in req_kinds:
                n = req.batch_size
                rows[kind] = (video_out[offset : offset + n], audio_out[offset : offset + n])
                offset += n
            out.append(rows)
        return out

    @staticmethod
    def _step_cache(reqs: list[Req], kinds: list[list[str]]) -> BatchStepCache | None:
        """The forward's step cache: each request's rows (batch size x its kinds), in `_forward`'s order;
        None when no request has a cache."""
        return batch_step_cache(
            [
                rows
                for req, req_kinds in zip(reqs, kinds, strict=True)
                for rows in request_cache_rows(req, req.batch_size, len(req_kinds))
            ]
        )

    def _step(
        self, req: Req, plan: RequestGuidance, rows: dict[str, tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        if req.step_index == 0 and req.scheduler_state is None:
            req.scheduler_state = self.scheduler.new_state()
        sigma = req.schedule.sigmas[req.step_index]
        conditioning = LTX2Conditioning.of(req)
        velocities = []
        for index, (latents, scales) in enumerate(
            ((req.latents, plan.video), (conditioning.audio_latents, plan.audio))
        ):
            x0 = {kind: latents - pred[index] * sigma for kind, pred in rows.items()}
            positive = x0["pos"]
            guided = positive
            if "neg" in x0:
                guided = guided + (scales.cfg - 1) * (positive - x0["neg"])
            if "stg" in x0:
                guided = guided + scales.stg * (positive - x0["stg"])
            if "iso" in x0:
                guided = guided + (scales.modality - 1) * (positive - x0["iso"])
            if scales.rescale > 0:
                guided = rescale_toward(guided, positive, scales.rescale)
            velocities.append((latents - guided) / sigma)
        video_v, audio_v = velocities
        req.last_prediction = video_v
        video = self.scheduler.step_request(
            video_v, req.latents, req.schedule.sigmas, req.step_index, req.scheduler_state
        )
        if self.image_to_video:  # the first latent frame is the input image's, never stepped
            first = req.latent_size.height * req.latent_size.width
            video = torch.cat([req.latents[:, :first], video[:, first:]], dim=1)
        req.latents = video
        conditioning.audio_latents = self.scheduler.step_request(
            audio_v, conditioning.audio_latents, req.schedule.sigmas, req.step_index, req.scheduler_state
        )
        req.step_index += 1


class LTX2Pipeline(Pipeline):
    #: Its guidance branches (CFG, STG, modality) share one cache state per request.
    cache_separate_cfg_supported = False
    runs_branch_views = False
    required_components = (
        "text_encoder", "tokenizer", "connectors", "transformer", "vae", "audio_vae", "vocoder", "scheduler",
    )  # fmt: skip
    config = LTX2PipelineConfig()
    pipeline_name = "LTX2Pipeline"
    conditioning_type = LTX2Conditioning
    image_to_video = False
    #: Measured on the tiny random-weight T2V test model (`build_tiny_ltx2`, 2 blocks, 20 steps, 64x64, 9
    #: frames, the family's default guidance, the four built-in prompts of `diffserve calibrate-cache`, 1 dB
    #: margin, every preset also holding its bar at 4 and 8 steps): TeaCache at 0.2, 0.3 and 0.45, 16, 12
    #: and 10 DiT blocks of 40 at 38.1, 38.2 and 37.2 dB (8, 6 and 5 of 20 steps in full; at 8 steps 35.5,
    #: 32.4 and 25.3 dB). The best original step cache computed 20, 12 and 10 blocks (47.0, 32.5 and 31.7
    #: dB), DBCache F1B0 25-26. Real checkpoints move differently: calibrate them (`diffserve
    #: calibrate-cache`).
    step_cache_policies: ClassVar[dict[str, TierPreset]] = {
        "medium": TeaCacheSettings(rel_l1_thresh=0.2),
        "low": TeaCacheSettings(rel_l1_thresh=0.3),
        "draft": TeaCacheSettings(rel_l1_thresh=0.45),
    }

    def build_stages(self, context: PipelineContext) -> list[Stage]:
        transformer = context.get("transformer")
        vae = context.get("vae")
        audio_vae = context.get("audio_vae")
        connectors = context.get("connectors")
        scheduler = context.get("scheduler")
        check_ltx2_folder(transformer, vae, audio_vae, scheduler.config)
        self.denoiser = LTX2Denoiser(transformer, scheduler, self.image_to_video)
        self.spatial = int(vae.spatial_compression_ratio)
        self.temporal = int(vae.temporal_compression_ratio)
        self.pixel_multiple = max(self.config.pixel_multiple, self.spatial)
        self._warn_idle_stg()
        registers = register_multiple(connectors.config)
        self.input_validation = LTX2InputValidationStage(
            defaults=apply_overrides(ltx2_default_sampling_params(), context.folder_sampling_defaults),
            pixel_multiple=self.pixel_multiple,
            default_pixels=self.config.default_height,
            max_sequence_length_limit=self.config.max_sequence_length_limit,
            cfg_mode="classic",
            image_inputs=self.image_input_rule(),
            default_size=lambda _params: (self.config.default_height, self.config.default_width),
            unsupported_params={
                "true_cfg_scale": "LTX-2 runs classic CFG, set by guidance_scale (and extra's audio_guidance_scale)"
            },
            video=VideoRule(temporal_factor=self.temporal),
            image_to_video=self.image_to_video,
            registers=registers,
            min_side=(2 if vae.config["decoder_spatial_padding_mode"] == "reflect" else 1) * self.spatial,
            audio_latents_per_second=float(audio_vae.latents_per_second),
            default_image_crf=self.default_image_crf(context) if self.image_to_video else None,
        )
        first_frame = None
        if self.image_to_video:
            first_frame = FirstFrameCondition(vae, self.default_image_crf(context))
        return [
            self.input_validation,
            LTX2TextEncodingStage(
                context.get("tokenizer"),
                context.get("text_encoder"),
                connectors,
                self.config.padding_side,
                self.config.text_scale_factor,
            ),
            LTX2LatentPreparationStage(
                channels=int(transformer.config.in_channels),
                audio_channels=int(audio_vae.config["latent_channels"]),
                audio_mel_bins=int(audio_vae.latent_mel_bins),
                spatial=self.spatial,
                temporal=self.temporal,
                audio_latents_per_second=float(audio_vae.latents_per_second),
                device=context.platform.device(),
                first_frame=first_frame,
            ),
            TimestepPreparationStage(scheduler, guidance_embeds=False),
            DenoisingStage(self.denoiser),
            LTX2DecodingStage(vae, audio_vae, context.get("vocoder"), context.dtype, self.image_to_video),
        ]

    def _warn_idle_stg(self) -> None:
        blocks = LTX2Guidance().spatio_temporal_guidance_blocks
        if not self.denoiser.stg_blocks(LTX2Guidance()):
            logger.info(
                "STG is a no-op on this DiT (perturbed_attn=%s, %d blocks, default STG blocks %s): its rows are skipped",
                self.denoiser.perturbable, self.denoiser.num_layers, list(blocks),
            )  # fmt: skip

    @staticmethod
    def default_image_crf(context: PipelineContext) -> int:
        """Diffusers' `resolve_default_image_crf`: CRF 18 for a Gemma-4 text encoder (LTX-2.5), else 33."""
        model_type = getattr(getattr(context.get("text_encoder"), "config", None), "model_type", None)
        return GEMMA4_IMAGE_CRF if model_type in ("gemma4_unified", "gemma4") else DEFAULT_IMAGE_CRF

    def image_input_rule(self) -> ImageInputRule:
        return ImageInputRule(pipeline_name=self.pipeline_name, task="text-to-video")

    def batch_key(self, req: Req) -> tuple:
        """The base key (with the audio length, `LTX2Conditioning.audio_latents`) plus what one LTX-2 forward
        shares: frame rate, cross timestep, and the STG blocks of requests that run STG rows."""
        plan = self.denoiser.guidance(req)
        blocks = self.denoiser.stg_blocks(plan.settings) if plan.stg_rows else ()
        return (
            *super().batch_key(req),
            self.denoiser.conditioning_fps(req),
            plan.settings.use_cross_timestep,
            blocks,
        )

    def preview_images(self, req: Req) -> list:
        raise NotImplementedError("LTX-2 has no mid-denoising previews")


class LTX2ImageToVideoPipeline(LTX2Pipeline):
    """Animates one input image (its first frame), resized to the requested size (default 512x768)."""

    pipeline_name = "LTX2ImageToVideoPipeline"
    image_to_video = True

    def image_input_rule(self) -> ImageInputRule:
        return ImageInputRule(pipeline_name=self.pipeline_name, min_images=1, max_images=1)
