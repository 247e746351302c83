"""`DiffusersBackendPipeline`: a Diffusers pipeline class run through diffusers itself (`--backend diffusers`),
behind the engine's `EnginePipeline` contract (runtime/contract.py), one request at a time.

- validate: the pipeline's `__call__` signature decides what a request may set (a field it does not take
  is an InvalidRequestError naming it, `diffusers_call.py`) and gives the defaults of the steps and
  guidance; sizes are multiples of the VAE's scale factor (times the DiT's patch); the seed makes a CPU
  `torch.Generator`, as diffserve's native path does, so `seed=s` gives what calling diffusers with
  `generator=torch.Generator("cpu").manual_seed(s)` gives.
- run_pre_denoise: nothing runs yet; a placeholder `Schedule` of the expected steps (the call corrects it).
- denoise_step: advances the request's call by one step (`diffusers_run.py`), so progress, `on_step`,
  cancellation and step times work as for native requests. `batch_key` is the request id: no two
  requests share a step, and the engine runs one request at a time (the call's scheduler and the
  pipeline object hold per-call state).
- run_post_denoise: the call decodes; its output's `images` or `frames` become the request's outputs,
  in the same layout the native pipelines give the output writers.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Hashable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from PIL import Image

from diffserve.backends.diffusers_call import CallSignature, call_kwargs, check_fields_taken
from diffserve.backends.diffusers_import import import_diffusers
from diffserve.backends.diffusers_run import CallDone, DiffusersRun
from diffserve.configs.quality import TierPreset
from diffserve.configs.sampling_params import SamplingParams
from diffserve.errors import InvalidRequestError, ModelLoadError
from diffserve.image_inputs import without_alpha
from diffserve.loader.component_loader import LoadedComponent
from diffserve.loader.owned_weights import detach_from_files
from diffserve.platforms import Platform
from diffserve.request import Req, Schedule
from diffserve.runtime.contract import PipelineFacts

logger = logging.getLogger("diffserve.backends")

#: Frames per second of a video file when the request does not say (the pipeline's own `fps` default wins).
DEFAULT_FPS = 16
#: Most frames and fps a video request may ask for (as native video families allow).
MAX_FRAMES = 1025
MAX_FPS = 120
#: The size multiple of a pipeline that declares no VAE scale factor (every Diffusers image VAE's 8; logged).
FALLBACK_VAE_SCALE_FACTOR = 8
#: Diffusers names its image-conditioned pipeline classes with these words. A pipeline whose `__call__`
#: takes `image` needs one when its class name has one of them (img2img, inpainting, image-to-video, edit
#: pipelines); elsewhere (e.g. FLUX.2's reference images) the image is optional. The signature alone cannot
#: tell: Diffusers declares `image=None` either way.
IMAGE_CONDITIONED_MARKERS = ("Img2Img", "ImageToImage", "Inpaint", "ImageToVideo", "Edit", "InstructPix2Pix")


@dataclass(frozen=True)
class BackendFamily:
    """What the front ends show of a model served by the diffusers backend (a native model's `ModelFamily`
    has the same three fields): its name, the Diffusers pipeline class and its task."""

    name: str
    diffusers_pipeline: str
    task: str


#: Denoising steps of a probe request through this backend (`DiffusersBackendPipeline._probe_steps`): two,
#: the fewest every schedule of the Diffusers pipelines it serves accepts (Mochi's refuses one).
BACKEND_PROBE_STEPS = 2


@dataclass(frozen=True)
class BackendContext:
    """The loaded Diffusers pipeline's components (as the memory model and offload reports read them)."""

    components: dict[str, LoadedComponent]
    platform: Platform
    dtype: torch.dtype


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _config_value(module: object, name: str) -> object:
    config = getattr(module, "config", None)
    return None if config is None else getattr(config, name, None)


def vae_scale_factor(pipe: object) -> int | None:
    """Pixels per latent pixel (spatial): the pipeline's `vae_scale_factor`, or its video spelling."""
    for name in ("vae_scale_factor", "vae_scale_factor_spatial"):
        if (value := _int_or_none(getattr(pipe, name, None))) is not None:
            return value
    return None


