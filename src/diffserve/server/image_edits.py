"""Reading a `POST /v1/images/edits` body into validated fields and decoded input images.

Two body forms are accepted:

- multipart/form-data, as OpenAI's SDK sends `client.images.edit(...)`: one image is a file part named
  `image`, a list is several parts named `image[]`, the mask is a part named `mask`, and every other
  field (including what the SDK's `extra_body` adds) is a text part. A text part named `image`/`mask`
  holding a data URL (or an allowed URL) also works, for curl users.
- application/json: `image` as a string or a list of strings, or OpenAI's newer
  `images: [{"image_url": "..."}]`, and `mask` as a string or `{"image_url": "..."}`.

Strings must be base64 data URLs, or http(s) URLs when the server runs with `--allow-url-images`;
anything else is refused here, so a client can never make the server read one of its own files.
Decoding goes through `diffserve.image_inputs.load_image` with the server's limits (413 above them).
It is blocking work (and a download with URLs), so the route runs `EditInputs.load` in a thread.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from PIL import Image
from pydantic import ValidationError
from starlette.datastructures import UploadFile
from starlette.requests import Request

from diffserve.image_inputs import ImageInputLimits, load_image
from diffserve.server.args import MAX_INPUT_IMAGES
from diffserve.server.errors import ApiError, validation_error_message
from diffserve.server.schemas import EDIT_ACCEPTED_FIELDS, ApiParamError, ImageEditRequest

#: Multipart part names of the input images: `image` (one file) and `image[]` (the SDK's list form).
IMAGE_PARTS = ("image", "image[]")
_FORM_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")
_STRING_SCHEMES = ("data:", "http://", "https://")

#: (param named in errors, raw source: uploaded bytes or a data/http(s) URL string)
RawImage = tuple[str, bytes | str]


@dataclass
class EditInputs:
    """A parsed edit request: its fields, validated, and its images, not decoded yet."""

    body: ImageEditRequest
    images: list[RawImage]
    mask: RawImage | None = None

    def load(
        self, allow_urls: bool, limits: ImageInputLimits
    ) -> tuple[list[Image.Image], Image.Image | None]:
        """Decode (and, with `allow_urls`, download) every image. Blocking; raises InvalidRequestError,
        or its subclass ImageTooLargeError over `limits`."""
        images = [
            load_image(src, param=param, allow_urls=allow_urls, limits=limits) for param, src in self.images
        ]
        mask = None
        if self.mask is not None:
            param, src = self.mask
            mask = load_image(src, param=param, allow_urls=allow_urls, limits=limits)
        return images, mask


async def read_edit_request(request: Request, max_text_part_bytes: int) -> EditInputs:
    """Parse the body by its Content-Type (400/415 for anything unusable). `max_text_part_bytes` bounds
    one multipart text part, which may hold a data URL."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type in _FORM_TYPES:
        async with request.form(
            max_files=MAX_INPUT_IMAGES + 1,
            max_fields=len(EDIT_ACCEPTED_FIELDS) + MAX_INPUT_IMAGES + 1,
            max_part_size=max_text_part_bytes,
        ) as form:
            return await _from_form(form.multi_items())
    if media_type in ("application/json", ""):
        body = await request.body()
        if not body:
            raise ApiError(
                400,
                "request body is required: multipart/form-data with 'image' file(s) and "
                "'prompt', or a JSON object",
                code="invalid_request",
            )
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"request body is not valid JSON ({exc})", code="invalid_request") from None
        return from_json(data)
    raise ApiError(
        415,
        f"Content-Type {media_type!r} is not supported; send multipart/form-data (as OpenAI's "
        "SDK does) or application/json",
        code="unsupported_media_type",
    )


def validate_fields(fields: Any) -> ImageEditRequest:
    """The request model, or a 400 in the same words as /v1/images/generations' validation errors."""
    try:
        return ImageEditRequest.model_validate(fields)
    except ValidationError as exc:
        message, param = validation_error_message(list(exc.errors()), EDIT_ACCEPTED_FIELDS)
        raise ApiError(
            400, message, param=param, code="invalid_value" if param else "invalid_request"
        ) from None


def from_json(data: Any) -> EditInputs:
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_request")
    body = validate_fields(data)
    sources = body.image_sources()
    param = "images" if body.images is not None else "image"
    images = [(_name(param, i, len(sources)), src) for i, src in enumerate(sources)]
    mask = body.mask_source()
    return _checked(EditInputs(body, images, None if mask is None else ("mask", mask)))


async def _from_form(items: list[tuple[str, str | UploadFile]]) -> EditInputs:
    fields: dict[str, Any] = {}
    raw_images: list[bytes | str] = []
    mask: bytes | str | None = None
    for name, value in items:
        source = await value.read() if isinstance(value, UploadFile) else value
        if name in IMAGE_PARTS:
            raw_images.append(source)
        elif name == "mask":
            if mask is not None:
                raise ApiParamError("mask is given more than once; send at most one mask", param="mask")
            mask = source
        elif name in fields:
            raise ApiParamError(f"{name} is given more than once", param=name)
        elif isinstance(value, UploadFile) and name in EDIT_ACCEPTED_FIELDS:
            raise ApiParamError(f"{name} must be a text field, not a file", param=name)
        else:
            fields[name] = source  # an unknown file part is named by the validation below
    body = validate_fields(fields)
    if body.images is not None or body.mask is not None:
        raise ApiParamError(
            "in a multipart body, send images as 'image' / 'image[]' parts and the mask as a 'mask' part",
            param="images" if body.images is not None else "mask",
        )
    images = [(_name("image", i, len(raw_images)), src) for i, src in enumerate(raw_images)]
    return _checked(EditInputs(body, images, None if mask is None else ("mask", mask)))


def _name(param: str, index: int, count: int) -> str:
    return param if count == 1 else f"{param}[{index}]"


def _checked(inputs: EditInputs) -> EditInputs:
    """Reject what needs no decoding to reject: no image, too many, strings that are not data/http(s) URLs."""
    if not inputs.images:
        raise ApiParamError(
            "image is required: upload the image file(s) as 'image' (or 'image[]'), or in JSON pass 'image' "
            "as a base64 data URL (data:image/png;base64,...)",
            param="image",
        )
    if len(inputs.images) > MAX_INPUT_IMAGES:
        raise ApiParamError(
            f"at most {MAX_INPUT_IMAGES} input images per request, got {len(inputs.images)}", param="image"
        )
    for param, source in [*inputs.images, *([inputs.mask] if inputs.mask else [])]:
        if isinstance(source, str) and not source.strip()[:16].lower().startswith(_STRING_SCHEMES):
            raise ApiParamError(
                f"{param}: expected an uploaded file, a base64 data URL (data:image/png;base64,...) or an "
                "http(s) URL; the server never reads file paths",
                param=param,
            )
    return inputs
