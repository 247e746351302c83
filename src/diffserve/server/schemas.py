"""OpenAI-compatible request and response bodies, and the request -> `SamplingParams` mapping."""

from __future__ import annotations

import re
import secrets
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from diffserve.configs.sampling_params import SamplingParams


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


class ImageGenerationRequest(BaseModel):
    """`POST /v1/images/generations`. OpenAI's fields, then diffserve's extensions; nothing else."""

    model_config = ConfigDict(extra="forbid")

    prompt: str
    model: str | None = Field(None, description="the served model's id or an alias (--served-model-name)")
    n: int | None = Field(1, ge=1, le=10, description="images to generate (1-10), all from one request")
    size: str | None = Field(None, description="'WIDTHxHEIGHT' or 'auto' (the model's default)")
    response_format: Literal["b64_json", "url"] | None = "b64_json"
    output_format: Literal["png", "jpeg", "webp"] | None = "png"
    output_compression: int | None = Field(
        None, ge=0, le=100, description="jpeg/webp quality, 0-100 (default 100)"
    )
    user: str | None = Field(None, description="end-user id; accepted for compatibility, not used")
    stream: bool | None = Field(
        None, description="answer with server-sent events (OpenAI's image_generation.* / image_edit.* events)"
    )
    partial_images: int | None = Field(
        None,
        ge=0,
        le=MAX_PARTIAL_IMAGES,
        description="with stream=true: previews (0-3) sent while the image is made, before the final one",
    )
    quality: str | None = Field(
        None,
        description="'lossless' (exact), 'high', 'medium' or 'low' (approximate: reuse DiT work between steps, "
        "faster, at least 35/30/25 dB PSNR against lossless), 'auto' (the server's --default-quality); OpenAI's "
        "'hd' means lossless and 'standard' auto",
    )
    # OpenAI fields accepted only with a value that changes nothing (see NO_OP_VALUES).
    background: str | None = None
    style: str | None = None
    moderation: str | None = None
    # diffserve extensions (SamplingParams fields); unset: the model's defaults.
    width: int | None = Field(None, gt=0)
    height: int | None = Field(None, gt=0)
    seed: int | None = Field(
        None, ge=0, lt=2**63, description="unset: a random seed, returned in the response"
    )
    negative_prompt: str | None = None
    num_inference_steps: int | None = Field(None, ge=1)
    guidance_scale: float | None = Field(None, ge=0)
    true_cfg_scale: float | None = Field(None, ge=0)
    max_sequence_length: int | None = Field(None, ge=1)
    priority: int | None = Field(
        None,
        ge=-1000,
        le=1000,
        description="scheduling priority (-1000..1000, default 0): the engine admits higher first, equal "
        "priorities first come first served",
    )

    def check_supported(self) -> None:
        for name, allowed in NO_OP_VALUES.items():
            value = getattr(self, name)
            if value is not None and not any(
                value == a and type(value) is type(a) for a in allowed if a is not None
            ):
                accepted = " or ".join(repr(a) for a in allowed if a is not None)
                hint = f"omit it or pass {accepted}" if accepted else "omit it"
                raise ApiParamError(
                    f"{name}={value!r} is not supported yet by diffserve; {hint}",
                    param=name,
                    code="unsupported_value",
                )
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
        match = _SIZE.match(self.size)
        if match is None:
            raise ApiParamError(
                f"size must be 'WIDTHxHEIGHT' (for example '1024x1024') or 'auto', got {self.size!r}",
                param="size",
            )
        width, height = int(match.group(1)), int(match.group(2))
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
        return SamplingParams(
            prompt=self.prompt,
            negative_prompt=self.negative_prompt,
            height=height,
            width=width,
            num_inference_steps=self.num_inference_steps,
            guidance_scale=self.guidance_scale,
            true_cfg_scale=self.true_cfg_scale,
            seed=self.seed if self.seed is not None else secrets.randbelow(2**32),
            num_outputs_per_prompt=self.n or 1,
            max_sequence_length=self.max_sequence_length,
            output_format=self.output_format or "png",
            quality=self.quality,
        )


ACCEPTED_FIELDS: tuple[str, ...] = tuple(ImageGenerationRequest.model_fields)


class ImageReference(BaseModel):
    """One entry of OpenAI's JSON `images: [{"image_url": ...}]` (or `mask: {"image_url": ...}`)."""

    model_config = ConfigDict(extra="forbid")

    image_url: str | None = Field(
        None, description="a base64 data URL, or an http(s) URL with --allow-url-images"
    )
    file_id: str | None = Field(None, description="OpenAI Files API id; not supported by diffserve")

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
    """`POST /v1/images/edits`: the generation fields plus the input images.

    In a JSON body the images are strings (`image`, one or a list) or OpenAI's newer
    `images: [{"image_url": ...}]`; in a multipart body they are uploaded files named `image` or `image[]`
    and `mask`, which the route reads separately and never puts in these fields.

    `to_sampling_params` is the generations' one: the route fills `input_images` and `mask_image` once
    they are decoded. Without `size` (or width/height) the size stays None and the model's family
    derives it from the input image (edit models keep its aspect ratio).
    """

    image: str | list[str] | None = Field(
        None, description="input image(s) as base64 data URLs (or http(s) URLs with --allow-url-images)"
    )
    images: list[ImageReference] | None = Field(None, description="OpenAI's JSON form: [{'image_url': ...}]")
    mask: str | ImageReference | None = Field(
        None, description="inpainting mask; only models that inpaint accept it (none yet)"
    )

    def image_sources(self) -> list[str]:
        """The JSON body's input images in order (raises ApiParamError when both forms are given)."""
        if self.image is not None and self.images is not None:
            raise ApiParamError(
                "pass the input images as either 'image' or 'images', not both", param="images"
            )
        if self.images is not None:
            return [ref.source(f"images[{i}]") for i, ref in enumerate(self.images)]
        if isinstance(self.image, str):
            return [self.image]
        return list(self.image or [])

    def mask_source(self) -> str | None:
        return self.mask.source("mask") if isinstance(self.mask, ImageReference) else self.mask


EDIT_ACCEPTED_FIELDS: tuple[str, ...] = tuple(ImageEditRequest.model_fields)


class ImageObject(BaseModel):
    b64_json: str | None = None
    url: str | None = None


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageObject]
    output_format: str
    size: str
    seed: int = Field(
        description="diffserve extension: the seed used; the n images come from one generator seeded with it"
    )


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
