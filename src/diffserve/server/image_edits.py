"""Reading a `POST /v1/images/edits` body into validated fields and its input images, not decoded yet.

Multipart (as `client.images.edit` sends it): file parts `image` (one) or `image[]` (several) and
`mask`, every other field as text. JSON: `image` (a string or a list), or `images: [{"image_url": ...}]`,
and `mask`. Strings must be data URLs, or http(s) URLs with `--allow-url-images`: the server never reads
one of its own files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from PIL import Image
from starlette.requests import Request

from diffserve.image_inputs import ImageInputLimits, load_image
from diffserve.server.args import MAX_INPUT_IMAGES
from diffserve.server.request_body import RawImage, check_source, read_body, validate
from diffserve.server.schemas import EDIT_ACCEPTED_FIELDS, ApiParamError, ImageEditRequest

#: Multipart part names of the input images: `image` (one file) and `image[]` (the SDK's list form).
IMAGE_PARTS = ("image", "image[]")


def _inline_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A pydantic JSON schema with its `$defs` references inlined (openapi_extra has no components)."""
    defs = schema.pop("$defs", {})

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return walk(defs[node["$ref"].rsplit("/", 1)[-1]])
            return {key: walk(value) for key, value in node.items()}
        return [walk(value) for value in node] if isinstance(node, list) else node

    return walk(schema)


def _request_body() -> dict[str, Any]:
    """The route's `openapi_extra`: it reads its body itself, so /docs gets both forms from here."""
    binary = {"type": "string", "format": "binary"}
    images = {
        "type": "array",
        "items": binary,
        "description": f"1-{MAX_INPUT_IMAGES} image files, as 'image' or 'image[]' parts",
    }
    text = {n: {"type": "string"} for n in EDIT_ACCEPTED_FIELDS if n not in ("image", "images", "mask")}
    properties = {"image": images, "mask": binary, **text}
    form = {"type": "object", "required": ["image", "prompt"], "properties": properties}
    json_schema = _inline_schema(ImageEditRequest.model_json_schema())
    content = {"multipart/form-data": {"schema": form}, "application/json": {"schema": json_schema}}
    return {"requestBody": {"required": True, "content": content}}


EDIT_REQUEST_BODY = _request_body()


@dataclass
class EditInputs:
    """A parsed edit request: its fields, validated, and its (param, raw image) pairs, not decoded yet."""

    body: ImageEditRequest
    images: list[tuple[str, RawImage]]
    mask: tuple[str, RawImage] | None = None

    def load(
        self, allow_urls: bool, limits: ImageInputLimits
    ) -> tuple[list[Image.Image], Image.Image | None]:
        """Decode (with `allow_urls`, download) every image. Blocking; raises InvalidRequestError."""
        sources = [*self.images, *([self.mask] if self.mask else [])]
        loaded = [load_image(src, param=name, allow_urls=allow_urls, limits=limits) for name, src in sources]
        return loaded[: len(self.images)], loaded[-1] if self.mask else None


async def read_edit_request(request: Request, max_text_part_bytes: int) -> EditInputs:
    """Parse the body (400/415 if unusable); `max_text_part_bytes` bounds one multipart text part."""
    body, files = await read_body(
        request, ImageEditRequest, EDIT_ACCEPTED_FIELDS, (*IMAGE_PARTS, "mask"), EDIT_ACCEPTED_FIELDS,
        empty="request body is required: multipart/form-data with 'image' file(s) and 'prompt', or a JSON object",
        send="multipart/form-data (as OpenAI's SDK does) or application/json",
        max_files=MAX_INPUT_IMAGES + 1, max_fields=len(EDIT_ACCEPTED_FIELDS) + MAX_INPUT_IMAGES + 1,
        max_part_size=max_text_part_bytes,
    )  # fmt: skip
    if files is None:
        return _from_body(body)
    masks = [src for name, src in files if name == "mask"]
    if len(masks) > 1:
        raise ApiParamError("mask is given more than once; send at most one mask", param="mask")
    if body.images is not None or body.mask is not None:
        raise ApiParamError(
            "in a multipart body, send images as 'image' / 'image[]' parts and the mask as a 'mask' part",
            param="images" if body.images is not None else "mask",
        )
    images = [src for name, src in files if name != "mask"]
    return _checked(body, "image", images, masks[0] if masks else None)


def from_json(data: Any) -> EditInputs:
    return _from_body(validate(ImageEditRequest, data, EDIT_ACCEPTED_FIELDS))


def _from_body(body: ImageEditRequest) -> EditInputs:
    param = "images" if body.images is not None else "image"
    return _checked(body, param, body.image_sources(), body.mask_source())


def _checked(body: ImageEditRequest, param: str, images: list[RawImage], mask: RawImage | None) -> EditInputs:
    """Name the images for errors (`image`, `image[i]`); reject none, too many, or non-data/http(s) URLs."""
    named = [(param if len(images) == 1 else f"{param}[{i}]", src) for i, src in enumerate(images)]
    inputs = EditInputs(body, named, None if mask is None else ("mask", mask))
    if not named:
        raise ApiParamError(
            "image is required: upload the image file(s) as 'image' (or 'image[]'), or in JSON pass 'image' "
            "as a base64 data URL (data:image/png;base64,...)",
            param="image",
        )
    if len(named) > MAX_INPUT_IMAGES:
        message = f"at most {MAX_INPUT_IMAGES} input images per request, got {len(named)}"
        raise ApiParamError(message, param="image")
    for name, source in [*named, *([inputs.mask] if inputs.mask else [])]:
        check_source(name, source)
    return inputs
