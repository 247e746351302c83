"""The ComfyUI nodes: each turns its inputs into one request to a running diffserve server and its answer
into ComfyUI values (IMAGE: float32 B x H x W x 3 in 0..1).

Widgets cannot be unset, so "the model's default" is a sentinel: 0 for sizes, steps, frames and fps, -1
for guidance and strength, "auto" for quality, "" for texts; such inputs are left out of the request and
the server applies the served model's defaults.
"""

from __future__ import annotations

import json

import torch

from .client import DiffserveClient, UploadFile
from .comfy_hooks import interrupt_check, progress_reporter
from .images import decode_b64_images, image_data_url, image_png, mask_data_url, mask_png, masks_for, stack
from .loras import LoraList, check_served, parse_selection, served_loras
from .video import decode_mp4, load_av, run_video_job

CATEGORY = "diffserve"
DEFAULT_SERVER_URL = "http://127.0.0.1:30000"
#: The type of the LoRA selection passed from DiffserveLoras to the other nodes.
LORAS_TYPE = "DIFFSERVE_LORAS"
#: The type of the ControlNet list passed from DiffserveControlNet to the image nodes (the `controlnets`
#: request field: {name, image (a PNG data URL), scale, start, end, mode?, mask?} entries).
CONTROLNETS_TYPE = "DIFFSERVE_CONTROLNETS"
MAX_CONTROLNET_SCALE = 10.0  # the server's bound
QUALITIES = ["auto", "high", "medium", "low", "draft"]
MAX_SEED = 2**63 - 1  # the server's bound
MAX_SIDE = 4096
#: The image routes answer with lossless PNGs inline (`b64_json`), decoded without a second request.
IMAGE_OUTPUT = {"response_format": "b64_json", "output_format": "png"}


def _server_input() -> dict:
    tip = "the diffserve server, e.g. http://127.0.0.1:30000 (a trailing /v1 is fine)"
    return {"server_url": ("STRING", {"default": DEFAULT_SERVER_URL, "tooltip": tip})}


def _connection_inputs(timeout_s: int) -> dict:
    return {
        "api_key": ("STRING", {"default": "", "tooltip": "empty: $DIFFSERVE_API_KEY if set, else none"}),
        "model": ("STRING", {"default": "", "tooltip": "served model name; empty: the server's model"}),
        "timeout_s": ("INT", {"default": timeout_s, "min": 1, "max": 86400, "tooltip": "seconds to wait"}),
    }


def _prompt_inputs() -> dict:
    return {
        "prompt": ("STRING", {"multiline": True, "default": ""}),
        "negative_prompt": ("STRING", {"multiline": True, "default": "", "tooltip": "empty: none"}),
    }


def _size_inputs() -> dict:
    tip = "pixels; 0: the model's default"
    return {
        "width": ("INT", {"default": 0, "min": 0, "max": MAX_SIDE, "step": 8, "tooltip": tip}),
        "height": ("INT", {"default": 0, "min": 0, "max": MAX_SIDE, "step": 8, "tooltip": tip}),
    }


def _sampling_inputs() -> dict:
    return {
        "steps": ("INT", {"default": 0, "min": 0, "max": 10000, "tooltip": "0: the model's default"}),
        "guidance": (
            "FLOAT",
            {"default": -1.0, "min": -1.0, "max": 100.0, "step": 0.1, "tooltip": "-1: the model's default"},
        ),
        "seed": ("INT", {"default": 0, "min": 0, "max": MAX_SEED}),
    }


def _quality_input() -> dict:
    tip = "high: exact; medium/low/draft: faster approximations; auto: the server's --default-quality"
    return {"quality": (QUALITIES, {"default": "auto", "tooltip": tip})}


def _batch_input() -> dict:
    return {"n": ("INT", {"default": 1, "min": 1, "max": 10, "tooltip": "images per request"})}


def _loras_input() -> dict:
    return {"loras": (LORAS_TYPE, {"tooltip": "from a diffserve LoRAs node"})}


def _controlnets_input() -> dict:
    return {"controlnets": (CONTROLNETS_TYPE, {"tooltip": "from a diffserve ControlNet node"})}


