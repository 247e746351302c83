"""Builder of small random-weight SkyReels-V2 checkpoints (`SkyReelsV2Pipeline`,
`SkyReelsV2ImageToVideoPipeline`), laid out as the released Skywork Diffusers folders: UMT5, the SkyReels-V2
DiT, the Wan 2.1 VAE, UniPC with flow sigmas (flow_shift 8.0 for text-to-video, 5.0 for image-to-video) and,
for image-to-video, a CLIP vision encoder with projection. The image processor is a `CLIPImageProcessor`
(the released folders ship a `CLIPProcessor`, whose tokenizer the pipelines never use).

`diffusion_forcing` writes a `SkyReelsV2DiffusionForcingPipeline` folder (the DiT injects fps). Used by the
tests and `diffserve make-tiny skyreels-v2` / `skyreels-v2-i2v` / `skyreels-v2-df`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

from diffserve.families.wan.tiny import (
    TinyWanSpec,
    _dit_config,
    _vae_config,
    _write_text_encoder,
    unipc_scheduler_config,
)
from diffserve.models.dits.skyreels_v2 import SkyReelsV2Transformer3DModel
from diffserve.models.vaes.autoencoder_kl_wan import AutoencoderKLWan
from diffserve.testing.tiny_writing import (
    DIFFUSERS_FORMAT_VERSION,
    random_native_module,
    save_diffusers_model,
    tiny_folder,
    vision_tower_shape,
    write_json,
    write_scheduler_config,
)


@dataclass
class TinySkyReelsV2Spec:
    """Shape of a tiny SkyReels-V2 checkpoint (the tiny Wan 2.1 shapes); `image_to_video` adds CLIP."""

    image_to_video: bool = False
    #: A `SkyReelsV2DiffusionForcingPipeline` folder: the DiT injects fps (`inject_sample_info`).
    diffusion_forcing: bool = False
    #: The DiT's frames per causal block (diffusion forcing's block-causal attention when > 1).
    num_frame_per_block: int = 1
    seed: int = 0
    #: The released T2V folders' UniPC shift is 8.0, I2V's 5.0; None picks it by task.
    flow_shift: float | None = None


def _write_image_encoder(root: Path, wan: TinyWanSpec) -> None:
    shape = vision_tower_shape(wan.clip_hidden_size, wan.clip_image_size, wan.clip_patch_size)
    encoder = CLIPVisionModelWithProjection(CLIPVisionConfig(**shape, projection_dim=wan.clip_hidden_size))
    encoder.save_pretrained(root / "image_encoder")
    size = wan.clip_image_size
    CLIPImageProcessor(
        size={"shortest_edge": size}, crop_size={"height": size, "width": size}
    ).save_pretrained(root / "image_processor")


def build_tiny_skyreels_v2(out_dir: str | Path, spec: TinySkyReelsV2Spec | None = None) -> Path:
    """Write a random-weight SkyReels-V2 folder (T2V, or I2V with `spec.image_to_video`); return its path."""
    spec = spec or TinySkyReelsV2Spec()
    wan = TinyWanSpec(image_to_video=spec.image_to_video, seed=spec.seed)
    root = tiny_folder(out_dir, spec.seed)
    _write_text_encoder(root, wan)
    if spec.diffusion_forcing and spec.image_to_video:
        raise ValueError(
            "the diffusion-forcing folder served is text-to-video: build it without image_to_video"
        )
    dit_config = {
        **_dit_config(wan),
        "inject_sample_info": spec.diffusion_forcing,
        "num_frame_per_block": spec.num_frame_per_block,
    }
    dit = random_native_module(SkyReelsV2Transformer3DModel, dit_config, spec.seed + 10, wan.dit_weight_noise)
    save_diffusers_model(dit, root / "transformer", "SkyReelsV2Transformer3DModel", dit_config)
    vae_config = _vae_config(wan)
    vae = random_native_module(AutoencoderKLWan, vae_config, spec.seed + 20)
    save_diffusers_model(vae, root / "vae", "AutoencoderKLWan", vae_config)
    index: dict = {
        "_class_name": (
            "SkyReelsV2ImageToVideoPipeline"
            if spec.image_to_video
            else "SkyReelsV2DiffusionForcingPipeline"
            if spec.diffusion_forcing
            else "SkyReelsV2Pipeline"
        ),
        "_diffusers_version": DIFFUSERS_FORMAT_VERSION,
        "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "SkyReelsV2Transformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLWan"],
    }
    if spec.image_to_video:
        _write_image_encoder(root, wan)
        index["image_encoder"] = ["transformers", "CLIPVisionModelWithProjection"]
        index["image_processor"] = ["transformers", "CLIPImageProcessor"]
    flow_shift = spec.flow_shift if spec.flow_shift is not None else (5.0 if spec.image_to_video else 8.0)
    write_scheduler_config(root, "UniPCMultistepScheduler", unipc_scheduler_config(flow_shift), newline=True)
    write_json(root / "model_index.json", index, newline=True)
    return root
