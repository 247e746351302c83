"""Per-request sampling parameters, validated before a request is queued."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from PIL import Image

from diffserve.configs.cache_settings import CACHE_HELP, CacheSettings, cache_from_flag, parse_cache
from diffserve.configs.option import option
from diffserve.configs.quality import ACCEPTED
from diffserve.errors import InvalidRequestError

#: Most LoRA adapters one request may apply, and the range of a LoRA scale.
MAX_LORAS_PER_REQUEST = 8
MAX_LORA_SCALE = 100.0
#: Most ControlNet entries one request may list, and the range of a ControlNet conditioning scale.
MAX_CONTROLNETS_PER_REQUEST = 4
MAX_CONTROLNET_SCALE = 10.0
#: Fields holding images rather than JSON values (`controlnets` holds some in its entries).
IMAGE_FIELDS = ("input_images", "mask_image", "controlnets", "input_video")
#: Longest prompt or negative prompt, in characters. Text encoders truncate to a few hundred tokens, so
#: a longer text changes nothing but the memory it holds (queues, the prompt cache, logs).
MAX_PROMPT_CHARS = 10_000
#: The largest image side accepted (pixels): a bound on what a client can make the engine plan for; far
#: above what any served model makes (FLUX and Qwen-Image are trained up to about 2048).
MAX_IMAGE_SIDE = 16_384
#: Text fields: each must be encodable as UTF-8 (a lone surrogate such as "\ud800" is not).
TEXT_FIELDS = ("prompt", "negative_prompt", "output_format", "video_format", "quality")
#: Skip-layer guidance (SD3.5, Diffusers' `StableDiffusion3Pipeline`): only families that declare it accept
#: these; the others refuse a request that sets one (`stages/input_validation.py`).
SKIP_LAYER_GUIDANCE_FIELDS = (
    "skip_guidance_layers",
    "skip_layer_guidance_scale",
    "skip_layer_guidance_start",
    "skip_layer_guidance_stop",
)
#: Most DiT blocks one request may skip (SD3.5-large has 38; Stability recommends 7, 8, 9).
MAX_SKIP_GUIDANCE_LAYERS = 64
#: Largest skip-layer guidance scale accepted (Diffusers' default is 2.8).
MAX_SKIP_LAYER_GUIDANCE_SCALE = 100.0


def check_text(name: str, value: str) -> None:
    """Raise InvalidRequestError naming `name` unless `value` can be encoded as UTF-8."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"{name} is not valid Unicode text: it holds a lone surrogate ({value[exc.start]!r}) at character "
            f"{exc.start}; send UTF-8 text",
            param=name,
        ) from None


def extra_from_flag(text: str, flag: str) -> dict[str, Any]:
    """`--extra`'s convert: a JSON object of the family's settings (`SamplingParams.extra`), which the family
    checks; InvalidRequestError naming the flag for text that is not one."""
    import json

    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise InvalidRequestError(f"{flag} must be a JSON object of settings: {exc}", param="extra") from None
    if not isinstance(value, dict):
        raise InvalidRequestError(
            f"{flag} must be a JSON object of settings (for example '{{\"overlap_history\": 17}}'), got "
            f"{type(value).__name__}",
            param="extra",
        )
    return value


@dataclass(frozen=True)
class LoraChoice:
    """One LoRA adapter a request applies, by name (loaded, or a file inside `--lora-dir`), at `scale`
    (1.0: as trained; 0 turns it off; negative values subtract it)."""

    name: str
    scale: float = 1.0


