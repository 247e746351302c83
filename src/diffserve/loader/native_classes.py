"""Which native diffserve class implements each Diffusers component class.

A Diffusers component whose class is not listed here is refused with a message naming what is
supported; diffserve never hands a component to diffusers behind the user's back.
"""

from __future__ import annotations

from diffserve.loader.processors import IMAGE_ONLY_PROCESSORS
from diffserve.models.dits.flux import FluxTransformer2DModel
from diffserve.models.dits.qwen_image import QwenImageTransformer2DModel
from diffserve.models.dits.sd3 import SD3Transformer2DModel
from diffserve.models.dits.wan import WanTransformer3DModel
from diffserve.models.dits.z_image import ZImageTransformer2DModel
from diffserve.models.schedulers.flow_match_euler import FlowMatchEulerScheduler
from diffserve.models.schedulers.unipc_flow import UniPCFlowScheduler
from diffserve.models.vaes.autoencoder_kl import AutoencoderKL
from diffserve.models.vaes.autoencoder_kl_qwen_image import AutoencoderKLQwenImage, AutoencoderKLWan

#: Diffusers `_class_name` -> native module class (weights-bearing models).
NATIVE_MODELS: dict[str, type] = {
    "FluxTransformer2DModel": FluxTransformer2DModel,
    "SD3Transformer2DModel": SD3Transformer2DModel,
    "QwenImageTransformer2DModel": QwenImageTransformer2DModel,
    "ZImageTransformer2DModel": ZImageTransformer2DModel,
    "WanTransformer3DModel": WanTransformer3DModel,
    "AutoencoderKL": AutoencoderKL,
    "AutoencoderKLQwenImage": AutoencoderKLQwenImage,
    "AutoencoderKLWan": AutoencoderKLWan,
}

#: Diffusers scheduler `_class_name` -> native scheduler class.
NATIVE_SCHEDULERS: dict[str, type] = {
    "FlowMatchEulerDiscreteScheduler": FlowMatchEulerScheduler,
    "UniPCMultistepScheduler": UniPCFlowScheduler,
}

#: transformers classes accepted for text encoders (loaded by transformers itself).
TRANSFORMERS_ENCODERS: frozenset[str] = frozenset(
    {
        "CLIPTextModel",
        "CLIPTextModelWithProjection",
        "T5EncoderModel",
        "Qwen2_5_VLForConditionalGeneration",  # Qwen-Image (its language model; the vision tower for edits)
        "Qwen3Model",  # Z-Image
        "UMT5EncoderModel",  # Wan
        "CLIPVisionModel",  # Wan image-to-video's image encoder
    }
)

#: transformers multimodal processors (tokenizer + image preprocessing) accepted as components.
TRANSFORMERS_PROCESSORS: frozenset[str] = frozenset(IMAGE_ONLY_PROCESSORS)

#: transformers image processors accepted as components (Wan image-to-video's CLIP preprocessing).
TRANSFORMERS_IMAGE_PROCESSORS: frozenset[str] = frozenset({"CLIPImageProcessor"})

#: transformers tokenizer class names accepted in model_index.json; the slow/fast spellings are
#: both accepted and resolved to whichever class this transformers version provides.
TRANSFORMERS_TOKENIZERS: dict[str, tuple[str, ...]] = {
    "CLIPTokenizer": ("CLIPTokenizerFast", "CLIPTokenizer"),
    "CLIPTokenizerFast": ("CLIPTokenizerFast", "CLIPTokenizer"),
    "T5Tokenizer": ("T5TokenizerFast", "T5Tokenizer"),
    "T5TokenizerFast": ("T5TokenizerFast", "T5Tokenizer"),
    "Qwen2Tokenizer": ("Qwen2TokenizerFast", "Qwen2Tokenizer"),
    "Qwen2TokenizerFast": ("Qwen2TokenizerFast", "Qwen2Tokenizer"),
    # A generic tokenizer.json (e.g. a word-level vocabulary, as the shipped demo model uses).
    "PreTrainedTokenizerFast": ("PreTrainedTokenizerFast",),
}
