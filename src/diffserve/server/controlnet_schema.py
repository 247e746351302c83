"""The image routes' `controlnets` field: ControlNets a request applies (`SamplingParams.controlnets`), each
with its control image (and an inpainting ControlNet's mask) as base64 or a data URL, decoded by the route
within the server's image limits (never read from a path or, unless the operator allows URLs, fetched)."""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from diffserve.configs.sampling_params import MAX_CONTROLNET_SCALE, ControlNetChoice
from diffserve.errors import InvalidRequestError
from diffserve.image_inputs import ImageInputLimits, decode_image, read_image_source
from diffserve.masks import pipeline_mask

_EXAMPLE = '[{"name": "canny", "image": "data:image/png;base64,...", "scale": 0.7}]'
CONTROLNETS_NOTE = (
    f"for example {_EXAMPLE} (in a multipart form: that JSON as text); a Union ControlNet also takes "
    '"mode", an inpainting ControlNet a "mask" of the area to repaint (white, or transparent as OpenAI\'s masks; '
    'same forms as "image"), and "start" / "end" limit it to a part of the schedule'
)


class ControlNetEntry(BaseModel):
    """One ControlNet a request applies: a name the server loaded, its control image and, for an inpainting
    ControlNet, its mask."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, description="a ControlNet the server loaded (--controlnet NAME=PATH)")
    image: str = Field(min_length=1, description="the control image: base64 (PNG, JPEG, WebP) or a data URL")
    scale: float = Field(
        1.0, allow_inf_nan=False, description=f"controlnet_conditioning_scale, 0..{MAX_CONTROLNET_SCALE:g}"
    )
    start: float = Field(0.0, allow_inf_nan=False, description="control_guidance_start, 0..1")
    end: float = Field(1.0, allow_inf_nan=False, description="control_guidance_end, 0..1, above start")
    mode: int | None = Field(None, ge=0, description="control_mode of a Union ControlNet (else unset)")
    mask: str | None = Field(
        None,
        min_length=1,
        description="control_mask of an inpainting ControlNet (else unset), as `image` takes it: white (or, "
        "with alpha, transparent) = repaint, black (opaque) = keep",
    )


def controlnet_entries(value: Any) -> Any:
    """A `controlnets` field validator: a multipart form sends the list as JSON text."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f"expected a JSON list such as {_EXAMPLE}") from None
    return value


def _image_bytes(source: str, param: str, allow_urls: bool, limits: ImageInputLimits) -> bytes:
    """A data URL's (or, where allowed, an http(s) URL's) bytes, else the text as plain base64."""
    head = source.lstrip()[:8].lower()
    if head.startswith(("data:", "http://", "https://")):
        return read_image_source(source, param=param, allow_urls=allow_urls, limits=limits)
    if len(source) * 3 // 4 > limits.max_bytes:
        raise InvalidRequestError(f"{param}: the image is over {limits.max_bytes} bytes", param=param)
    try:
        return base64.b64decode(source, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError(
            f"{param}: expected base64 image data or a data URL (data:image/png;base64,...)", param=param
        ) from None


def decode_controlnets(
    entries: list[ControlNetEntry] | None, allow_urls: bool, limits: ImageInputLimits
) -> list[ControlNetChoice]:
    """The entries as the engine's `ControlNetChoice`s, their images and masks decoded (InvalidRequestError
    naming `controlnets[i].image` or `controlnets[i].mask` for one that is not an image or is too large).
    A mask becomes what the pipelines read (`pipeline_mask`) whichever convention it was sent in."""
    choices = []
    for i, entry in enumerate(entries or []):
        param = f"controlnets[{i}].image"
        image = decode_image(_image_bytes(entry.image, param, allow_urls, limits), param=param, limits=limits)
        mask = None
        if entry.mask is not None:
            param = f"controlnets[{i}].mask"
            data = _image_bytes(entry.mask, param, allow_urls, limits)
            mask = pipeline_mask(decode_image(data, param=param, limits=limits, as_mask=True))
        choices.append(
            ControlNetChoice(entry.name, image, entry.scale, entry.start, entry.end, entry.mode, mask)
        )
    return choices