def lora_choices(value: object) -> list[LoraChoice]:
    """Python callers' spellings of `loras`: a list of {"name", "scale"} dicts, `LoraChoice`s, names, or
    (name, scale) pairs. InvalidRequestError (param "loras") for anything else."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise InvalidRequestError(
            'loras must be a list such as [{"name": "style", "scale": 0.8}]', param="loras"
        )
    choices = []
    for entry in value:
        if isinstance(entry, LoraChoice):
            choices.append(entry)
        elif isinstance(entry, str):
            choices.append(LoraChoice(entry))
        elif isinstance(entry, dict) and set(entry) <= {"name", "scale"} and "name" in entry:
            choices.append(LoraChoice(entry["name"], entry.get("scale", 1.0)))
        elif isinstance(entry, (list, tuple)) and len(entry) == 2:
            choices.append(LoraChoice(*entry))
        else:
            raise InvalidRequestError(
                f'loras entries are {{"name": str, "scale": float}}, got {entry!r}', param="loras"
            )
    check_loras(choices)
    return choices


def check_loras(loras: object) -> None:
    """Raise InvalidRequestError (param "loras") unless `loras` is a list of `LoraChoice`s with distinct
    names, at most MAX_LORAS_PER_REQUEST, each scale finite within +-MAX_LORA_SCALE. Whether the names
    exist is the engine's check (`runtime/lora_registry.py`)."""
    if not isinstance(loras, (list, tuple)) or not all(isinstance(c, LoraChoice) for c in loras):
        raise InvalidRequestError("loras must be a list of {name, scale} entries", param="loras")
    if len(loras) > MAX_LORAS_PER_REQUEST:
        raise InvalidRequestError(
            f"loras lists {len(loras)} adapters; at most {MAX_LORAS_PER_REQUEST} are allowed", param="loras"
        )
    names = [c.name for c in loras]
    for choice in loras:
        if not isinstance(choice.name, str) or not choice.name:
            raise InvalidRequestError("every loras entry needs a non-empty name", param="loras")
        scale = choice.scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise InvalidRequestError(f"loras[{choice.name!r}].scale must be a finite number", param="loras")
        if abs(scale) > MAX_LORA_SCALE:
            raise InvalidRequestError(
                f"loras[{choice.name!r}].scale must be within +-{MAX_LORA_SCALE:g}, got {scale}",
                param="loras",
            )
    if len(set(names)) != len(names):
        raise InvalidRequestError("loras names a LoRA twice; list each adapter once", param="loras")


@dataclass(frozen=True)
class ControlNetChoice:
    """One ControlNet a request applies (Diffusers' `FluxControlNetPipeline` keywords in brackets): a loaded
    ControlNet by `name` (`--controlnet NAME=PATH`; "default" for a pipeline folder's own), its control
    `image` (an RGB PIL image, resized to the output size), `scale` (`controlnet_conditioning_scale`), the
    fractions of the schedule it acts between, `start` and `end` (`control_guidance_start` / `_end`), a
    Union ControlNet's control `mode` (`control_mode`), and an inpainting ControlNet's `mask` (`control_mask`
    of Diffusers' ControlNet inpainting pipelines: a PIL image, white = repaint, black = keep, or OpenAI's
    convention, transparent = repaint; resized to the output size)."""

    name: str
    image: Any = None
    scale: float = 1.0
    start: float = 0.0
    end: float = 1.0
    mode: int | None = None
    mask: Any = None


_CONTROLNET_KEYS = frozenset(f.name for f in fields(ControlNetChoice))