def request_fields(
    prompt: str,
    negative_prompt: str,
    steps: int,
    guidance: float,
    seed: int,
    quality: str,
    model: str,
    loras: LoraList | None,
) -> dict:
    """The request fields the three generating nodes share, sentinels left out."""
    body: dict = {"prompt": prompt, "seed": seed}
    if negative_prompt.strip():
        body["negative_prompt"] = negative_prompt
    if steps > 0:
        body["num_inference_steps"] = steps
    if guidance >= 0:
        body["guidance_scale"] = guidance
    if quality != "auto":
        body["quality"] = quality
    if model.strip():
        body["model"] = model.strip()
    if loras:
        body["loras"] = loras
    return body


def image_size_fields(width: int, height: int) -> dict:
    """`width` / `height` for the image routes (each 0: the model's default)."""
    return {name: value for name, value in (("width", width), ("height", height)) if value > 0}


def form_fields(body: dict) -> dict[str, str]:
    """JSON request fields as multipart text parts (lists as JSON text, as the server reads them)."""
    return {
        name: json.dumps(value) if isinstance(value, list) else str(value) for name, value in body.items()
    }


class DiffserveGenerate:
    """Text to image: `POST /v1/images/generations`."""

    CATEGORY = CATEGORY
    FUNCTION = "generate"
    RETURN_TYPES = ("IMAGE",)
    RETURN_NAMES = ("images",)
    DESCRIPTION = "Generate images on a diffserve server (POST /v1/images/generations)."

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        return {
            "required": {
                **_server_input(),
                **_prompt_inputs(),
                **_size_inputs(),
                **_sampling_inputs(),
                **_batch_input(),
                **_quality_input(),
            },
            "optional": {**_connection_inputs(600), **_loras_input(), **_controlnets_input()},
        }

    def generate(
        self, server_url: str, prompt: str, negative_prompt: str, width: int, height: int, steps: int,
        guidance: float, seed: int, n: int, quality: str, api_key: str = "", model: str = "",
        timeout_s: int = 600, loras: LoraList | None = None, controlnets: list[dict] | None = None,
    ) -> tuple[torch.Tensor]:  # fmt: skip
        client = DiffserveClient(server_url, api_key, timeout_s)
        body = request_fields(prompt, negative_prompt, steps, guidance, seed, quality, model, loras)
        body |= image_size_fields(width, height) | {"n": n, **IMAGE_OUTPUT}
        if controlnets:
            body["controlnets"] = controlnets
        answer = client.post_json("/v1/images/generations", body)
        return (stack(decode_b64_images(answer["data"])),)


class DiffserveEdit:
    """Image edit, image-to-image or inpainting: `POST /v1/images/edits` (multipart), one request per
    image of the batch, each with its mask when one is given."""

    CATEGORY = CATEGORY
    FUNCTION = "edit"
    RETURN_TYPES = ("IMAGE",)
    RETURN_NAMES = ("images",)
    DESCRIPTION = "Edit images on a diffserve server (POST /v1/images/edits); MASK 1 = the area to edit."

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        strength_tip = "how far the image is noised, 0..1; -1: the model's default"
        return {
            "required": {
                **_server_input(),
                "image": ("IMAGE",),
                **_prompt_inputs(),
                **_size_inputs(),
                **_sampling_inputs(),
                **_batch_input(),
                **_quality_input(),
            },
            "optional": {
                "mask": ("MASK", {"tooltip": "1 = edit, 0 = keep; one mask, or one per image"}),
                "strength": (
                    "FLOAT",
                    {"default": -1.0, "min": -1.0, "max": 1.0, "step": 0.01, "tooltip": strength_tip},
                ),
                **_connection_inputs(600),
                **_loras_input(),
                **_controlnets_input(),
            },
        }

    def edit(
        self, server_url: str, image: torch.Tensor, prompt: str, negative_prompt: str, width: int, height: int,
        steps: int, guidance: float, seed: int, n: int, quality: str, mask: torch.Tensor | None = None,
        strength: float = -1.0, api_key: str = "", model: str = "", timeout_s: int = 600,
        loras: LoraList | None = None, controlnets: list[dict] | None = None,
    ) -> tuple[torch.Tensor]:  # fmt: skip
        client = DiffserveClient(server_url, api_key, timeout_s)
        body = request_fields(prompt, negative_prompt, steps, guidance, seed, quality, model, loras)
        body |= image_size_fields(width, height) | {"n": n, **IMAGE_OUTPUT}
        if controlnets:
            body["controlnets"] = controlnets
        if strength >= 0:
            body["strength"] = strength
        fields = form_fields(body)
        images = image[None] if image.ndim == 3 else image
        masks = None if mask is None else masks_for(mask, images.shape[0], images.shape[1], images.shape[2])
        check_interrupt = interrupt_check()
        results: list[torch.Tensor] = []
        for i, single in enumerate(images):
            check_interrupt()
            files = [UploadFile("image", "image.png", image_png(single))]
            if masks is not None:
                files.append(UploadFile("mask", "mask.png", mask_png(masks[i])))
            answer = client.post_multipart("/v1/images/edits", fields, files)
            results += decode_b64_images(answer["data"])
        return (stack(results),)