def pixel_multiple(pipe: object, factor: int) -> int:
    """Height and width multiples: the VAE's `factor` times the DiT's (spatial) patch, if it has one."""
    patch = _int_or_none(_config_value(getattr(pipe, "transformer", None), "patch_size")) or 1
    return factor * patch


def default_size(pipe: object, factor: int) -> tuple[int, int] | None:
    """(height, width) the pipeline makes when none is given, as its `__call__` computes it from the
    VAE's `factor`; None when it cannot be read (then requests must set both)."""
    if (size := _int_or_none(getattr(pipe, "default_sample_size", None))) is not None:
        return size * factor, size * factor
    transformer, unet = getattr(pipe, "transformer", None), getattr(pipe, "unet", None)
    height = _int_or_none(_config_value(transformer, "sample_height"))
    width = _int_or_none(_config_value(transformer, "sample_width"))
    if height is not None and width is not None:
        return height * factor, width * factor
    for module in (unet, transformer):
        if (size := _int_or_none(_config_value(module, "sample_size"))) is not None:
            return size * factor, size * factor
    return None


def temporal_factor(pipe: object) -> int:
    return _int_or_none(getattr(pipe, "vae_scale_factor_temporal", None)) or 1


class DiffusersBackendPipeline:
    """A loaded Diffusers pipeline behind the engine's phases (see the module docstring)."""

    #: No approximate quality tiers: only "high", the pipeline as diffusers runs it (`Pipeline`'s attribute).
    step_cache_policies: ClassVar[dict[str, TierPreset]] = {}

    def __init__(self, pipe: Any, context: BackendContext) -> None:
        self.pipe, self.context = pipe, context
        self.signature = CallSignature.of(type(pipe))
        name = self.signature.pipeline_name
        missing = self.signature.missing_required()
        if missing:
            raise ModelLoadError(
                f"--backend diffusers cannot serve {name}: its __call__ takes no {', '.join(missing)} "
                "argument(s), which this backend passes to every call"
            )
        factor = vae_scale_factor(pipe)
        if factor is None:
            factor = FALLBACK_VAE_SCALE_FACTOR
            logger.warning(
                "%s declares no vae_scale_factor: heights and widths must be multiples of %d", name, factor
            )
        self.default_size = default_size(pipe, factor)
        video = self.signature.makes_video
        needs_image = self.signature.takes("image") and any(m in name for m in IMAGE_CONDITIONED_MARKERS)
        self._facts = PipelineFacts(
            name=name,
            pixel_multiple=pixel_multiple(pipe, factor),
            dit_width=self._dit_width(),
            dtype=context.dtype,
            cfg_mode="classic",
            min_input_images=1 if needs_image else 0,
            max_input_images=1 if self.signature.takes("image") else 0,
            requires_mask=self.signature.takes("mask_image"),
            inpainting=self.signature.takes("mask_image"),
            makes_video=video,
            temporal_factor=temporal_factor(pipe) if video else 1,
            max_frames=MAX_FRAMES if video else 0,
            max_fps=MAX_FPS if video else 0,
            probe_steps=self._probe_steps(),
        )
        self.defaults = self._default_params()
        #: The request whose call is in progress (the engine runs one at a time), by request id.
        self._runs: dict[str, DiffusersRun] = {}

    def _probe_steps(self) -> int:
        """Denoising steps of this pipeline's probe requests (warm-up, calibration, /health_generate):
        `BACKEND_PROBE_STEPS`, or the signature's default step count where that is fewer. The backend
        cannot read the fewest steps a Diffusers pipeline's schedule takes, and some take no single step
        (a linear-quadratic schedule of n // 2 linear steps divides by zero at n = 1), so a probe never
        runs one."""
        default = _int_or_none(self.signature.number_default("num_inference_steps"))
        return BACKEND_PROBE_STEPS if default is None or default < 1 else min(BACKEND_PROBE_STEPS, default)

    def _dit_width(self) -> int:
        """The denoiser's hidden width, as the memory estimate reads it (heads x head dim, or channels)."""
        denoiser = getattr(self.pipe, "transformer", None) or getattr(self.pipe, "unet", None)
        heads = _int_or_none(_config_value(denoiser, "num_attention_heads"))
        head_dim = _int_or_none(_config_value(denoiser, "attention_head_dim"))
        if heads is not None and head_dim is not None:
            return heads * head_dim
        channels = _config_value(denoiser, "block_out_channels")
        return int(max(channels)) if isinstance(channels, (list, tuple)) and channels else 1

    def _default_params(self) -> SamplingParams:
        """The defaults a request's unset fields take: the signature's, and the pipeline's own size."""
        sig = self.signature
        height, width = self.default_size or (None, None)
        steps = sig.number_default("num_inference_steps")
        frames = sig.number_default("num_frames")
        if frames is None and sig.makes_video:
            frames = _int_or_none(_config_value(getattr(self.pipe, "transformer", None), "sample_frames"))
        return SamplingParams(
            height=height,
            width=width,
            num_inference_steps=None if steps is None else int(steps),
            guidance_scale=None if not sig.takes("guidance_scale") else sig.number_default("guidance_scale"),
            num_frames=None if frames is None else int(frames),
            fps=int(sig.number_default("fps") or DEFAULT_FPS) if sig.makes_video else None,
            video_format="mp4" if sig.makes_video else None,
        )

    @property
    def facts(self) -> PipelineFacts:
        return self._facts

    def describe(self) -> str:
        return f"{self.signature.pipeline_name} through diffusers {import_diffusers().__version__}"

    # -- the engine's phases ----------------------------------------------------------------------------

    def validate(self, req: Req) -> Req:
        """Fields the pipeline does not take are refused; defaults applied; sizes and frames checked."""
        params = req.params
        check_fields_taken(params, self.signature)
        resolved = params.with_defaults(self.defaults)
        for name in ("height", "width", "num_inference_steps"):
            if getattr(resolved, name) is None:
                raise InvalidRequestError(
                    f"{name}: {self.signature.pipeline_name} declares no default diffserve can read; set it",
                    param=name,
                )
        resolved.validate(self._facts.pixel_multiple)
        if self._facts.makes_video:
            self._check_video(resolved)
        if self._facts.min_input_images and not resolved.input_images:
            raise InvalidRequestError(
                f"input_images: {self.signature.pipeline_name} needs an input image", param="input_images"
            )
        if self._facts.requires_mask and resolved.mask_image is None:
            raise InvalidRequestError(
                f"mask_image: {self.signature.pipeline_name} needs a mask", param="mask_image"
            )
        if resolved.input_images:  # RGB, as before the loaders kept transparency for families that read it
            resolved = replace(resolved, input_images=without_alpha(resolved.input_images))
        req.params = replace(resolved, quality="high")
        req.generator = torch.Generator("cpu").manual_seed(resolved.seed)
        guidance = resolved.guidance_scale
        req.do_cfg = guidance is not None and guidance > 1  # Diffusers' classic rule; for the memory estimate
        req.cfg_scale = float(guidance) if guidance is not None else 1.0
        return req

    def _check_video(self, params: SamplingParams) -> None:
        frames, factor = params.num_frames, self._facts.temporal_factor
        if not isinstance(frames, int) or frames < 1 or (frames - 1) % factor or frames > MAX_FRAMES:
            raise InvalidRequestError(
                f"num_frames must be {factor}k+1 (1, {factor + 1}, {2 * factor + 1}, ... up to {MAX_FRAMES}), "
                f"got {frames!r}",
                param="num_frames",
            )
        if not isinstance(params.fps, int) or not 1 <= params.fps <= MAX_FPS:
            raise InvalidRequestError(
                f"fps must be an integer in [1, {MAX_FPS}], got {params.fps!r}", param="fps"
            )

    def run_pre_denoise(self, req: Req) -> Req:
        """Nothing runs before the first step (the call encodes text itself); the expected step count."""
        req.schedule = Schedule.of_length(int(req.params.num_inference_steps or 0))
        req.step_index = 0
        return req

    def denoise_step(self, reqs: list[Req]) -> None:
        """One step of the one request (`batch_key` is unique per request)."""
        if len(reqs) != 1:
            raise RuntimeError(f"--backend diffusers runs one request per step, got {len(reqs)}")
        req = reqs[0]
        run = self._runs.get(req.request_id)
        if run is None:
            self._stop_other_runs(req.request_id)
            run = self._runs[req.request_id] = DiffusersRun(
                req, self._call(req), self.signature.pipeline_name
            )
        try:
            event = run.advance()
        except BaseException:
            self._runs.pop(req.request_id, None)
            raise
        if isinstance(event, CallDone):  # fewer steps than expected: the call is over
            self._runs.pop(req.request_id, None)
            self._set_outputs(req, event.output)
            req.schedule = Schedule.of_length(run.steps_done)
            req.step_index = run.steps_done
            return
        if event.total != req.num_steps:  # the pipeline's own count (e.g. a strength-shortened schedule)
            req.schedule = Schedule.of_length(event.total)
        req.step_index = event.step

    def run_post_denoise(self, req: Req) -> Req:
        """Let the call decode, and take its images or frames."""
        run = self._runs.pop(req.request_id, None)
        if run is not None:
            self._set_outputs(req, run.finish())
        return req

    def batch_key(self, req: Req) -> Hashable:
        return req.request_id

    def preview_images(self, req: Req) -> list[Image.Image]:
        raise NotImplementedError("previews (partial_images) are not available with --backend diffusers")

    # -- helpers ----------------------------------------------------------------------------------------

    def _stop_other_runs(self, request_id: str) -> None:
        """Calls left by requests that ended without finishing (cancelled, failed): stop them before the
        next call uses the pipeline."""
        for other in [rid for rid in self._runs if rid != request_id]:
            self._runs.pop(other).stop()

    def _call(self, req: Req) -> Any:
        assert req.generator is not None
        pipe, params, generator, signature = self.pipe, req.params, req.generator, self.signature

        def call(callback: Any) -> object:
            return pipe(**call_kwargs(params, signature, generator, callback))

        return call

    def _set_outputs(self, req: Req, output: object) -> None:
        """The call's decoded output (`output_type="np"`, values in [0, 1]) as the request's images or video
        frames, rounded to uint8 as Diffusers' own conversion does."""
        frames = getattr(output, "frames", None)
        images = getattr(output, "images", None)
        name = self.signature.pipeline_name
        if frames is not None:
            if not self._facts.makes_video:
                raise RuntimeError(f"{name} returned video frames, but it was loaded as an image pipeline")
            req.outputs.frames = [_to_uint8(np.asarray(video)) for video in frames]
        elif images is not None:
            if self._facts.makes_video:
                raise RuntimeError(f"{name} returned images, but it was loaded as a video pipeline")
            req.outputs.images = [
                image if isinstance(image, Image.Image) else Image.fromarray(_to_uint8(np.asarray(image)))
                for image in images
            ]
        else:
            raise RuntimeError(f"{name} returned {type(output).__name__}, with neither images nor frames")