def controlnet_choices(value: object) -> list[ControlNetChoice]:
    """Python callers' spellings of `controlnets`: a list of `ControlNetChoice`s or of dicts with its
    fields. InvalidRequestError (param "controlnets") for anything else; the values are checked by
    `check_controlnets`."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise InvalidRequestError(
            'controlnets must be a list such as [{"name": "canny", "image": <image>, "scale": 0.7}]',
            param="controlnets",
        )
    choices = []
    for entry in value:
        if isinstance(entry, ControlNetChoice):
            choices.append(entry)
        elif isinstance(entry, dict) and set(entry) <= _CONTROLNET_KEYS and "name" in entry:
            choices.append(ControlNetChoice(**entry))
        else:
            raise InvalidRequestError(
                f"controlnets entries are {{name, image, scale, start, end, mode}}, got {entry!r}",
                param="controlnets",
            )
    return choices


def _is_number(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def check_controlnets(entries: object) -> None:
    """The model-free checks of `controlnets` (InvalidRequestError naming the entry's field): a list of at
    most MAX_CONTROLNETS_PER_REQUEST `ControlNetChoice`s, each with a name, a PIL image, a finite scale in
    [0, MAX_CONTROLNET_SCALE], 0 <= start < end <= 1, a mode that is None or an integer >= 0 and a mask
    that is None or a PIL image. Whether the name is loaded and takes a mode or a mask is the pipeline's
    check."""
    param = "controlnets"
    if not isinstance(entries, (list, tuple)) or not all(isinstance(c, ControlNetChoice) for c in entries):
        raise InvalidRequestError(
            "controlnets must be a list of {name, image, scale, ...} entries", param=param
        )
    if len(entries) > MAX_CONTROLNETS_PER_REQUEST:
        raise InvalidRequestError(
            f"controlnets lists {len(entries)} entries; at most {MAX_CONTROLNETS_PER_REQUEST} are allowed",
            param=param,
        )
    for i, entry in enumerate(entries):
        where = f"controlnets[{i}]"
        if not isinstance(entry.name, str) or not entry.name:
            raise InvalidRequestError(f"{where}.name must be a non-empty string", param=param)
        if entry.image is None:
            raise InvalidRequestError(
                f"{where}.image is missing: a ControlNet needs its control image", param=param
            )
        if not (hasattr(entry.image, "size") and hasattr(entry.image, "convert")):
            raise InvalidRequestError(
                f"{where}.image must be a decoded image (PIL), got {type(entry.image).__name__}", param=param
            )
        if not _is_number(entry.scale) or not 0 <= entry.scale <= MAX_CONTROLNET_SCALE:
            raise InvalidRequestError(
                f"{where}.scale (controlnet_conditioning_scale) must be a number in [0, "
                f"{MAX_CONTROLNET_SCALE:g}], got {entry.scale!r}",
                param=param,
            )
        for name in ("start", "end"):
            value = getattr(entry, name)
            if not _is_number(value) or not 0 <= value <= 1:
                raise InvalidRequestError(
                    f"{where}.{name} (control_guidance_{name}) must be a number in [0, 1], got {value!r}",
                    param=param,
                )
        if not entry.start < entry.end:
            raise InvalidRequestError(
                f"{where}.start ({entry.start:g}) must be below its end ({entry.end:g})", param=param
            )
        mode = entry.mode
        if mode is not None and (isinstance(mode, bool) or not isinstance(mode, int) or mode < 0):
            raise InvalidRequestError(
                f"{where}.mode (control_mode) must be an integer >= 0 or null, got {mode!r}", param=param
            )
        if entry.mask is not None and not (hasattr(entry.mask, "size") and hasattr(entry.mask, "convert")):
            raise InvalidRequestError(
                f"{where}.mask (control_mask) must be a decoded image (PIL), got {type(entry.mask).__name__}",
                param=param,
            )


def check_skip_layer_guidance(params: SamplingParams) -> None:
    """The model-free checks of the skip-layer guidance fields (a field left None passes): distinct
    non-negative block indices, a finite scale in [0, MAX_SKIP_LAYER_GUIDANCE_SCALE], start and stop in
    [0, 1] with start < stop. The block count is the family's check (`SkipLayerGuidanceRule`)."""
    layers = params.skip_guidance_layers
    if layers is not None:
        name = "skip_guidance_layers"
        if not isinstance(layers, (list, tuple)) or not layers:
            raise InvalidRequestError(
                f"{name} must be a non-empty list of DiT block indices such as [7, 8, 9] (omit it to turn "
                f"skip-layer guidance off), got {layers!r}",
                param=name,
            )
        if any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in layers):
            raise InvalidRequestError(f"{name} must hold integers >= 0, got {list(layers)!r}", param=name)
        if len(set(layers)) != len(layers):
            raise InvalidRequestError(f"{name} lists a block twice: {list(layers)!r}", param=name)
        if len(layers) > MAX_SKIP_GUIDANCE_LAYERS:
            raise InvalidRequestError(
                f"{name} lists {len(layers)} blocks; at most {MAX_SKIP_GUIDANCE_LAYERS} are allowed",
                param=name,
            )
    bounds = {
        "skip_layer_guidance_scale": (0.0, MAX_SKIP_LAYER_GUIDANCE_SCALE),
        "skip_layer_guidance_start": (0.0, 1.0),
        "skip_layer_guidance_stop": (0.0, 1.0),
    }
    for name, (low, high) in bounds.items():
        value = getattr(params, name)
        if value is None:
            continue
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or not low <= value <= high
        ):
            raise InvalidRequestError(
                f"{name} must be a number in [{low:g}, {high:g}], got {value!r}", param=name
            )
    start, stop = params.skip_layer_guidance_start, params.skip_layer_guidance_stop
    if start is not None and stop is not None and not start < stop:
        raise InvalidRequestError(
            f"skip_layer_guidance_start ({start:g}) must be below skip_layer_guidance_stop ({stop:g}): they "
            "are the fractions of the schedule between which the skipped-block guidance runs",
            param="skip_layer_guidance_start",
        )


