"""OpenAI-compatible request and response bodies, and the request -> `SamplingParams` mapping."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import secrets
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from diffserve.configs.option import option_of
from diffserve.configs.sampling_params import (
    MAX_IMAGE_SIDE,
    MAX_LORA_SCALE,
    LoraChoice,
    SamplingParams,
    lora_choices,
)
from diffserve.server.cache_schema import CacheRequest, cache_field, cache_settings
from diffserve.server.controlnet_schema import CONTROLNETS_NOTE, ControlNetEntry, controlnet_entries


class ApiParamError(ValueError):
    """A request field the schema accepts but whose value cannot be served (-> 400 naming `param`)."""

    def __init__(self, message: str, param: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


#: OpenAI fields diffserve cannot honour yet, with the values that change nothing (accepted).
NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "background": (None, "auto"),
    "style": (None,),
    "moderation": (None, "auto"),
}

#: OpenAI's limit on partial images per streamed request.
MAX_PARTIAL_IMAGES = 3

_SIZE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")


# Fields of both generation routes (OpenAI's, then diffserve's extensions; unset: the model's defaults).
_PRIORITY = "scheduling priority (-1000..1000, default 0): higher first, then first come first served"
ModelName = Annotated[str | None, Field(description="the served model's id or a --served-model-name")]
Priority = Annotated[int | None, Field(ge=-1000, le=1000, description=_PRIORITY)]


def sampling_field(name: str, note: str | None = None, required: bool = False) -> Any:
    """The request field of SamplingParams' option `name`, as declared (`configs/sampling_params.py`): its
    default at the front ends (unset: the model's), bounds (for a list: its length) and help (then `note`,
    what only HTTP clients need to know), so that validation and the OpenAPI document say what the CLI
    and the engine say. Numbers must be finite. `required`: no default, the request must give it."""
    declared = option_of(SamplingParams, name)
    spec = declared.spec
    if declared.is_list:
        bounds = {"min_length": spec.min_items, "max_length": spec.max_items}
    else:
        bounds = {"ge": spec.min, "le": spec.max, "gt": spec.gt, "lt": spec.lt}
        if declared.base_type is float:
            bounds["allow_inf_nan"] = False
    given = {key: value for key, value in bounds.items() if value is not None}
    description = spec.help if note is None else f"{spec.help}; {note}"
    default = ... if required else declared.front_end_default
    return Field(default, description=description, **given)  # type: ignore[arg-type]


def sampling_items(name: str) -> Any:
    """The bounds of each item of SamplingParams' list option `name` (`Annotated[int, sampling_items(...)]`)."""
    spec = option_of(SamplingParams, name).spec
    given = {"ge": spec.min, "le": spec.max, "gt": spec.gt, "lt": spec.lt}
    return Field(**{key: value for key, value in given.items() if value is not None})  # type: ignore[arg-type]


def utf8_text(value: Any) -> Any:
    """A field validator: strings (also in lists) must encode as UTF-8; a lone surrogate ("\\ud800")
    would fail later, where the text is encoded (tokenizer, PNG, JSON)."""
    for item in value if isinstance(value, list) else [value]:
        try:
            item.encode("utf-8") if isinstance(item, str) else None
        except UnicodeEncodeError as exc:
            at = f"({item[exc.start]!r}) at character {exc.start}"
            raise ValueError(f"not valid Unicode text: a lone surrogate {at}; send UTF-8 text") from None
    return value


