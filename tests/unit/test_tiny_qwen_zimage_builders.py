"""Tiny Qwen-Image / Qwen-Image-Edit(-Plus) / -Layered / Z-Image folders load and run in the Diffusers
pipelines.

Each builder's folder is loaded with the Diffusers pipeline class its model_index names and run for two
steps at a non-square size with classifier-free guidance on, so every component (tokenizer template,
text encoder, processor, DiT, VAE, scheduler config) is exercised the way the released models are.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from diffserve.families.qwen_image.tiny import (
    TinyQwenImageSpec,
    build_tiny_qwen_image,
    load_qwen_vl_processor,
)
from diffserve.families.z_image.tiny import build_tiny_zimage
from diffserve.testing.qwen_tokenizers import build_qwen_tokenizer

diffusers = pytest.importorskip("diffusers")

HEIGHT, WIDTH = 64, 48  # multiples of 16: VAE 8x times the DiT's 2x2 patches, in all three pipelines


def _input_image() -> Image.Image:
    pixels = np.random.default_rng(0).integers(0, 256, size=(40, 56, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _assert_real_image(image: Image.Image) -> None:
    assert image.size == (WIDTH, HEIGHT)
    array = np.asarray(image, dtype=np.float32)
    assert array.std() > 0.5, "output image is constant"


def test_tokenizer_template_prefixes_have_the_released_token_counts() -> None:
    """The pipelines drop 34 (Qwen-Image) / 64 (Edit) leading states: exactly the template's system part."""
    tok = build_qwen_tokenizer()
    t2i = (
        "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
        "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n"
    )
    edit = (
        "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, "
        "objects, background), then explain how the user's text instruction should alter or modify the image. "
        "Generate a new image that meets the user's requirements while maintaining consistency with the "
        "original input where appropriate.<|im_end|>\n<|im_start|>user\n"
    )
    assert len(tok(t2i)["input_ids"]) == 34
    assert len(tok(edit)["input_ids"]) == 64
    ids = tok(t2i + "a cat, 猫<|im_end|>")["input_ids"]
    assert tok.decode(ids[34:]) == "a cat, 猫<|im_end|>"
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "a cat"}],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=True,
    )
    assert chat == "<|im_start|>user\na cat<|im_end|>\n<|im_start|>assistant\n"
    no_think = tok.apply_chat_template(
        [{"role": "user", "content": "a cat"}],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=False,
    )
    assert no_think == chat + "<think>\n\n</think>\n\n"
    assert tok.pad_token == "<|endoftext|>" and tok.padding_side == "right"


