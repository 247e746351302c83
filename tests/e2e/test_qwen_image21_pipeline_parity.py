"""Whole Qwen-Image 2.1 generations: diffserve against Diffusers' `QwenImage21Pipeline`, same tiny folder and
seed, fp32: CFG off (the default) and on, non-square sizes, two outputs per prompt, a folder with its own
`sample_sigmas`; the prompt states alone; requests of different prompt lengths and CFG sharing steps.
Each generation also runs with another prompt (the control), which must fall well below the bar."""

from __future__ import annotations

import json
import logging
import shutil
from types import SimpleNamespace

import pytest
import torch
from diffusers import QwenImage21Pipeline as DiffusersQwenImage21
from transformers import Qwen2_5_VLConfig

from diffserve import SamplingParams
from diffserve.api import DiffGenerator
from diffserve.errors import InvalidRequestError, ModelLoadError
from diffserve.families.qwen_image21.pipeline import QwenImage21Pipeline
from diffserve.families.qwen_image21.text_encoding import QwenImage21TextEncodingStage
from diffserve.families.qwen_image21.tiny import build_tiny_qwen_image21
from diffserve.loader.component_loader import LoadedComponent
from diffserve.loader.processors import load_image_text_processor
from diffserve.models.dits.qwen_image21 import QwenImage21Transformer2DModel
from diffserve.models.vaes.autoencoder_kl_qwen_image21 import QWEN_IMAGE21_VAE_CONFIG_DEFAULTS
from diffserve.pipelines.base import PipelineContext
from diffserve.platforms.cpu import CpuPlatform
from diffserve.testing.parity import (
    assert_batched_as_alone,
    assert_images_match,
    diffusers_uint8,
    stack_uint8,
)

PSNR_BAR_DB = 40.0
PROMPT = "A red Fox running in the snow"
OTHER_PROMPT = "a blue bird on a branch"
SAMPLE_SIGMAS = [1.0, 0.7, 0.35]


def _reference(root):
    """Diffusers' pipeline on `root`, given the processor diffserve loads (transformers builds a Qwen3-VL
    processor only with torchvision) with the folder's chat template."""
    processor = load_image_text_processor("Qwen3VLProcessor", root / "processor")
    processor.chat_template = (root / "processor" / "chat_template.jinja").read_text()
    reference = DiffusersQwenImage21.from_pretrained(root, processor=processor, dtype=torch.float32)
    reference.set_progress_bar_config(disable=True)
    return reference


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = build_tiny_qwen_image21(tmp_path_factory.mktemp("qwen-image-2.1"))
    fixed = tmp_path_factory.mktemp("qwen-image-2.1-sigmas") / "folder"
    shutil.copytree(root, fixed)
    index = json.loads((fixed / "model_index.json").read_text())
    index["sample_sigmas"] = SAMPLE_SIGMAS
    (fixed / "model_index.json").write_text(json.dumps(index))
    ours = DiffGenerator.from_pretrained(root, device="cpu", show_progress=False, batch_policy="throughput")
    return {"default": (ours, _reference(root)), "sigmas_root": fixed}


def _compare(ours, reference, label: str, **kwargs) -> float:
    n = kwargs.pop("num_outputs_per_prompt", 1)
    got = stack_uint8(ours.generate(prompt=PROMPT, seed=3, num_outputs_per_prompt=n, **kwargs).images)
    want = diffusers_uint8(reference, seed=3, prompt=PROMPT, num_images_per_prompt=n, **kwargs)
    control = stack_uint8(
        ours.generate(prompt=OTHER_PROMPT, seed=3, num_outputs_per_prompt=n, **kwargs).images
    )
    shape = (n, kwargs["height"], kwargs["width"], 4)
    return assert_images_match(got, want, label, min_db=PSNR_BAR_DB, shape=shape, control=control)


CASES = [
    ("no cfg, 64x32", {"height": 64, "width": 32, "num_inference_steps": 2}),
    (
        "cfg, 32x64",
        {
            "height": 32,
            "width": 64,
            "num_inference_steps": 2,
            "true_cfg_scale": 4.0,
            "negative_prompt": "blurry",
        },
    ),
    (
        "two outputs, cfg",
        {
            "height": 32,
            "width": 32,
            "num_inference_steps": 2,
            "true_cfg_scale": 3.0,
            "negative_prompt": " ",
            "num_outputs_per_prompt": 2,
        },
    ),
]


@pytest.mark.parametrize(("label", "kwargs"), CASES, ids=[c[0] for c in CASES])
def test_matches_diffusers(folders, label, kwargs) -> None:
    ours, reference = folders["default"]
    _compare(ours, reference, f"Qwen-Image 2.1 {label}", **dict(kwargs))


