"""Builders of small random-weight HunyuanVideo 1.5 checkpoints (`HunyuanVideo15Pipeline`,
`HunyuanVideo15ImageToVideoPipeline`), laid out as the released Diffusers folders
(hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v / _i2v): the same component classes and
config files, shrunk.

Used by the tests and `diffserve make-tiny hunyuan-video15-t2v` / `-i2v`. The DiT and the VAE are written
with Diffusers' own classes (random weights, `save_pretrained`), so the folder is exactly what Diffusers
writes and diffserve's native classes must load it unchanged; building one needs diffusers installed.
The text encoders (Qwen2.5-VL's language model, a ByT5-style T5 encoder) and, for image-to-video, the
SigLIP vision model and its processor are transformers objects; the tokenizers are built in memory.

The tiny Qwen tokenizer has whole-word tokens only for the Qwen-Image templates, so HunyuanVideo's system
turn takes more than the 108 tokens the pipelines drop: some template tokens stay in the text states.
Diffusers and diffserve do the same with it, which is what the parity tests need.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from transformers import (
    ByT5Tokenizer,
    Qwen2_5_VLTextConfig,
    Qwen2_5_VLTextModel,
    SiglipImageProcessor,
    SiglipVisionConfig,
    SiglipVisionModel,
    T5Config,
    T5EncoderModel,
)

from diffserve.testing.qwen_tokenizers import build_qwen_tokenizer
from diffserve.testing.tiny_writing import (
    diffusers_config,
    qwen_text_shape,
    random_native_module,
    save_text_encoder,
    t5_shape,
    tiny_folder,
    vision_tower_shape,
    write_json,
    write_scheduler_config,
)

#: The released guider (`guider/guider_config.json`): Diffusers' CFG at scale 6.
GUIDER_CONFIG = {
    "enabled": True,
    "guidance_rescale": 0.0,
    "guidance_scale": 6.0,
    "start": 0.0,
    "stop": 1.0,
    "use_original_formulation": False,
}


@dataclass
class TinyHunyuanVideo15Spec:
    """Shape of a tiny HunyuanVideo 1.5 checkpoint; `image_to_video` adds SigLIP and the I2V layout."""

    image_to_video: bool = False
    num_layers: int = 2
    num_refiner_layers: int = 1
    num_attention_heads: int = 2
    attention_head_dim: int = 16
    rope_axes_dim: tuple[int, int, int] = (4, 6, 6)  # (frames, rows, cols), sums to attention_head_dim
    #: Pixel size of the DiT's size buckets: 64 gives 48x80 for 16:9 text-to-video.
    target_size: int = 64
    latent_channels: int = 8
    vae_block_out_channels: tuple[int, ...] = (16, 16, 32, 32, 32)
    text_hidden_size: int = 32
    text_layers: int = 3  # the pipelines read the states two layers below the last
    glyph_hidden_size: int = 32
    image_hidden_size: int = 32
    image_size: int = 32
    image_patch_size: int = 8  # 16 SigLIP tokens per image
    #: The released T2V 480p scheduler shifts by 5, the I2V one by 7.
    shift: float | None = None
    guidance_scale: float = 6.0
    use_meanflow: bool = False
    #: N(0, this) added to every DiT weight: a random DiT is otherwise nearly blind to its text (at 0.2, CFG
    #: and the quoted text change the tiny test video by less than the 40 dB parity bar; at 1.0 by 13+ dB).
    dit_weight_noise: float = 1.0
    seed: int = 0
    #: Keys over the DiT's, the VAE's, the scheduler's and the guider's tiny configs (a checkpoint's other
    #: values).
    extra_dit_config: dict = field(default_factory=dict)
    extra_vae_config: dict = field(default_factory=dict)
    extra_scheduler_config: dict = field(default_factory=dict)
    extra_guider_config: dict = field(default_factory=dict)


def hunyuan_video15_model_index(image_to_video: bool) -> dict:
    index = {
        "_class_name": "HunyuanVideo15ImageToVideoPipeline" if image_to_video else "HunyuanVideo15Pipeline",
        "_diffusers_version": "0.36.0.dev0",
        "guider": ["diffusers", "ClassifierFreeGuidance"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen2_5_VLTextModel"],
        "text_encoder_2": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", "Qwen2TokenizerFast"],
        "tokenizer_2": ["transformers", "ByT5Tokenizer"],
        "transformer": ["diffusers", "HunyuanVideo15Transformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLHunyuanVideo15"],
    }
    if image_to_video:
        index["image_encoder"] = ["transformers", "SiglipVisionModel"]
        index["feature_extractor"] = ["transformers", "SiglipImageProcessor"]
    return index


def _write_text_encoders(root: Path, spec: TinyHunyuanVideo15Spec) -> None:
    tokenizer = build_qwen_tokenizer()
    config = Qwen2_5_VLTextConfig(
        **qwen_text_shape(tokenizer, spec.text_hidden_size, spec.text_layers, 2, 1, 4096, mrope=True)
    )
    save_text_encoder(root, Qwen2_5_VLTextModel(config).eval(), tokenizer)

    glyph_tokenizer = ByT5Tokenizer()
    glyph_shape = t5_shape(len(glyph_tokenizer), spec.glyph_hidden_size, 2)
    glyph_encoder = T5EncoderModel(T5Config(**glyph_shape, is_encoder_decoder=False, use_cache=False))
    save_text_encoder(root, glyph_encoder.eval(), glyph_tokenizer, "_2")


def _write_image_encoder(root: Path, spec: TinyHunyuanVideo15Spec) -> None:
    shape = vision_tower_shape(spec.image_hidden_size, spec.image_size, spec.image_patch_size)
    encoder = SiglipVisionModel(SiglipVisionConfig(**shape))
    encoder.eval().save_pretrained(root / "image_encoder")
    size = spec.image_size
    SiglipImageProcessor(
        size={"height": size, "width": size}, resample=3, image_mean=[0.5] * 3, image_std=[0.5] * 3
    ).save_pretrained(root / "feature_extractor")


def _dit_config(spec: TinyHunyuanVideo15Spec) -> dict:
    return {
        "in_channels": 2 * spec.latent_channels + 1,  # noisy latents, condition latents, condition mask
        "out_channels": spec.latent_channels,
        "num_attention_heads": spec.num_attention_heads,
        "attention_head_dim": spec.attention_head_dim,
        "num_layers": spec.num_layers,
        "num_refiner_layers": spec.num_refiner_layers,
        "mlp_ratio": 4.0,
        "patch_size": 1,
        "patch_size_t": 1,
        "qk_norm": "rms_norm",
        "text_embed_dim": spec.text_hidden_size,
        "text_embed_2_dim": spec.glyph_hidden_size,
        "image_embed_dim": spec.image_hidden_size,
        "rope_theta": 256.0,
        "rope_axes_dim": list(spec.rope_axes_dim),
        "target_size": spec.target_size,
        "task_type": "i2v" if spec.image_to_video else "t2v",
        "use_meanflow": spec.use_meanflow,
        **spec.extra_dit_config,
    }


def build_tiny_hunyuan_video15(out_dir: str | Path, spec: TinyHunyuanVideo15Spec | None = None) -> Path:
    """Write a random-weight HunyuanVideo 1.5 folder (text-to-video, or image-to-video with
    `spec.image_to_video`); return its path."""
    from diffusers import AutoencoderKLHunyuanVideo15, HunyuanVideo15Transformer3DModel

    spec = spec or TinyHunyuanVideo15Spec()
    root = tiny_folder(out_dir, spec.seed)
    _write_text_encoders(root, spec)
    dit = random_native_module(
        HunyuanVideo15Transformer3DModel, _dit_config(spec), spec.seed + 10, spec.dit_weight_noise
    )
    dit.save_pretrained(root / "transformer")
    vae_config = {
        "latent_channels": spec.latent_channels,
        "block_out_channels": list(spec.vae_block_out_channels),
        "layers_per_block": 1,
        **spec.extra_vae_config,
    }
    random_native_module(AutoencoderKLHunyuanVideo15, vae_config, spec.seed + 20).save_pretrained(
        root / "vae"
    )
    if spec.image_to_video:
        _write_image_encoder(root, spec)
    shift = spec.shift if spec.shift is not None else (7.0 if spec.image_to_video else 5.0)
    scheduler = {
        "num_train_timesteps": 1000,
        "shift": shift,
        "use_dynamic_shifting": False,
        **spec.extra_scheduler_config,
    }
    guider = {**GUIDER_CONFIG, "guidance_scale": spec.guidance_scale, **spec.extra_guider_config}
    write_scheduler_config(root, "FlowMatchEulerDiscreteScheduler", scheduler, newline=True)
    guider_config = diffusers_config("ClassifierFreeGuidance", guider)
    write_json(root / "guider" / "guider_config.json", guider_config, newline=True)
    write_json(root / "model_index.json", hunyuan_video15_model_index(spec.image_to_video), newline=True)
    return root
