"""Per-request sampling parameters, validated before a request is queued."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from diffserve.errors import InvalidRequestError

#: Fields holding images rather than JSON values.
IMAGE_FIELDS = ("input_images", "mask_image")


@dataclass
class SamplingParams:
    """What one generation request asks for. `None` means "use the model family's default"."""

    prompt: str = ""
    negative_prompt: str | None = None
    height: int | None = None
    width: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    true_cfg_scale: float | None = None
    seed: int = 0
    num_outputs_per_prompt: int = 1
    max_sequence_length: int | None = None
    #: Video families only: frames to generate (Wan: 4k + 1), frames per second of the file, and its
    #: container (mp4, gif or webp).
    num_frames: int | None = None
    fps: int | None = None
    video_format: str | None = None
    output_format: str = "png"
    #: "lossless" (exact), "high", "medium", "low" (approximate, faster), "auto" or None (the engine's
    #: default), or OpenAI's "hd" (= lossless) / "standard" (= auto); see `configs/quality.py`.
    quality: str | None = None
    #: Input images for edit / image-to-image families, as decoded RGB `PIL.Image.Image`s. Front ends
    #: turn paths, bytes, data URLs and (opt-in) URLs into images with `diffserve.image_inputs.load_image`
    #: before building the params, so the engine never touches the network or the user's files.
    input_images: list[Any] | None = None
    #: Inpainting mask (a `PIL.Image.Image`); only families that inpaint accept it.
    mask_image: Any | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def with_defaults(self, defaults: SamplingParams) -> SamplingParams:
        """A copy where every `None` field takes the family default's value."""
        values = {}
        for f in fields(self):
            mine = getattr(self, f.name)
            values[f.name] = getattr(defaults, f.name) if mine is None else mine
        return SamplingParams(**values)

    def validate(self, pixel_multiple: int, max_sequence_length_limit: int | None = None) -> None:
        """Raise `InvalidRequestError` with an actionable message for any bad field."""
        if not isinstance(self.prompt, str) or not self.prompt.strip():
            raise InvalidRequestError("prompt must be a non-empty string", param="prompt")
        for name in ("height", "width"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise InvalidRequestError(f"{name} must be a positive integer, got {value!r}", param=name)
            if value % pixel_multiple:
                lower = max(pixel_multiple, value - value % pixel_multiple)
                raise InvalidRequestError(
                    f"{name}={value} is not a multiple of {pixel_multiple} (this model's pixel granularity); "
                    f"try {lower} or {lower + pixel_multiple}",
                    param=name,
                )
        if not isinstance(self.num_inference_steps, int) or self.num_inference_steps < 1:
            raise InvalidRequestError(
                f"num_inference_steps must be >= 1, got {self.num_inference_steps!r}",
                param="num_inference_steps",
            )
        if self.num_outputs_per_prompt < 1:
            raise InvalidRequestError(
                f"num_outputs_per_prompt must be >= 1, got {self.num_outputs_per_prompt}",
                param="num_outputs_per_prompt",
            )
        if self.guidance_scale is not None and self.guidance_scale < 0:
            raise InvalidRequestError(
                f"guidance_scale must be >= 0, got {self.guidance_scale}", param="guidance_scale"
            )
        if self.true_cfg_scale is not None and self.true_cfg_scale < 0:
            raise InvalidRequestError(
                f"true_cfg_scale must be >= 0, got {self.true_cfg_scale}", param="true_cfg_scale"
            )
        if not 0 <= self.seed < 2**63:
            raise InvalidRequestError(f"seed must be in [0, 2**63), got {self.seed}", param="seed")
        if self.max_sequence_length is not None:
            if self.max_sequence_length < 1:
                raise InvalidRequestError(
                    f"max_sequence_length must be >= 1, got {self.max_sequence_length}",
                    param="max_sequence_length",
                )
            if max_sequence_length_limit is not None and self.max_sequence_length > max_sequence_length_limit:
                raise InvalidRequestError(
                    f"max_sequence_length must be <= {max_sequence_length_limit}, got {self.max_sequence_length}",
                    param="max_sequence_length",
                )
        if self.output_format not in ("png", "jpeg", "webp"):
            raise InvalidRequestError(
                f"output_format must be png, jpeg or webp, got {self.output_format!r}", param="output_format"
            )

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly fields (for PNG metadata and logs): input images appear as their sizes."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in IMAGE_FIELDS}
        out["extra"] = dict(self.extra)
        out["input_images"] = (
            None if self.input_images is None else [list(im.size) for im in self.input_images]
        )
        out["mask_image"] = None if self.mask_image is None else list(self.mask_image.size)
        return out
