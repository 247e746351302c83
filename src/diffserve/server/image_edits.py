"""Reading a `POST /v1/images/edits` body into validated fields and its input images, not decoded yet.

Multipart (as `client.images.edit` sends it): file parts `image` (one) or `image[]` (several) and
`mask`, every other field as text (`strength` too). The mask keeps its alpha channel: OpenAI's masks mark
the area to edit with transparent pixels (`diffserve.masks`). JSON: `image` (a string or a list), or `images: [{"image_url": ...}]`,
and `mask`. Strings must be data URLs, or http(s) URLs with `--allow-url-images`: the server never reads
one of its own files.

Once the engine has reported the served model (`EditModel.served`), a request is held to what that model
can use, before any image is decoded: its body to `ServerArgs.image_body_bytes` of the number of input
images the model takes (so `--max-body-bytes`, as generations, for a model that takes none; 413 at once
from Content-Length, or as a chunked body streams past it), and its images to that number (400 naming
`image`). Before the engine has reported, the bounds are the server-wide ones (MAX_INPUT_IMAGES images
and a mask) and the engine checks the model's. `EditInputs.decode` refuses a count the model cannot take
(after the other fields are validated, so their errors come first), then decodes in request_body.py's
worker pools, never on the event loop.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from PIL import Image
from starlette.requests import Request
from starlette.types import Message

from diffserve.image_inputs import ImageInputLimits
from diffserve.server.args import MAX_INPUT_IMAGES, ServerArgs
from diffserve.server.errors import ApiError
from diffserve.server.model_info import suggested_pipelines
from diffserve.server.request_body import RawImage, check_source, load_input_image, read_body, validate
from diffserve.server.schemas import EDIT_ACCEPTED_FIELDS, ApiParamError, ImageEditRequest

#: Multipart part names of the input images: `image` (one file) and `image[]` (the SDK's list form).
IMAGE_PARTS = ("image", "image[]")


def inline_schema(schema: dict[str, Any]) -> dict[str, Any]:
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
    json_schema = inline_schema(ImageEditRequest.model_json_schema())
    content = {"multipart/form-data": {"schema": form}, "application/json": {"schema": json_schema}}
    return {"requestBody": {"required": True, "content": content}}


EDIT_REQUEST_BODY = _request_body()


class EngineReport(Protocol):
    """What the route reads of the engine client: whether the engine is ready, and its report."""

    @property
    def ready(self) -> bool: ...

    @property
    def engine_info(self) -> Mapping[str, Any]: ...


@dataclass(frozen=True)
class EditModel:
    """What the served model can use of an edit request: `max_images` input images (0: a model that takes
    none) and a body of at most `max_body_bytes`; `pipeline` and `task` name it in errors, which suggest
    `edit_pipelines` (the engine's list of edit models)."""

    pipeline: str
    task: str
    max_images: int
    max_body_bytes: int
    edit_pipelines: str = "an image-edit model"

    @classmethod
    def served(cls, engine: EngineReport, args: ServerArgs) -> EditModel | None:
        """The model the engine reported (`max_input_images` in its info); None before the engine is
        ready, or from an engine whose report lacks it: the server-wide bounds then apply."""
        info = engine.engine_info if engine.ready else {}
        max_images = info.get("max_input_images")
        if not isinstance(max_images, int):
            return None
        pipeline, task = str(info.get("diffusers_pipeline", "this model")), str(info.get("task", ""))
        edit_pipelines = suggested_pipelines(info, "image-edit")
        return cls(pipeline, task, max_images, args.image_body_bytes(max_images), edit_pipelines)

    def count_error(self, count: int) -> ApiParamError | None:
        """The 400 for a request with `count` input images that this model cannot take, else None."""
        if self.max_images == 0:
            return ApiParamError(
                f"{self.pipeline} is a {self.task} model and takes no input image; image edits need an "
                f"edit model ({self.edit_pipelines})",
                param="image",
            )
        if count > self.max_images:
            message = f"{self.pipeline} takes at most {self.max_images} input image(s), got {count}"
            return ApiParamError(message, param="image")
        return None

    def too_large(self, size: str) -> ApiError:
        """The 413 for a body of `size` over `max_body_bytes`."""
        takes = "no input image" if self.max_images == 0 else f"at most {self.max_images} input image(s)"
        flags = "--max-body-bytes" if self.max_images == 0 else "--max-image-bytes and --max-body-bytes"
        message = (
            f"request body of {size} exceeds this server's limit of {self.max_body_bytes} bytes for "
            f"/v1/images/edits: {self.pipeline} takes {takes} ({flags})"
        )
        return ApiError(413, message, code="request_too_large")


@dataclass
class EditInputs:
    """A parsed edit request: its fields, validated, and its (param, raw image) pairs, not decoded yet."""

    body: ImageEditRequest
    images: list[tuple[str, RawImage]]
    mask: tuple[str, RawImage] | None = None
    #: The served model, when known: `decode` refuses images it cannot take before decoding any.
    model: EditModel | None = None

    async def decode(
        self, allow_urls: bool, limits: ImageInputLimits
    ) -> tuple[list[Image.Image], Image.Image | None]:
        """Every image decoded (with `allow_urls`, downloaded), off the event loop: one after another in the bounded worker pools
        (`load_input_image`), once the count is one `model` takes (else its 400, nothing decoded).
        Raises InvalidRequestError, and ApiError 429 when a pool is full."""
        if self.model is not None and (error := self.model.count_error(len(self.images))) is not None:
            raise error
        # Transparency kept: the engine's validation drops it unless the family reads alpha.
        images = [
            await load_input_image(src, name, allow_urls, limits, keep_alpha=True)
            for name, src in self.images
        ]
        mask = None
        if self.mask is not None:  # its alpha is kept: transparent pixels mark the area to edit
            mask = await load_input_image(self.mask[1], self.mask[0], allow_urls, limits, as_mask=True)
        return images, mask


def _held_to(request: Request, model: EditModel) -> Request:
    """`request`, its body refused (413) beyond `model.max_body_bytes`: at once by its Content-Length,
    else once that many bytes have streamed in, before they are all read."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > model.max_body_bytes:
        raise model.too_large(f"{int(length)} bytes")
    received = 0

    async def receive() -> Message:
        nonlocal received
        message = await request.receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > model.max_body_bytes:
                raise model.too_large(f"more than {model.max_body_bytes} bytes")
        return message

    return Request(request.scope, receive)


async def read_edit_request(
    request: Request, max_text_part_bytes: int, model: EditModel | None = None
) -> EditInputs:
    """Parse the body (400/415 if unusable); `max_text_part_bytes` bounds one multipart text part. With
    the served `model`, the body and the image count are held to what it can use (413, 400) first."""
    if model is not None:
        request = _held_to(request, model)
        max_text_part_bytes = min(max_text_part_bytes, model.max_body_bytes)
    body, files = await read_body(
        request, ImageEditRequest, EDIT_ACCEPTED_FIELDS, (*IMAGE_PARTS, "mask"), EDIT_ACCEPTED_FIELDS,
        empty="request body is required: multipart/form-data with 'image' file(s) and 'prompt', or a JSON object",
        send="multipart/form-data (as OpenAI's SDK does) or application/json",
        max_files=MAX_INPUT_IMAGES + 1, max_fields=len(EDIT_ACCEPTED_FIELDS) + MAX_INPUT_IMAGES + 1,
        max_part_size=max_text_part_bytes,
    )  # fmt: skip
    if files is None:
        return _from_body(body, model)
    masks = [src for name, src in files if name == "mask"]
    if len(masks) > 1:
        raise ApiParamError("mask is given more than once; send at most one mask", param="mask")
    if body.images is not None or body.mask is not None:
        raise ApiParamError(
            "in a multipart body, send images as 'image' / 'image[]' parts and the mask as a 'mask' part",
            param="images" if body.images is not None else "mask",
        )
    images = [src for name, src in files if name != "mask"]
    return _checked(body, "image", images, masks[0] if masks else None, model)


def from_json(data: Any, model: EditModel | None = None) -> EditInputs:
    return _from_body(validate(ImageEditRequest, data, EDIT_ACCEPTED_FIELDS), model)


def _from_body(body: ImageEditRequest, model: EditModel | None) -> EditInputs:
    param = "images" if body.images is not None else "image"
    return _checked(body, param, body.image_sources(), body.mask_source(), model)


def _checked(
    body: ImageEditRequest, param: str, images: list[RawImage], mask: RawImage | None, model: EditModel | None
) -> EditInputs:
    """Name the images for errors (`image`, `image[i]`); reject none, more than the server takes, or
    non-data/http(s) URLs. What `model` takes is checked by `EditInputs.decode`, after the fields."""
    named = [(param if len(images) == 1 else f"{param}[{i}]", src) for i, src in enumerate(images)]
    inputs = EditInputs(body, named, None if mask is None else ("mask", mask), model)
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
