"""Builder of small random-weight HunyuanVideo image-to-video checkpoints in the Diffusers
`HunyuanVideoImageToVideoPipeline` layout.

Text-to-video's folder (`tiny.py`: CLIP, DiT, VAE, scheduler) with a Llava text encoder
(`LlavaForConditionalGeneration`: a 2-layer CLIP vision tower of 48 px in 2 px patches, so 576 vision tokens
as the pipeline's fixed `image_emb_len` wants, and a 3-layer Llama) and its `CLIPImageProcessor`; the
tokenizer keeps the template's header words, "\\n\\n" and `<image>` whole, so the `<image>` token sits at
position 5 and the prompt starts at token 103, as with the real Llama-3 vocabulary. The DiT is
"token_replace" (the released HunyuanVideo-I2V: latent channels in, guidance-distilled) or "latent_concat"
(HunyuanVideo-I2V-33ch: 2C + 1 channels in, no guidance embedding).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import (
    CLIPVisionConfig,
    LlamaConfig,
    LlamaTokenizer,
    LlavaConfig,
    LlavaForConditionalGeneration,
)

from diffserve.families.hunyuan_video.image_to_video_config import IMAGE_PROMPT_TEMPLATE
from diffserve.families.hunyuan_video.tiny import (
    HEADER_TOKENS,
    TinyHunyuanVideoSpec,
    hunyuan_video_model_index,
    llama_template_tokenizer,
    tiny_dit_config,
    write_clip_dit_vae_scheduler,
)
from diffserve.testing.tiny_writing import (
    finish_tiny_folder,
    llama_text_shape,
    save_text_encoder,
    tiny_folder,
    vision_tower_shape,
    write_clip_image_processor,
)

IMAGE_TOKEN, PAD_TOKEN = "<image>", "<pad>"
#: Template pieces the real vocabulary holds as one token each, whose positions the pipeline fixes.
WHOLE_WORDS = ("system", "user", "assistant", "\n\n")


def llava_template_tokenizer() -> LlamaTokenizer:
    """The Llama-3-style tokenizer of `tiny.py` for the image-to-video template, with `<image>` and `<pad>`."""
    return llama_template_tokenizer(
        IMAGE_PROMPT_TEMPLATE, (*HEADER_TOKENS, IMAGE_TOKEN, PAD_TOKEN), WHOLE_WORDS, pad_token=PAD_TOKEN
    )


@dataclass
class TinyHunyuanVideoI2VSpec(TinyHunyuanVideoSpec):
    """Shape of a tiny HunyuanVideo image-to-video checkpoint."""

    image_condition_type: str = "token_replace"
    vision_dim: int = 16
    #: 48 px in 2 px patches: 24 x 24 = 576 vision tokens, the pipeline's fixed count.
    vision_image_size: int = 48
    vision_patch_size: int = 2
    #: The Llama's positions: the longest prompt is this many minus 103 + 575.
    text_positions: int = 1024

    def __post_init__(self) -> None:
        if self.image_condition_type == "latent_concat":
            self.guidance_embeds = False


def _llava(tokenizer: LlamaTokenizer, spec: TinyHunyuanVideoI2VSpec) -> LlavaForConditionalGeneration:
    vision = CLIPVisionConfig(
        **vision_tower_shape(spec.vision_dim, spec.vision_image_size, spec.vision_patch_size),
        projection_dim=spec.vision_dim,
    )
    text = LlamaConfig(
        **llama_text_shape(tokenizer, spec.text_dim, spec.text_layers, 2, 2, spec.text_positions)
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        image_seq_length=(spec.vision_image_size // spec.vision_patch_size) ** 2,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlavaForConditionalGeneration(config).eval()


def build_tiny_hunyuan_video_i2v(out_dir: str | Path, spec: TinyHunyuanVideoI2VSpec | None = None) -> Path:
    """Write a random-weight HunyuanVideo image-to-video folder to `out_dir` and return its path."""
    spec = spec or TinyHunyuanVideoI2VSpec()
    root = tiny_folder(out_dir, spec.seed)
    tokenizer = llava_template_tokenizer()
    save_text_encoder(root, _llava(tokenizer, spec), tokenizer)
    write_clip_image_processor(root / "image_processor", spec.vision_image_size)
    channels = spec.latent_channels
    dit_config = {
        **tiny_dit_config(spec),
        "image_condition_type": spec.image_condition_type,
        "in_channels": channels if spec.image_condition_type == "token_replace" else 2 * channels + 1,
        **spec.extra_dit_config,
    }
    write_clip_dit_vae_scheduler(root, spec, dit_config)
    model_index = {
        **hunyuan_video_model_index(),
        "_class_name": "HunyuanVideoImageToVideoPipeline",
        "text_encoder": ["transformers", "LlavaForConditionalGeneration"],
        "image_processor": ["transformers", "CLIPImageProcessor"],
    }
    return finish_tiny_folder(root, model_index, spec)
