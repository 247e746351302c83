"""Each DiT's config dataclass: read once from a Diffusers `config.json`, frozen, unknown keys refused."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from diffserve.models.config_keys import config_from_diffusers
from diffserve.models.dits.chroma import ChromaTransformer2DModel, ChromaTransformerConfig
from diffserve.models.dits.flux import FluxTransformer2DModel, FluxTransformerConfig
from diffserve.models.dits.longcat_image import LongCatImageTransformer2DModel, LongCatImageTransformerConfig
from diffserve.models.dits.qwen_image import QwenImageTransformer2DModel, QwenImageTransformerConfig
from diffserve.models.dits.sana_video import SanaVideoTransformer3DModel, SanaVideoTransformerConfig
from diffserve.models.dits.sd3 import SD3Transformer2DModel, SD3TransformerConfig
from diffserve.models.dits.wan import WanTransformer3DModel, WanTransformerConfig
from diffserve.models.dits.z_image import ZImageTransformer2DModel, ZImageTransformerConfig

FAMILIES = [
    (FluxTransformer2DModel, FluxTransformerConfig),
    (SD3Transformer2DModel, SD3TransformerConfig),
    (QwenImageTransformer2DModel, QwenImageTransformerConfig),
    (ZImageTransformer2DModel, ZImageTransformerConfig),
    (WanTransformer3DModel, WanTransformerConfig),
    (ChromaTransformer2DModel, ChromaTransformerConfig),
    (LongCatImageTransformer2DModel, LongCatImageTransformerConfig),
    (SanaVideoTransformer3DModel, SanaVideoTransformerConfig),
]
IDS = [model.diffusers_class_name for model, _ in FAMILIES]


@pytest.mark.parametrize(("model_cls", "config_cls"), FAMILIES, ids=IDS)
def test_an_empty_config_json_gives_the_defaults_and_the_model_keeps_it(model_cls, config_cls) -> None:
    with torch.device("meta"):
        model = model_cls.from_config({"_class_name": model_cls.diffusers_class_name, "_version": "0"})
    assert model.config == config_cls()
    with pytest.raises(dataclasses.FrozenInstanceError):
        model.config.in_channels = 3


@pytest.mark.parametrize(("model_cls", "config_cls"), FAMILIES, ids=IDS)
def test_json_lists_become_tuples_and_every_field_round_trips(model_cls, config_cls) -> None:
    """A config written as JSON (tuples become lists) reads back to the same frozen config."""
    config = config_cls()
    written = json.loads(json.dumps(dataclasses.asdict(config)))
    assert config_from_diffusers(config_cls, written, model_cls.diffusers_class_name) == config


@pytest.mark.parametrize(("model_cls", "config_cls"), FAMILIES, ids=IDS)
def test_unknown_keys_are_refused_with_the_class_name(model_cls, config_cls) -> None:
    with pytest.raises(ValueError, match=f"{model_cls.diffusers_class_name} config has unknown keys"):
        model_cls.from_config({"not_a_key": 1})


def test_out_channels_none_means_in_channels() -> None:
    flux = FluxTransformerConfig(in_channels=16, attention_head_dim=16, axes_dims_rope=(4, 6, 6))
    assert flux.out_channels == 16
    assert SD3TransformerConfig(in_channels=8, out_channels=None).out_channels == 8
    assert WanTransformerConfig(in_channels=36, out_channels=None).out_channels == 36