def check_strength(strength: object) -> None:
    """InvalidRequestError (param "strength") unless `strength` is None or a finite number in [0, 1]."""
    if strength is not None and (
        isinstance(strength, bool)
        or not isinstance(strength, (int, float))
        or not math.isfinite(strength)
        or not 0 <= strength <= 1
    ):
        raise InvalidRequestError(f"strength must be a number in [0, 1], got {strength!r}", param="strength")


def _image_side(side: str) -> int | None:
    """The option of the image's `side` ("height" or "width") in pixels, `--height` / `--width`."""
    return option(
        None,
        cli=f"--{side}",
        min=1,
        max=MAX_IMAGE_SIDE,
        http=True,
        help=f"image {side} in pixels (unset: the model's default)",
    )


@dataclass
class SamplingParams:
    """What one generation request asks for. `None` means "use the model family's default". Each field is
    declared once (`configs/option.py`): `generate`'s flags, the HTTP request fields (`http=True`: bounds
    and descriptions) and `DiffGenerator.generate`'s keywords are made from these declarations; the checks
    of `check_values` are the model-free ones, with the messages naming the field."""

    #: Required at the front ends (`generate`: --prompt or --prompt-file).
    prompt: str = option("", cli="--prompt", front_end_default=None, http=True, help="text prompt")
    negative_prompt: str | None = option(
        None, cli="--negative-prompt", http=True, help="negative prompt (used with true_cfg_scale > 1)"
    )
    height: int | None = _image_side("height")
    width: int | None = _image_side("width")
    num_inference_steps: int | None = option(
        None, cli="--num-inference-steps", min=1, http=True,
        help="denoising steps (unset: the model's default; at most the server's --max-inference-steps)",
    )  # fmt: skip
    guidance_scale: float | None = option(
        None, cli="--guidance-scale", min=0, http=True,
        help="guidance scale, a finite number >= 0 (FLUX.1-dev's embedded guidance: 3.5; 7.0 with an input image or a ControlNet)",
    )  # fmt: skip
    true_cfg_scale: float | None = option(
        None, cli="--true-cfg-scale", min=0, http=True,
        help="true CFG scale, a finite number >= 0; > 1 with a negative prompt",
    )  # fmt: skip
    guidance_scale_2: float | None = option(
        None, cli="--guidance-scale-2", min=0, http=True,
        help="Wan 2.2 A14B: the low-noise expert's CFG scale (default: guidance_scale); other models refuse it",
    )  # fmt: skip
    #: 0 by default here, so that Python callers get reproducible results without asking; the CLI
    #: (`diffserve generate`) and the server draw a random seed when none is given and report it.
    seed: int = option(
        0, cli="--seed", min=0, lt=2**63, front_end_default=None, http=True,
        help="noise seed: same seed, same image on every device (unset: a random one, logged, saved in the "
        "output's metadata and returned)",
    )  # fmt: skip
    num_outputs_per_prompt: int = option(1, cli="--num-outputs-per-prompt", min=1, help="images per prompt")
    max_sequence_length: int | None = option(
        None, cli="--max-sequence-length", min=1, http=True, help="text encoder tokens (FLUX: at most 512)"
    )
    num_frames: int | None = option(
        None, cli="--num-frames", min=1, http=True, help="video models: frames (Wan: 4k+1, default 81)"
    )
    fps: int | None = option(
        None, cli="--fps", min=1, http=True, help="video models: frames per second of the file (Wan: 16)"
    )
    video_format: str | None = option(
        None, cli="--video-format", choices=("mp4", "gif", "webp"), help="video container (mp4)"
    )
    output_format: str = option("png", choices=("png", "jpeg", "webp"), http=True, help="image file format")
    #: Resolved to the canonical tier, see `configs/quality.py`.
    quality: str | None = option(
        None, cli="--quality", choices=ACCEPTED, http=True,
        help="'high' (exact; also 'hd' and 'lossless'), 'medium', 'low' or 'draft' (approximate: reuse DiT "
        "work between steps, faster, at least 35/30/25 dB PSNR against the exact output), 'auto' or "
        "'standard' (unset: the engine's --default-quality). Responses report the tier that ran",
    )  # fmt: skip
    #: A cache accelerator by name with its settings (`configs/cache_settings.py`); given as a mapping or
    #: text, it is stored as the method's typed settings. Not with an approximate `quality`.
    cache: CacheSettings | None = option(
        None, cli="--cache", convert=cache_from_flag, http=True, metavar="METHOD[:KEY=VALUE,...]|JSON",
        help=CACHE_HELP,
    )  # fmt: skip
    #: Front ends turn paths, bytes, data URLs and (opt-in) URLs into images with
    #: `diffserve.image_inputs.load_image` before building the params, so the engine never touches the
    #: network or the user's files (their own spellings: `--image`, `image`/`images`, `image=`).
    input_images: list[Any] | None = option(
        None, help="input images of edit and image-to-image families, as decoded RGB PIL images"
    )
    #: Either convention of `diffserve.masks`: transparent pixels (alpha 0) mark the area to edit
    #: (OpenAI's), or, without alpha, white = edit and black = keep (Diffusers').
    mask_image: Any | None = option(
        None,
        help="inpainting mask (a PIL image of the input image's size); only families that inpaint take it",
    )
    #: Front ends decode the input video with `diffserve.video_inputs.load_video` (bounded: frames, pixels,
    #: bytes) before building the params, as the input images (their own spellings: `--video PATH`, the
    #: `video` file or data URL of POST /v1/videos, `generate(video=...)`). The families that extend a video
    #: read it (`InputValidationStage.takes_input_video`), every other one refuses it.
    input_video: list[Image.Image] | None = option(
        None,
        help="video-to-video families (SkyReels-V2 diffusion forcing's video extension): the input video's "
        "frames, as decoded RGB PIL images in order",
    )
    #: The schedule keeps its last `int(num_inference_steps * strength)` steps, as Diffusers' `get_timesteps`.
    strength: float | None = option(
        None, cli="--strength", min=0, max=1, http=True,
        help="image-to-image / inpainting: how far the input image is noised, 0..1 (1: pure noise); unset: "
        "the model's default (FLUX, SD3: 0.6; FLUX.1 Fill: 1.0)",
    )  # fmt: skip
    #: Skip-layer guidance (SD3.5): the blocks skipped in an extra forward of the prompt's branch, whose
    #: difference from the prompt's full prediction is added, times `skip_layer_guidance_scale`, at the
    #: steps whose fraction of the schedule lies strictly between start and stop (Diffusers' semantics).
    skip_guidance_layers: list[int] | None = option(
        None, cli="--skip-guidance-layers", min=0, min_items=1, max_items=MAX_SKIP_GUIDANCE_LAYERS,
        metavar="BLOCK", http=True,
        help="SD3.5 skip-layer guidance: DiT block indices (distinct, within the model's block count) skipped "
        "in an extra forward of the prompt's branch, for example 7 8 9; needs CFG; unset: off",
    )  # fmt: skip
    skip_layer_guidance_scale: float | None = option(
        None, cli="--skip-layer-guidance-scale", min=0, max=MAX_SKIP_LAYER_GUIDANCE_SCALE, http=True,
        help="skip-layer guidance scale (SD3.5's default: 2.8)",
    )  # fmt: skip
    skip_layer_guidance_start: float | None = option(
        None, cli="--skip-layer-guidance-start", min=0, max=1, http=True,
        help="fraction of the schedule after which skip-layer guidance starts, 0..1 (0.01)",
    )  # fmt: skip
    skip_layer_guidance_stop: float | None = option(
        None, cli="--skip-layer-guidance-stop", min=0, max=1, http=True,
        help="fraction of the schedule before which skip-layer guidance stops, 0..1 (0.2)",
    )  # fmt: skip
    #: Empty: the base model, bit for bit. `generate`'s `--lora` is the engine's (`EngineArgs.loras`).
    loras: list[LoraChoice] = option(
        default_factory=list, front_end_default=None, http=True,
        help=f"LoRA adapters to apply, at most {MAX_LORAS_PER_REQUEST}, each a name and a scale (1.0: as "
        f"trained; 0: off; negative: subtracted; within +-{MAX_LORA_SCALE:g}); unset: the base model",
    )  # fmt: skip
    #: Empty: no ControlNet. Each entry names one the engine loaded (`EngineArgs.controlnets`).
    controlnets: list[ControlNetChoice] = option(
        default_factory=list, front_end_default=None, max_items=MAX_CONTROLNETS_PER_REQUEST, http=True,
        help=f"ControlNets to apply (FLUX.1), at most {MAX_CONTROLNETS_PER_REQUEST}: each a loaded ControlNet's "
        "name, its control image, a scale (controlnet_conditioning_scale), start and end fractions of the "
        "schedule (control_guidance_start / _end) and a Union ControlNet's mode (control_mode)",
    )  # fmt: skip
    extra: dict[str, Any] = option(
        default_factory=dict, front_end_default=None, http=True, cli="--extra", convert=extra_from_flag,
        commands=("generate",), metavar="JSON",
        help="the model family's own settings by name, checked by the family (LTX-2: audio_guidance_scale, "
        "stg_scale, modality_scale, guidance_rescale, motion_speed, ...; SANA, SANA-Sprint, SANA-Video: use_resolution_binning; "
        "LongCat-Image: enable_cfg_renorm, cfg_renorm_min; Z-Image: cfg_truncation, cfg_normalization; Qwen-Image-Layered: layers, resolution, cfg_normalize; Qwen-Image 2.1: output_resolution; "
        "SkyReels-V2 diffusion forcing: ar_step, causal_block_size, base_num_frames, overlap_history, addnoise_condition; "
        "HunyuanImage 2.1 (distilled): distilled_guidance_scale; HunyuanVideo image-to-video: image_embed_interleave; "
        "other families take none)",
    )  # fmt: skip

    def __post_init__(self) -> None:
        # Python callers and the HTTP body give `cache` as a mapping or text: kept as typed settings.
        if self.cache is not None and not isinstance(self.cache, CacheSettings):
            self.cache = parse_cache(self.cache)

    def with_defaults(self, defaults: SamplingParams) -> SamplingParams:
        """A copy where every `None` field takes the family default's value."""
        values = {}
        for f in fields(self):
            mine = getattr(self, f.name)
            values[f.name] = getattr(defaults, f.name) if mine is None else mine
        return SamplingParams(**values)

    def check_values(self) -> None:
        """The checks that need no model (a field left `None` passes): text, signs, finiteness, formats.
        Front ends run it before loading a model; `validate` runs it again on the resolved values."""
        if not isinstance(self.prompt, str) or not self.prompt.strip():
            raise InvalidRequestError("prompt must be a non-empty string", param="prompt")
        for name in TEXT_FIELDS:
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise InvalidRequestError(f"{name} must be a string, got {type(value).__name__}", param=name)
            if value is not None:
                check_text(name, value)
        for name in ("prompt", "negative_prompt"):
            value = getattr(self, name)
            if value is not None and len(value) > MAX_PROMPT_CHARS:
                raise InvalidRequestError(
                    f"{name} is {len(value)} characters long; at most {MAX_PROMPT_CHARS} are accepted (the text "
                    "encoder reads only its first few hundred tokens)",
                    param=name,
                )
        check_loras(self.loras)
        check_controlnets(self.controlnets)
        if self.cache is not None:
            parse_cache(self.cache)  # checks the settings' values (InvalidRequestError naming cache)
        for key, value in self.extra.items():
            for text in (key, value):
                if isinstance(text, str):
                    check_text("extra", text)
        for name in ("height", "width", "num_frames", "fps"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise InvalidRequestError(f"{name} must be a positive integer, got {value!r}", param=name)
            if name in ("height", "width") and value is not None and value > MAX_IMAGE_SIDE:
                raise InvalidRequestError(f"{name} must be at most {MAX_IMAGE_SIDE}, got {value}", param=name)
        steps = self.num_inference_steps
        if steps is not None and (not isinstance(steps, int) or steps < 1):
            raise InvalidRequestError(
                f"num_inference_steps must be >= 1, got {steps!r}", param="num_inference_steps"
            )
        if not isinstance(self.num_outputs_per_prompt, int) or self.num_outputs_per_prompt < 1:
            raise InvalidRequestError(
                f"num_outputs_per_prompt must be >= 1, got {self.num_outputs_per_prompt!r}",
                param="num_outputs_per_prompt",
            )
        for name in ("guidance_scale", "true_cfg_scale", "guidance_scale_2"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise InvalidRequestError(f"{name} must be a finite number >= 0, got {value!r}", param=name)
        check_skip_layer_guidance(self)
        check_strength(self.strength)
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise InvalidRequestError(
                f"seed must be an integer in [0, 2**63), got {self.seed!r}", param="seed"
            )
        if self.max_sequence_length is not None and self.max_sequence_length < 1:
            raise InvalidRequestError(
                f"max_sequence_length must be >= 1, got {self.max_sequence_length}",
                param="max_sequence_length",
            )
        if self.output_format not in ("png", "jpeg", "webp"):
            raise InvalidRequestError(
                f"output_format must be png, jpeg or webp, got {self.output_format!r}", param="output_format"
            )

    def validate(self, pixel_multiple: int, max_sequence_length_limit: int | None = None) -> None:
        """Raise `InvalidRequestError` with an actionable message for any bad field."""
        self.check_values()
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
        if not isinstance(self.num_inference_steps, int):
            raise InvalidRequestError(
                f"num_inference_steps must be >= 1, got {self.num_inference_steps!r}",
                param="num_inference_steps",
            )
        limit = max_sequence_length_limit
        if self.max_sequence_length is not None and limit is not None and self.max_sequence_length > limit:
            raise InvalidRequestError(
                f"max_sequence_length must be <= {limit}, got {self.max_sequence_length}",
                param="max_sequence_length",
            )

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly fields (for PNG metadata and logs): input images appear as their sizes."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in IMAGE_FIELDS}
        out["extra"] = dict(self.extra)
        out["cache"] = None if self.cache is None else self.cache.to_dict()
        out["loras"] = [{"name": c.name, "scale": c.scale} for c in self.loras]
        out["input_images"] = (
            None if self.input_images is None else [list(im.size) for im in self.input_images]
        )
        out["mask_image"] = None if self.mask_image is None else list(self.mask_image.size)
        out["input_video"] = None if self.input_video is None else {"frames": len(self.input_video)}
        out["controlnets"] = [
            {"name": c.name, "image": None if c.image is None else list(c.image.size), "scale": c.scale,
             "start": c.start, "end": c.end, "mode": c.mode, "mask": None if c.mask is None else list(c.mask.size)}
            for c in self.controlnets
        ]  # fmt: skip
        return out