def test_sample_sigmas_fix_the_schedule(folders, caplog) -> None:
    """The folder's sample_sigmas set the steps (their count); another step count is replaced, logged, as
    Diffusers ignores it (the same image)."""
    root = folders["sigmas_root"]
    ours = DiffGenerator.from_pretrained(root, device="cpu", show_progress=False)
    reference = _reference(root)
    assert reference.config.sample_sigmas == SAMPLE_SIGMAS
    _compare(ours, reference, "Qwen-Image 2.1 sample_sigmas", height=32, width=32)
    with caplog.at_level(logging.WARNING, logger="diffserve.families"):
        _compare(ours, reference, "Qwen-Image 2.1 sample_sigmas, 5 steps asked", height=32, width=32,
                 num_inference_steps=5)  # fmt: skip
    assert "sample_sigmas" in caplog.text and "not the 5 asked for" in caplog.text


def test_prompt_states_match_diffusers(folders) -> None:
    ours, reference = folders["default"]
    stage = next(s for s in ours.pipeline.stages if isinstance(s, QwenImage21TextEncodingStage))
    assert stage.drop == reference._drop_idx
    for prompt in ("A red fox", "", "a much longer prompt about a red fox in the snow"):
        want, mask, _ = reference.encode_prompt(prompt)
        assert mask is None
        torch.testing.assert_close(stage.encode_one(prompt)[None], want, rtol=1e-5, atol=1e-6)


def test_requests_share_steps_and_match_each_alone(folders) -> None:
    ours, _ = folders["default"]
    common = dict(height=32, width=64, num_inference_steps=2)
    params = [
        SamplingParams(prompt="a cat", seed=5, true_cfg_scale=4.0, negative_prompt="ugly", **common),
        SamplingParams(prompt="a boat on a lake at dawn, oil painting", seed=6, **common),
    ]
    step_sizes = assert_batched_as_alone(ours, params, "Qwen-Image 2.1")
    assert step_sizes[0] == 2


def test_unsupported_options_are_refused(folders) -> None:
    ours, _ = folders["default"]
    with pytest.raises(InvalidRequestError, match="guidance_scale"):
        ours.generate(prompt=PROMPT, height=32, width=32, guidance_scale=3.0)
    with pytest.raises(InvalidRequestError, match="png"):
        ours.generate(prompt=PROMPT, height=32, width=32, num_inference_steps=1, output_format="jpeg")


#: A tiny DiT that fits a 32-wide text encoder and the released (64-channel, 16x) VAE config.
FIT_DIT = {"num_layers": 1, "num_attention_heads": 2, "attention_head_dim": 16, "context_in_dim": 32,
           "axes_dims_rope": [4, 6, 6]}  # fmt: skip


@pytest.mark.parametrize(
    ("dit", "vae", "text_width", "message"),
    [
        # Diffusers hard-codes 16x: an 8x VAE would give images of half the size asked for
        ({}, {"temperal_downsample": [False, True, True]}, 32, "compresses 8x .* needs 16x"),
        ({"in_channels": 16, "out_channels": 16}, {}, 32, "in_channels=16 differs from the VAE's z_dim=64"),
        ({}, {}, 48, "context_in_dim=32 differs from the text encoder's hidden_size=48"),
    ],
)
def test_a_folder_whose_components_do_not_fit_is_refused_at_load(dit, vae, text_width, message) -> None:
    """Configs Diffusers' pipeline fails on mid-generation (or gives a wrong size with) are refused when the
    folder loads, naming the keys: the pipeline built from a DiT made on the meta device and config-only VAE
    and text-encoder stand-ins (the checks read only configs, before any stage is built)."""
    with torch.device("meta"):
        transformer = QwenImage21Transformer2DModel.from_config({**FIT_DIT, **dit})
    vae_config = {**QWEN_IMAGE21_VAE_CONFIG_DEFAULTS, **vae}
    text_config = Qwen2_5_VLConfig(text_config={"hidden_size": text_width})
    values = {
        "transformer": transformer,
        "vae": SimpleNamespace(
            config=vae_config, spatial_compression_ratio=2 ** len(vae_config["temperal_downsample"])
        ),
        "text_encoder": SimpleNamespace(config=text_config),
        "scheduler": None,
    }
    components = {name: LoadedComponent(name, type(v).__name__, v) for name, v in values.items()}
    with pytest.raises(ModelLoadError, match=message):
        QwenImage21Pipeline(PipelineContext(components, CpuPlatform(), torch.float32))
