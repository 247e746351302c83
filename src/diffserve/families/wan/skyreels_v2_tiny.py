"""Builder of small random-weight SkyReels-V2 checkpoints (`SkyReelsV2Pipeline`,
`SkyReelsV2ImageToVideoPipeline`), laid out as the released Skywork Diffusers folders: UMT5, the SkyReels-V2
DiT, the Wan 2.1 VAE, UniPC with flow sigmas (flow_shift 8.0 for text-to-video, 5.0 for image-to-video) and,
for image-to-video, a CLIP vision encoder with projection. The image processor is a `CLIPImageProcessor`
(the released folders ship a `CLIPProcessor`, whose tokenizer the pipelines never use).

`diffusion_forcing` writes a `SkyReelsV2DiffusionForcingPipeline` folder (the DiT injects fps), with
`image_to_video` a `SkyReelsV2DiffusionForcingImageToVideoPipeline` one, with `video_to_video` a
`SkyReelsV2DiffusionForcingVideoToVideoPipeline` one (the same components: no CLIP). Used by the tests and
`diffserve make-tiny skyreels-v2` / `skyreels-v2-i2v` / `skyreels-v2-df` / `skyreels-v2-df-i2v` /
`skyreels-v2-df-v2v`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import CLIPVisionModelWithProjection

from diffserve.families.wan.tiny import (
    TinyWanSpec,
    _dit_config,
    _vae_config,
    _write_image_encoder,
    _write_text_encoder,
    unipc_scheduler_config,
)
from diffserve.models.dits.skyreels_v2 import SkyReelsV2Transformer3DModel
from diffserve.models.vaes.autoencoder_kl_wan import AutoencoderKLWan
from diffserve.testing.tiny_writing import (
    DIFFUSERS_FORMAT_VERSION,
    tiny_folder,
    write_json,
    write_random_module,
    write_scheduler_config,
)


@dataclass
class TinySkyReelsV2Spec:
    """Shape of a tiny SkyReels-V2 checkpoint (the tiny Wan 2.1 shapes); `image_to_video` adds CLIP (not to a
    diffusion-forcing folder)."""

    image_to_video: bool = False
    #: A `SkyReelsV2DiffusionForcingPipeline` folder: the DiT injects fps (`inject_sample_info`).
    diffusion_forcing: bool = False
    #: With `diffusion_forcing`: a `SkyReelsV2DiffusionForcingVideoToVideoPipeline` folder (video extension).
    video_to_video: bool = False
    #: The DiT's frames per causal block (diffusion forcing's block-causal attention when > 1).
    num_frame_per_block: int = 1
    seed: int = 0
    #: The released T2V folders' UniPC shift is 8.0, I2V's 5.0; None picks it by task.
    flow_shift: float | None = None


def _pipeline_name(spec: TinySkyReelsV2Spec) -> str:
    """The folder's Diffusers pipeline (model_index.json's _class_name)."""
    if spec.video_to_video:
        if not spec.diffusion_forcing or spec.image_to_video:
            raise ValueError("video_to_video is a diffusion-forcing folder, not an image-to-video one")
        return "SkyReelsV2DiffusionForcingVideoToVideoPipeline"
    if spec.diffusion_forcing:
        return (
            "SkyReelsV2DiffusionForcingImageToVideoPipeline"
            if spec.image_to_video
            else "SkyReelsV2DiffusionForcingPipeline"
        )
    return "SkyReelsV2ImageToVideoPipeline" if spec.image_to_video else "SkyReelsV2Pipeline"


def build_tiny_skyreels_v2(out_dir: str | Path, spec: TinySkyReelsV2Spec | None = None) -> Path:
    """Write a random-weight SkyReels-V2 folder (T2V, or I2V with `spec.image_to_video`); return its path."""
    spec = spec or TinySkyReelsV2Spec()
    # The diffusion-forcing image-to-video folder has the text-to-video DiT and no image encoder.
    clip = spec.image_to_video and not spec.diffusion_forcing
    wan = TinyWanSpec(image_to_video=clip, seed=spec.seed)
    root = tiny_folder(out_dir, spec.seed)
    _write_text_encoder(root, wan)
    dit_config = {
        **_dit_config(wan),
        "inject_sample_info": spec.diffusion_forcing,
        "num_frame_per_block": spec.num_frame_per_block,
    }
    write_random_module(
        root / "transformer", SkyReelsV2Transformer3DModel, dit_config, spec.seed + 10, wan.dit_weight_noise
    )
    write_random_module(root / "vae", AutoencoderKLWan, _vae_config(wan), spec.seed + 20)
    index: dict = {
        "_class_name": _pipeline_name(spec),
        "_diffusers_version": DIFFUSERS_FORMAT_VERSION,
        "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "SkyReelsV2Transformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLWan"],
    }
    if clip:
        _write_image_encoder(root, wan, CLIPVisionModelWithProjection)
        index["image_encoder"] = ["transformers", "CLIPVisionModelWithProjection"]
        index["image_processor"] = ["transformers", "CLIPImageProcessor"]
    flow_shift = spec.flow_shift if spec.flow_shift is not None else (5.0 if spec.image_to_video else 8.0)
    write_scheduler_config(root, "UniPCMultistepScheduler", unipc_scheduler_config(flow_shift), newline=True)
    write_json(root / "model_index.json", index, newline=True)
    return root
