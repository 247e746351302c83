"""Which native diffserve class implements each Diffusers component class.

A Diffusers component whose class is not listed here is refused with a message naming what is
supported; diffserve never hands a component to diffusers behind the user's back.
"""

from __future__ import annotations

from diffserve.models.dits.flux import FluxTransformer2DModel
from diffserve.models.dits.sd3 import SD3Transformer2DModel
from diffserve.models.schedulers.flow_match_euler import FlowMatchEulerScheduler
from diffserve.models.vaes.autoencoder_kl import AutoencoderKL

#: Diffusers `_class_name` -> native module class (weights-bearing models).
NATIVE_MODELS: dict[str, type] = {
    "FluxTransformer2DModel": FluxTransformer2DModel,
    "SD3Transformer2DModel": SD3Transformer2DModel,
    "AutoencoderKL": AutoencoderKL,
}

#: Diffusers scheduler `_class_name` -> native scheduler class.
NATIVE_SCHEDULERS: dict[str, type] = {
    "FlowMatchEulerDiscreteScheduler": FlowMatchEulerScheduler,
}

#: transformers classes accepted for text encoders (loaded by transformers itself).
TRANSFORMERS_ENCODERS: frozenset[str] = frozenset(
    {"CLIPTextModel", "CLIPTextModelWithProjection", "T5EncoderModel"}
)

#: transformers tokenizer class names accepted in model_index.json; the slow/fast spellings are
#: both accepted and resolved to whichever class this transformers version provides.
TRANSFORMERS_TOKENIZERS: dict[str, tuple[str, ...]] = {
    "CLIPTokenizer": ("CLIPTokenizerFast", "CLIPTokenizer"),
    "CLIPTokenizerFast": ("CLIPTokenizerFast", "CLIPTokenizer"),
    "T5Tokenizer": ("T5TokenizerFast", "T5Tokenizer"),
    "T5TokenizerFast": ("T5TokenizerFast", "T5Tokenizer"),
    # A generic tokenizer.json (e.g. a word-level vocabulary, as the shipped demo model uses).
    "PreTrainedTokenizerFast": ("PreTrainedTokenizerFast",),
}