class DiffserveVideo:
    """Text (or first frame) to video: a `/v1/videos` job, polled until done, its MP4 decoded into
    frames (B = frames) and its frame rate."""

    CATEGORY = CATEGORY
    FUNCTION = "video"
    RETURN_TYPES = ("IMAGE", "FLOAT")
    RETURN_NAMES = ("frames", "fps")
    DESCRIPTION = "Make a video on a diffserve server (POST /v1/videos, poll, download); outputs its frames."

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        return {
            "required": {
                **_server_input(),
                **_prompt_inputs(),
                **_size_inputs(),
                "num_frames": (
                    "INT",
                    {"default": 0, "min": 0, "max": 1025, "tooltip": "Wan: 4k+1; 0: the model's default"},
                ),
                "fps": ("INT", {"default": 0, "min": 0, "max": 120, "tooltip": "0: the model's default"}),
                **_sampling_inputs(),
                **_quality_input(),
            },
            "optional": {
                "first_frame": ("IMAGE", {"tooltip": "image-to-video models: the first frame (one image)"}),
                **_connection_inputs(1800),
                **_loras_input(),
            },
        }

    def video(
        self, server_url: str, prompt: str, negative_prompt: str, width: int, height: int, num_frames: int,
        fps: int, steps: int, guidance: float, seed: int, quality: str, first_frame: torch.Tensor | None = None,
        api_key: str = "", model: str = "", timeout_s: int = 1800, loras: LoraList | None = None,
    ) -> tuple[torch.Tensor, float]:  # fmt: skip
        if (width > 0) != (height > 0):
            raise ValueError("set both width and height, or leave both 0 (the model's default size)")
        load_av()  # before the job: a missing PyAV is reported now, not after the video is made
        # One request's wait is short (create, poll, download); timeout_s bounds the whole job.
        client = DiffserveClient(server_url, api_key, min(timeout_s, 600))
        body = request_fields(prompt, negative_prompt, steps, guidance, seed, quality, model, loras)
        if width > 0:
            body["size"] = f"{width}x{height}"
        if num_frames > 0:
            body["num_frames"] = num_frames
        if fps > 0:
            body["fps"] = fps
        if first_frame is not None:
            frames = first_frame[None] if first_frame.ndim == 3 else first_frame
            if frames.shape[0] != 1:
                raise ValueError(f"first_frame must be one image, got a batch of {frames.shape[0]}")
            body["input_reference"] = image_data_url(frames[0])
        data = run_video_job(client, body, timeout_s, interrupt_check(), progress_reporter(100))
        frames_out, rate = decode_mp4(data)
        return (frames_out, rate)


class DiffserveLoras:
    """The LoRA adapters to apply: `selection` ("NAME:SCALE" entries), checked against the server's
    (`GET /v1/loras`), added to an optional upstream selection; also lists what the server serves."""

    CATEGORY = CATEGORY
    FUNCTION = "select"
    RETURN_TYPES = (LORAS_TYPE, "STRING")
    RETURN_NAMES = ("loras", "available")
    DESCRIPTION = "Choose LoRA adapters served by a diffserve server (GET /v1/loras) for the other nodes."

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        tip = "NAME or NAME:SCALE, separated by commas or new lines, e.g. ink:0.8, detail:0.5"
        return {
            "required": {
                **_server_input(),
                "selection": ("STRING", {"multiline": True, "default": "", "tooltip": tip}),
            },
            "optional": {
                "api_key": (
                    "STRING",
                    {"default": "", "tooltip": "empty: $DIFFSERVE_API_KEY if set, else none"},
                ),
                "loras": (LORAS_TYPE, {"tooltip": "a selection to extend (chained LoRAs nodes)"}),
            },
        }

    def select(
        self, server_url: str, selection: str, api_key: str = "", loras: LoraList | None = None
    ) -> tuple[LoraList, str]:
        chosen = [*(loras or []), *parse_selection(selection)]
        names = [entry["name"] for entry in chosen]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"LoRA {repeated[0]!r} is selected more than once; give each adapter once")
        client = DiffserveClient(server_url, api_key, 60)
        listed = served_loras(client)
        check_served(client, chosen, listed)
        return (chosen, "\n".join(listed))