def _to_uint8(array: np.ndarray) -> np.ndarray:
    if array.dtype == np.uint8:
        return array
    return (array * 255).round().astype(np.uint8)


def task_of(pipeline: DiffusersBackendPipeline) -> str:
    """The task names the front ends route by (as `ModelFamily.task`)."""
    facts = pipeline.facts
    if facts.makes_video:
        return "image-to-video" if facts.min_input_images else "text-to-video"
    return "image-edit" if facts.min_input_images else "text-to-image"


def load_diffusers_pipeline(folder: Path, platform: Platform, dtype: torch.dtype) -> DiffusersBackendPipeline:
    """`DiffusionPipeline.from_pretrained(folder)` in `dtype` on the platform's device, behind the contract."""
    diffusers = import_diffusers()
    try:
        pipe = diffusers.DiffusionPipeline.from_pretrained(str(folder), torch_dtype=dtype)
    except (OSError, ValueError, ImportError, AttributeError) as exc:
        raise ModelLoadError(f"diffusers could not load {folder}: {type(exc).__name__}: {exc}") from exc
    pipe = pipe.to(platform.device())
    pipe.set_progress_bar_config(disable=True)  # the engine reports progress
    # diffusers and transformers leave same-dtype weights as views of their mapped files: copy them out,
    # so that a weight file rewritten or truncated after the load changes nothing (owned_weights.py).
    weight_files = sorted(folder.glob("*/*.safetensors"))
    for value in pipe.components.values():
        if isinstance(value, torch.nn.Module):
            detach_from_files(value, weight_files)
    components = {
        name: LoadedComponent(name, type(value).__name__, value)
        for name, value in pipe.components.items()
        if value is not None and not inspect.isclass(value)
    }
    return DiffusersBackendPipeline(pipe, BackendContext(components, platform, dtype))
