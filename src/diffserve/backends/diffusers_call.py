"""How a diffserve request becomes the keyword arguments of a Diffusers pipeline's `__call__`: which
SamplingParams fields map to which arguments, which defaults the pipeline's signature gives, and which
fields a request may not set because the pipeline takes no such argument (an InvalidRequestError naming
the field, never a silently ignored setting)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from diffserve.configs.quality import AUTO, EXACT, canonical_tier
from diffserve.configs.sampling_params import SamplingParams
from diffserve.errors import InvalidRequestError

#: SamplingParams fields passed to `__call__` under the same name, when the request (or a default) sets them.
SAME_NAME_FIELDS = (
    "negative_prompt",
    "height",
    "width",
    "num_inference_steps",
    "guidance_scale",
    "true_cfg_scale",
    "max_sequence_length",
    "num_frames",
    "strength",
    "skip_guidance_layers",
    "skip_layer_guidance_scale",
    "skip_layer_guidance_start",
    "skip_layer_guidance_stop",
)
#: `num_outputs_per_prompt` under the pipeline's own name for it.
OUTPUTS_ARGUMENTS = ("num_images_per_prompt", "num_videos_per_prompt")
#: The arguments diffserve itself passes to every call (a pipeline must take all of them).
REQUIRED_ARGUMENTS = ("prompt", "generator", "output_type", "callback_on_step_end", "height", "width")


@dataclass(frozen=True)
class CallSignature:
    """The `__call__` arguments of one Diffusers pipeline class, and the defaults its signature declares."""

    pipeline_name: str
    arguments: frozenset[str]
    defaults: dict[str, object]

    @classmethod
    def of(cls, pipeline_cls: type) -> CallSignature:
        parameters = inspect.signature(pipeline_cls.__call__).parameters
        defaults = {
            name: p.default for name, p in parameters.items() if p.default is not inspect.Parameter.empty
        }
        return cls(pipeline_cls.__name__, frozenset(parameters) - {"self"}, defaults)

    def missing_required(self) -> list[str]:
        """The arguments diffserve needs that this pipeline's `__call__` does not take."""
        return [name for name in REQUIRED_ARGUMENTS if name not in self.arguments]

    def takes(self, name: str) -> bool:
        return name in self.arguments

    def number_default(self, name: str) -> int | float | None:
        """The signature's default of `name` when it is a number; None otherwise (or when not taken)."""
        value = self.defaults.get(name)
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    @property
    def outputs_argument(self) -> str | None:
        return next((name for name in OUTPUTS_ARGUMENTS if name in self.arguments), None)

    @property
    def makes_video(self) -> bool:
        """Video pipelines take a frame count; image pipelines do not."""
        return "num_frames" in self.arguments


def check_fields_taken(params: SamplingParams, signature: CallSignature) -> None:
    """InvalidRequestError naming the first field `params` sets that this pipeline cannot take."""
    pipeline = signature.pipeline_name

    def refuse(name: str, why: str) -> None:
        raise InvalidRequestError(f"{name}: {why} (--backend diffusers, {pipeline})", param=name)

    for name in SAME_NAME_FIELDS:
        if getattr(params, name) is not None and not signature.takes(name):
            refuse(name, f"{pipeline}.__call__ takes no {name!r} argument")
    if params.num_outputs_per_prompt != 1 and signature.outputs_argument is None:
        refuse("num_outputs_per_prompt", f"{pipeline}.__call__ makes one output per prompt")
    if params.input_images and not signature.takes("image"):
        refuse("input_images", f"{pipeline}.__call__ takes no input image")
    if params.input_images and len(params.input_images) > 1:
        refuse("input_images", "this backend passes at most one input image")
    if params.input_video is not None:
        refuse("video", "this backend passes no input video (video-to-video families run natively)")
    if params.mask_image is not None and not signature.takes("mask_image"):
        refuse("mask_image", f"{pipeline}.__call__ takes no mask")
    if (params.fps is not None or params.video_format is not None) and not signature.makes_video:
        refuse("fps" if params.fps is not None else "video_format", f"{pipeline} makes images, not videos")
    if params.loras:
        refuse("loras", "LoRA adapters are not available with this backend")
    if params.extra:
        refuse("extra", "extra settings are not available with this backend")
    if params.cache is not None and params.cache.method != "none":
        refuse("cache", f"cache method {params.cache.method!r} runs on diffserve's native DiTs only")
    if params.quality is not None:
        try:
            tier = canonical_tier(params.quality)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="quality") from None
        if tier not in (AUTO, EXACT):
            refuse(
                "quality", f"only quality {EXACT!r} (exact) is served by this backend, got {params.quality!r}"
            )


def call_kwargs(
    params: SamplingParams,
    signature: CallSignature,
    generator: torch.Generator,
    callback: Callable[..., dict[str, Any]],
) -> dict[str, Any]:
    """The keyword arguments of the pipeline call for resolved `params` (checked by `check_fields_taken`):
    decoded output as numpy arrays in [0, 1], whatever the pipeline makes (images or video frames)."""
    kwargs: dict[str, Any] = {
        "prompt": params.prompt,
        "generator": generator,
        "output_type": "np",
        "callback_on_step_end": callback,
    }
    for name in SAME_NAME_FIELDS:
        value = getattr(params, name)
        if value is not None and signature.takes(name):
            kwargs[name] = value
    if signature.outputs_argument is not None:
        kwargs[signature.outputs_argument] = params.num_outputs_per_prompt
    if params.input_images:
        kwargs["image"] = params.input_images[0]
    if params.mask_image is not None:
        kwargs["mask_image"] = params.mask_image
    return kwargs