class LoraEntry(BaseModel):
    """One LoRA adapter a request applies: a name the server knows (`GET /v1/loras`, or a file of its
    --lora-dir) and its scale."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, description="the adapter's name (GET /v1/loras lists them)")
    scale: float = Field(
        1.0,
        allow_inf_nan=False,
        description=f"1.0: as trained; 0: off; negative: subtracted (within +-{MAX_LORA_SCALE:g})",
    )


_LORA_EXAMPLE = '[{"name": "style", "scale": 0.8}]'
_LORAS_FORM = f"for example {_LORA_EXAMPLE} (in a multipart form: that JSON as text)"


def lora_entries(value: Any) -> Any:
    """A `loras` field validator: a multipart form sends the list as JSON text; each entry must be an
    object with `name` and optionally `scale` (their types are the model's to check)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f"expected a JSON list such as {_LORA_EXAMPLE}") from None
    if value is None:
        return None
    if not isinstance(value, list):
        raise ValueError(f"expected a list such as {_LORA_EXAMPLE}")
    for i, entry in enumerate(value):
        if not isinstance(entry, dict) or "name" not in entry or not set(entry) <= {"name", "scale"}:
            raise ValueError(
                f'entry {i} is {entry!r}; each entry is {{"name": str, "scale": float}} (scale optional, '
                "default 1.0)"
            )
    return value


#: Bounds of a request's `extra` (a family's own settings): how many, and how long a key or a list may be.
MAX_EXTRA_SETTINGS = 32
MAX_EXTRA_KEY_CHARS = 64
MAX_EXTRA_LIST_ITEMS = 256
_EXTRA_EXAMPLE = '{"stg_scale": 1.5}'


def extra_settings(value: Any) -> Any:
    """An `extra` field validator: an object of at most `MAX_EXTRA_SETTINGS` settings, each a number, a
    string, a boolean, null or a list of those (bounded), so that nothing a client sends there grows the
    server's memory; a multipart form sends it as JSON text. Which keys and values a family takes, the
    family checks (a 400 naming the setting)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, RecursionError):
            raise ValueError(f"expected a JSON object such as {_EXTRA_EXAMPLE}") from None
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"expected an object such as {_EXTRA_EXAMPLE}")
    if len(value) > MAX_EXTRA_SETTINGS:
        raise ValueError(f"at most {MAX_EXTRA_SETTINGS} settings, got {len(value)}")
    scalar = (bool, int, float, str, type(None))
    for key, setting in value.items():
        if len(key) > MAX_EXTRA_KEY_CHARS:
            raise ValueError(f"setting names are at most {MAX_EXTRA_KEY_CHARS} characters")
        items = setting if isinstance(setting, list) else [setting]
        if len(items) > MAX_EXTRA_LIST_ITEMS or not all(isinstance(item, scalar) for item in items):
            raise ValueError(
                f"{key!r}: a setting is a number, a string, a boolean, null or a list of at most "
                f"{MAX_EXTRA_LIST_ITEMS} of those"
            )
    return value


_CACHE_NOTE = (
    'for example {"method": "dbcache", "Fn_compute_blocks": 1, "residual_diff_threshold": 0.12} (in a '
    "multipart form: that JSON as text); the response's `cache` reports the steps and blocks it computed "
    "and reused"
)


def sampling_params(body: BaseModel, **fields: Any) -> SamplingParams:
    """The engine's parameters: the request's fields named as SamplingParams fields, then `fields`. An
    unset seed is drawn here, so that the answer can name it. `loras` are checked here (count, distinct
    names, scale range: InvalidRequestError naming `loras`); whether the engine has them, by the engine."""
    shared = {f.name for f in dataclasses.fields(SamplingParams)} & set(type(body).model_fields)
    names = shared - {*fields, "seed", "loras", "cache", "controlnets"}  # controlnets: the route decodes them
    seed = body.seed if body.seed is not None else secrets.randbelow(2**32)
    loras = _lora_choices(getattr(body, "loras", None))
    values = {name: getattr(body, name) for name in names}
    if values.get("extra") is None:
        values.pop("extra", None)  # unset: no family settings
    cache = cache_settings(getattr(body, "cache", None))
    return SamplingParams(seed=seed, loras=loras, cache=cache, **values, **fields)


def _lora_choices(entries: list[LoraEntry] | None) -> list[LoraChoice]:
    return lora_choices([{"name": e.name, "scale": e.scale} for e in entries or []])


def parse_size(size: str, expected: str) -> tuple[int, int]:
    """(width, height) of a "WIDTHxHEIGHT" `size`; `expected` describes the accepted values in the error."""
    match = _SIZE.match(size)
    if match is None:
        raise ApiParamError(f"size must be {expected}, got {size!r}", param="size")
    width, height = int(match.group(1)), int(match.group(2))
    if max(width, height) > MAX_IMAGE_SIDE:
        raise ApiParamError(
            f"size: each side must be at most {MAX_IMAGE_SIDE} pixels, got {size!r}", param="size"
        )
    return width, height


class ImageGenerationRequest(BaseModel):
    """`POST /v1/images/generations`. OpenAI's fields, then diffserve's extensions; nothing else."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = sampling_field("prompt", required=True)
    model: ModelName = None
    n: int | None = Field(1, ge=1, le=10, description="images to generate (1-10), all from one request")
    size: str | None = Field(None, description="'WIDTHxHEIGHT' or 'auto' (the model's default)")
    response_format: Literal["b64_json", "url"] | None = "b64_json"
    output_format: Literal["png", "jpeg", "webp"] | None = sampling_field("output_format")
    output_compression: int | None = Field(None, ge=0, le=100, description="jpeg/webp quality (default 100)")
    user: str | None = Field(None, description="end-user id; accepted for compatibility, not used")
    stream: bool | None = Field(None, description="answer with OpenAI's server-sent events")
    #: With stream=true: previews sent while the image is made, before the final one.
    partial_images: int | None = Field(None, ge=0, le=MAX_PARTIAL_IMAGES)
    quality: str | None = sampling_field("quality")  # checked by the engine: the tiers are the family's
    # OpenAI fields accepted only with a value that changes nothing (see NO_OP_VALUES).
    background: str | None = None
    style: str | None = None
    moderation: str | None = None
    # diffserve extensions (SamplingParams fields, as declared there); unset: the model's defaults.
    width: int | None = sampling_field("width")
    height: int | None = sampling_field("height")
    seed: int | None = sampling_field("seed")
    negative_prompt: str | None = sampling_field("negative_prompt")
    num_inference_steps: int | None = sampling_field("num_inference_steps")
    guidance_scale: float | None = sampling_field("guidance_scale")
    true_cfg_scale: float | None = sampling_field("true_cfg_scale")
    skip_guidance_layers: list[Annotated[int, sampling_items("skip_guidance_layers")]] | None = (
        sampling_field("skip_guidance_layers")
    )
    skip_layer_guidance_scale: float | None = sampling_field("skip_layer_guidance_scale")
    skip_layer_guidance_start: float | None = sampling_field("skip_layer_guidance_start")
    skip_layer_guidance_stop: float | None = sampling_field("skip_layer_guidance_stop")
    max_sequence_length: int | None = sampling_field("max_sequence_length")
    priority: Priority = None
    loras: list[LoraEntry] | None = sampling_field("loras", note=_LORAS_FORM)
    extra: dict[str, Any] | None = sampling_field("extra", note=f"for example {_EXTRA_EXAMPLE}")
    cache: CacheRequest | None = sampling_field("cache", note=_CACHE_NOTE)
    controlnets: list[ControlNetEntry] | None = sampling_field("controlnets", note=CONTROLNETS_NOTE)

    _utf8 = field_validator("*")(utf8_text)
    _loras = field_validator("loras", mode="before")(lora_entries)
    _extra = field_validator("extra", mode="before")(extra_settings)
    _cache = field_validator("cache", mode="before")(cache_field)
    _controlnets = field_validator("controlnets", mode="before")(controlnet_entries)

    def check_supported(self) -> None:
        for name, allowed in NO_OP_VALUES.items():
            value = getattr(self, name)
            if value not in allowed:
                accepted = " or ".join(repr(a) for a in allowed if a is not None)
                hint = f"omit it or pass {accepted}" if accepted else "omit it"
                message = f"{name}={value!r} is not supported yet by diffserve; {hint}"
                raise ApiParamError(message, param=name, code="unsupported_value")
        if self.partial_images and not self.stream:
            raise ApiParamError(
                f"partial_images={self.partial_images} needs stream=true: partial images are sent as server-sent "
                "events while the image is generated; pass stream=true, or omit partial_images",
                param="partial_images",
            )
        if self.stream and self.response_format == "url":
            raise ApiParamError(
                "response_format='url' is not available with stream=true: streamed images come as b64_json "
                "in the events; omit response_format or pass 'b64_json'",
                param="response_format",
            )
        if self.output_compression not in (None, 100) and (self.output_format or "png") == "png":
            raise ApiParamError(
                "output_compression applies to output_format 'jpeg' and 'webp' only (png is lossless)",
                param="output_compression",
            )

    def image_size(self) -> tuple[int | None, int | None]:
        """(width, height) from `size` or `width`/`height`; (None, None): the model's default."""
        if self.size is None or self.size.strip() == "auto":
            return self.width, self.height
        width, height = parse_size(self.size, "'WIDTHxHEIGHT' (for example '1024x1024') or 'auto'")
        if (self.width is not None and self.width != width) or (
            self.height is not None and self.height != height
        ):
            raise ApiParamError(
                f"size={self.size!r} conflicts with width/height; pass either size or width and height",
                param="size",
            )
        return width, height

    def to_sampling_params(self) -> SamplingParams:
        """The engine's parameters (raises ApiParamError). Range checks against the model happen in the engine."""
        self.check_supported()
        width, height = self.image_size()
        n, fmt = self.n or 1, self.output_format or "png"
        return sampling_params(self, height=height, width=width, num_outputs_per_prompt=n, output_format=fmt)


ACCEPTED_FIELDS: tuple[str, ...] = tuple(ImageGenerationRequest.model_fields)


class ImageReference(BaseModel):
    """One entry of OpenAI's JSON `images: [{"image_url": ...}]` (or `mask: {"image_url": ...}`)."""

    model_config = ConfigDict(extra="forbid")

    image_url: str | None = Field(None, description="a data URL, or an http(s) URL (--allow-url-images)")
    file_id: str | None = Field(None, description="OpenAI Files API id; not supported by diffserve")

    _utf8 = field_validator("*")(utf8_text)

    def source(self, param: str) -> str:
        if self.file_id is not None:
            raise ApiParamError(
                f"{param}: file_id is not supported (diffserve has no Files API); pass image_url as a base64 "
                "data URL (data:image/png;base64,...) instead",
                param=param,
                code="unsupported_value",
            )
        if self.image_url is None:
            raise ApiParamError(f"{param}: image_url is required", param=param)
        return self.image_url


class ImageEditRequest(ImageGenerationRequest):
    """`POST /v1/images/edits`: the generation fields plus the input images of a JSON body (a multipart
    body's image parts are read by the route, image_edits.py). The route puts the decoded images into
    `to_sampling_params`' result."""

    image: str | list[str] | None = Field(None, description="input image(s) as data URLs (or http(s) URLs)")
    images: list[ImageReference] | None = Field(None, description="OpenAI's JSON form: [{'image_url': ...}]")
    mask: str | ImageReference | None = Field(
        None,
        description="inpainting mask of the image's size (FLUX, SD3, FLUX.1 Fill): its transparent pixels "
        "(alpha 0) mark the area to edit, as OpenAI's; a mask without alpha: white = edit, black = keep",
    )
    strength: float | None = sampling_field("strength", note="a form field or a JSON number")

    def image_sources(self) -> list[str]:
        """The JSON body's input images in order (raises ApiParamError when both forms are given)."""
        if self.image is not None and self.images is not None:
            message = "pass the input images as either 'image' or 'images', not both"
            raise ApiParamError(message, param="images")
        if self.images is not None:
            return [ref.source(f"images[{i}]") for i, ref in enumerate(self.images)]
        if isinstance(self.image, str):
            return [self.image]
        return list(self.image or [])

    def mask_source(self) -> str | None:
        return self.mask.source("mask") if isinstance(self.mask, ImageReference) else self.mask


EDIT_ACCEPTED_FIELDS: tuple[str, ...] = tuple(ImageEditRequest.model_fields)


#: Largest side a video may ask for; beyond it a request is refused before it reaches the engine.
MAX_VIDEO_SIDE = 4096


class VideoCreateRequest(BaseModel):
    """`POST /v1/videos`: OpenAI's fields, then diffserve's extensions; nothing else."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = sampling_field("prompt", required=True)
    model: ModelName = None
    size: str | None = Field(None, description="'WIDTHxHEIGHT'; unset: the model's default")
    seconds: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="clip length (string or number); not with num_frames"
    )
    #: The first frame (image-to-video models): an uploaded file, or a data URL / {image_url}.
    input_reference: str | ImageReference | None = None
    #: The video to extend (video-to-video models): decoded by the route (`diffserve.video_inputs`).
    video: str | None = Field(
        None,
        description="video-to-video models (SkyReels-V2 diffusion forcing's video extension): the video to "
        "extend, as a base64 data URL (data:video/mp4;base64,...; MP4, WebM, GIF or WebP), or in a multipart "
        "form a file part",
    )
    num_frames: int | None = sampling_field("num_frames")  # excludes seconds
    fps: int | None = sampling_field("fps")
    seed: int | None = sampling_field("seed")
    negative_prompt: str | None = sampling_field("negative_prompt")
    num_inference_steps: int | None = sampling_field("num_inference_steps")
    guidance_scale: float | None = sampling_field("guidance_scale")
    guidance_scale_2: float | None = sampling_field("guidance_scale_2")
    max_sequence_length: int | None = sampling_field("max_sequence_length")
    quality: str | None = sampling_field("quality")
    priority: Priority = None
    loras: list[LoraEntry] | None = sampling_field("loras", note=_LORAS_FORM)
    extra: dict[str, Any] | None = sampling_field(
        "extra", note=f"for example {_EXTRA_EXAMPLE} (in a multipart form: that JSON as text)"
    )
    cache: CacheRequest | None = sampling_field("cache", note=_CACHE_NOTE)
    stream: bool | None = Field(
        None,
        description="publish each decoded chunk as a fragmented-MP4 segment (GET /v1/videos/{id}/stream, "
        "WebSocket /v1/realtime/videos); the MP4 is then fragmented: its init segment and the chunks' segments",
    )

    _utf8 = field_validator("*")(utf8_text)
    _loras = field_validator("loras", mode="before")(lora_entries)
    _extra = field_validator("extra", mode="before")(extra_settings)
    _cache = field_validator("cache", mode="before")(cache_field)

    def video_size(self) -> tuple[int | None, int | None]:
        if self.size is None or self.size.strip() == "auto":
            return None, None
        width, height = parse_size(self.size, "'WIDTHxHEIGHT' (for example '832x480')")
        if not (0 < width <= MAX_VIDEO_SIDE and 0 < height <= MAX_VIDEO_SIDE):
            message = f"size {self.size!r} is out of range: each side must be 1..{MAX_VIDEO_SIDE} pixels"
            raise ApiParamError(message, param="size")
        return width, height

    def to_sampling_params(self, video: dict[str, int], default_fps: int) -> SamplingParams:
        """The engine's parameters (raises ApiParamError). `video`: the model's frame rules (engine info)."""
        width, height = self.video_size()
        num_frames = self.num_frames
        if self.seconds is not None:
            if self.num_frames is not None:
                raise ApiParamError("pass either seconds or num_frames, not both", param="seconds")
            fps = self.fps or default_fps
            max_fps = video.get("max_fps", 120)
            if fps > max_fps:
                raise ApiParamError(f"fps must be an integer in [1, {max_fps}], got {fps}", param="fps")
            most, factor = video["max_frames"], video["temporal_factor"]
            bounded = self.seconds * fps <= most + factor  # checked before rounding: 1e308 s never overflows
            num_frames = frames_for_seconds(self.seconds, fps, factor) if bounded else None
            if num_frames is None or num_frames > most:
                message = (
                    f"seconds={self.seconds:g} at {fps} fps is {num_frames or f'over {most}'} frames; this "
                    f"model makes at most {most} frames ({most / fps:g} s at {fps} fps)"
                )
                raise ApiParamError(message, param="seconds")
        return sampling_params(self, height=height, width=width, num_frames=num_frames, video_format="mp4")


VIDEO_ACCEPTED_FIELDS: tuple[str, ...] = tuple(VideoCreateRequest.model_fields)


def frames_for_seconds(seconds: float, fps: int, temporal_factor: int) -> int:
    """The valid frame count (temporal_factor * k + 1) nearest to `seconds * fps`; ties go to the longer
    clip. At least 1 frame. Wan (factor 4) at 16 fps: 4 s -> 65 frames, 5 s -> 81."""
    exact = seconds * fps
    k = math.floor((exact - 1) / temporal_factor + 0.5 + 1e-9)
    return max(k, 0) * temporal_factor + 1


class ImageObject(BaseModel):
    b64_json: str | None = None
    url: str | None = None


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageObject]
    output_format: str
    size: str
    seed: int = Field(description="diffserve extension: the seed of the one generator the n images came from")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "diffserve"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