class DiffserveControlNet:
    """A ControlNet to apply: one the server loaded (`--controlnet NAME=PATH`, listed in
    `/server_info`), its control image (the batch's first), Diffusers' settings and, for an inpainting
    ControlNet, the mask of the area to repaint (the batch's first, of the image's size), added to an
    optional upstream list (chained nodes: several ControlNets in one request). Also lists what the server
    serves."""

    CATEGORY = CATEGORY
    FUNCTION = "select"
    RETURN_TYPES = (CONTROLNETS_TYPE, "STRING")
    RETURN_NAMES = ("controlnets", "available")
    DESCRIPTION = "Apply a ControlNet served by a diffserve server (--controlnet) with a control image."

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        fraction = {"min": 0.0, "max": 1.0, "step": 0.01}
        return {
            "required": {
                **_server_input(),
                "image": ("IMAGE", {"tooltip": "the control image (edges, depth, pose...); a batch's first"}),
                "controlnet": (
                    "STRING",
                    {"default": "", "tooltip": "a loaded ControlNet; empty: the only one"},
                ),
                "scale": (
                    "FLOAT",
                    {
                        "default": 1.0,
                        "min": 0.0,
                        "max": MAX_CONTROLNET_SCALE,
                        "step": 0.05,
                        "tooltip": "controlnet_conditioning_scale",
                    },
                ),  # fmt: skip
                "start": ("FLOAT", {"default": 0.0, **fraction, "tooltip": "control_guidance_start"}),
                "end": ("FLOAT", {"default": 1.0, **fraction, "tooltip": "control_guidance_end"}),
            },
            "optional": {
                "mode": (
                    "INT",
                    {"default": -1, "min": -1, "max": 255, "tooltip": "a Union ControlNet's mode; -1: none"},
                ),
                "api_key": (
                    "STRING",
                    {"default": "", "tooltip": "empty: $DIFFSERVE_API_KEY if set, else none"},
                ),
                "controlnets": (CONTROLNETS_TYPE, {"tooltip": "a list to extend (chained ControlNet nodes)"}),
                "mask": ("MASK", {"tooltip": "an inpainting ControlNet's mask: 1 = repaint, 0 = keep"}),
            },
        }

    def select(
        self, server_url: str, image: torch.Tensor, controlnet: str, scale: float, start: float, end: float,
        mode: int = -1, api_key: str = "", controlnets: list[dict] | None = None, mask: torch.Tensor | None = None,
    ) -> tuple[list[dict], str]:  # fmt: skip
        if not start < end:
            raise ValueError(f"start ({start:g}) must be below end ({end:g})")
        client = DiffserveClient(server_url, api_key, 60)
        served = client.get_json("/server_info").get("engine", {}).get("controlnets") or []
        names = [entry["name"] for entry in served]
        chosen = controlnet.strip()
        if not chosen:
            if len(names) != 1:
                listed = ", ".join(names) or "none"
                raise ValueError(f"name the ControlNet to apply (the server serves: {listed})")
            chosen = names[0]
        elif chosen not in names:
            listed = ", ".join(names) or "none"
            raise ValueError(
                f"the diffserve server has no ControlNet named {chosen!r} (it serves: {listed}); start it with "
                "--controlnet NAME=PATH"
            )
        images = image[None] if image.ndim == 3 else image
        entry = {
            "name": chosen,
            "image": image_data_url(images[0]),
            "scale": scale,
            "start": start,
            "end": end,
        }
        if mode >= 0:
            entry["mode"] = mode
        if mask is not None:  # sent as the Edit node's masks are (transparent and white = repaint)
            first = mask[:1] if mask.ndim == 3 else mask
            height, width = images.shape[1:3]
            entry["mask"] = mask_data_url(masks_for(first, 1, height, width)[0])
        return ([*(controlnets or []), entry], "\n".join(names))