def test_qwen_image_pipeline_runs(tmp_path) -> None:
    root = build_tiny_qwen_image(tmp_path / "qwen-image")
    index = json.loads((root / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImagePipeline" and "processor" not in index
    pipe = diffusers.QwenImagePipeline.from_pretrained(root)
    pipe.set_progress_bar_config(disable=True)
    assert pipe.transformer.config.joint_attention_dim == pipe.text_encoder.config.text_config.hidden_size
    assert pipe.vae_scale_factor == 8
    out = pipe(
        prompt="a red cat on a blue sofa",
        negative_prompt="blurry",
        true_cfg_scale=4.0,
        height=HEIGHT,
        width=WIDTH,
        num_inference_steps=2,
        generator=torch.Generator("cpu").manual_seed(0),
    )
    _assert_real_image(out.images[0])


@pytest.fixture
def small_edit_working_area(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scale the edit pipelines' fixed ~1 MP working area (input image resize and VAE encode) down 256x.

    The pipelines resize every input image to about 1024x1024 (aspect kept, sides multiples of 32)
    whatever the requested output size; VAE-encoding that with the causal-3D VAE dominates a CPU run
    (~5-10 s). Only the area changes: the resize logic, aspect handling and rounding are the pipelines' own.
    """
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit, pipeline_qwenimage_edit_plus

    for module in (pipeline_qwenimage_edit, pipeline_qwenimage_edit_plus):
        original = module.calculate_dimensions
        monkeypatch.setattr(
            module, "calculate_dimensions", lambda area, ratio, _orig=original: _orig(area / 256, ratio)
        )


@pytest.mark.usefixtures("small_edit_working_area")
@pytest.mark.parametrize(
    ("variant", "pipeline_class"),
    [("edit", "QwenImageEditPipeline"), ("edit_plus", "QwenImageEditPlusPipeline")],
)
def test_qwen_image_edit_pipelines_run(tmp_path, variant: str, pipeline_class: str) -> None:
    root = build_tiny_qwen_image(tmp_path / variant, TinyQwenImageSpec(variant=variant))
    assert json.loads((root / "model_index.json").read_text())["_class_name"] == pipeline_class
    # Without torchvision transformers cannot build Qwen2VLProcessor's video half, so the processor is
    # passed in; with torchvision this is the plain Qwen2VLProcessor.from_pretrained.
    pipe = getattr(diffusers, pipeline_class).from_pretrained(
        root, processor=load_qwen_vl_processor(root / "processor")
    )
    pipe.set_progress_bar_config(disable=True)
    out = pipe(
        image=_input_image(),
        prompt="make the sofa green",
        negative_prompt=" ",
        true_cfg_scale=4.0,
        height=HEIGHT,
        width=WIDTH,
        num_inference_steps=2,
        generator=torch.Generator("cpu").manual_seed(0),
    )
    _assert_real_image(out.images[0])


def test_qwen_image_layered_folder_runs_in_diffusers(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The layered variant: an RGBA VAE, the layer-aware DiT, a processor; Diffusers' pipeline decomposes an
    RGBA image into its layers (its ~640x640 working area scaled down 64x, as the edit pipelines' above)."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_layered

    original = pipeline_qwenimage_layered.calculate_dimensions
    monkeypatch.setattr(
        pipeline_qwenimage_layered, "calculate_dimensions", lambda area, ratio: original(area / 64, ratio)
    )
    root = build_tiny_qwen_image(tmp_path / "layered", TinyQwenImageSpec(variant="layered"))
    index = json.loads((root / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImageLayeredPipeline" and "processor" in index
    pipe = diffusers.QwenImageLayeredPipeline.from_pretrained(
        root, processor=load_qwen_vl_processor(root / "processor")
    )
    pipe.set_progress_bar_config(disable=True)
    assert pipe.vae.config.input_channels == 4
    assert pipe.transformer.config.use_layer3d_rope and pipe.transformer.config.use_additional_t_cond
    out = pipe(
        image=_input_image().convert("RGBA"),
        prompt="a red cat on a blue sofa",
        negative_prompt="blurry",
        true_cfg_scale=4.0,
        layers=2,
        num_inference_steps=2,
        generator=torch.Generator("cpu").manual_seed(0),
    )
    (layers,) = out.images
    assert len(layers) == 2 and all(layer.mode == "RGBA" for layer in layers)
    assert np.asarray(layers[0], dtype=np.float32).std() > 0.5, "output layer is constant"


def test_zimage_pipeline_runs(tmp_path) -> None:
    root = build_tiny_zimage(tmp_path / "zimage")
    pipe = diffusers.ZImagePipeline.from_pretrained(root)
    pipe.set_progress_bar_config(disable=True)
    assert pipe.transformer.config.cap_feat_dim == pipe.text_encoder.config.hidden_size
    assert not pipe.scheduler.config.use_dynamic_shifting and pipe.scheduler.config.shift == 3.0
    kwargs = dict(
        prompt="a red cat on a blue sofa",
        negative_prompt="blurry",
        height=HEIGHT,
        width=WIDTH,
        num_inference_steps=2,
        output_type="np",
    )
    guided = pipe(guidance_scale=4.0, generator=torch.Generator("cpu").manual_seed(0), **kwargs).images
    plain = pipe(guidance_scale=0.0, generator=torch.Generator("cpu").manual_seed(0), **kwargs).images
    assert guided.shape == (1, HEIGHT, WIDTH, 3)
    assert guided.std() > 1e-3, "output image is constant"
    assert np.abs(guided - plain).max() > 1e-4, "guidance had no effect"
