"""Whole Qwen-Image and Qwen-Image-Edit generations: diffserve against Diffusers, same folder and seed.

Diffusers' edit pipeline resizes the input image to ~1024x1024 pixels before encoding it; both
sides are run here with a smaller condition area (Diffusers' `calculate_dimensions` is wrapped, and
diffserve's pipeline config set to the same area) so the tiny checkpoint's test stays fast.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline, QwenImagePipeline
from PIL import Image
from transformers import Qwen2_5_VLConfig

from diffserve import DiffGenerator
from diffserve.errors import InvalidRequestError, ModelLoadError
from diffserve.families.qwen_image import layered
from diffserve.families.qwen_image import pipeline as qwen_pipelines
from diffserve.families.qwen_image.config import QwenImageEditPipelineConfig, QwenImageEditPlusPipelineConfig
from diffserve.families.qwen_image.tiny import (
    build_tiny_qwen_image,
    build_tiny_qwen_image_edit,
    build_tiny_qwen_image_edit_plus,
    load_qwen_vl_processor,
)
from diffserve.loader.component_loader import LoadedComponent
from diffserve.models.dits.qwen_image import QwenImageTransformer2DModel
from diffserve.models.vaes.autoencoder_kl_qwen_image import QWEN_IMAGE_VAE_CONFIG_DEFAULTS
from diffserve.pipelines.base import PipelineContext
from diffserve.platforms.cpu import CpuPlatform
from diffserve.testing.image_metrics import psnr_uint8 as psnr
from diffserve.testing.parity import (
    assert_generation_matches,
    assert_images_match,
    diffusers_uint8,
    generator_and_reference,
    stack_uint8,
)

PSNR_BAR_DB = 40.0
CONDITION_AREA = 96 * 64
PROMPT = "a red fox in the snow"


class _CountingForward:
    """Wraps a module's forward to count DiT calls (one per step means CFG branches were batched)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.calls = 0
        self._forward = module.forward
        module.forward = self

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self._forward(*args, **kwargs)


@pytest.fixture(scope="module")
def t2i(tmp_path_factory):
    root = build_tiny_qwen_image(tmp_path_factory.mktemp("qwen-image"))
    return generator_and_reference(DiffGenerator, root, QwenImagePipeline)


@pytest.mark.parametrize(
    ("height", "width", "steps", "extra"),
    [
        (64, 48, 3, {"true_cfg_scale": 4.0, "negative_prompt": "blurry"}),  # true CFG, non-square
        (48, 80, 2, {"true_cfg_scale": 1.0}),  # no CFG, non-square
        (32, 32, 2, {"true_cfg_scale": 2.5, "negative_prompt": " ", "num_outputs_per_prompt": 2}),
    ],
)
def test_qwen_image_pixels_match_diffusers(t2i, height, width, steps, extra) -> None:
    ours, reference = t2i
    kwargs = dict(height=height, width=width, num_inference_steps=steps, max_sequence_length=64, **extra)
    label = f"Qwen-Image {height}x{width} {extra}"
    assert_generation_matches(ours, reference, label, min_db=PSNR_BAR_DB, prompt=PROMPT, seed=3, **kwargs)


def test_qwen_image_cfg_changes_the_image_and_runs_one_forward_per_step(t2i) -> None:
    """True CFG must matter (else the CFG parity above proves nothing) and cost one DiT call per step."""
    ours, _ = t2i
    kwargs = dict(height=32, width=48, num_inference_steps=3, seed=1)
    counter = _CountingForward(ours.pipeline.context.get("transformer"))
    guided = ours.generate(prompt=PROMPT, true_cfg_scale=5.0, negative_prompt="ugly", **kwargs)
    assert counter.calls == 3, "positive and negative branches should share one forward per step"
    plain = ours.generate(prompt=PROMPT, true_cfg_scale=1.0, **kwargs)
    assert psnr(stack_uint8(guided.images), stack_uint8(plain.images)) < 35


def test_qwen_image_text_encoding_matches_diffusers(t2i) -> None:
    ours, reference = t2i
    stage = next(s for s in ours.pipeline.stages if s.name == "QwenTextEncodingStage")
    prompts = ["a red fox", "a much longer prompt about a blue bird on a branch"]
    embeds = stage.encode(prompts)
    for prompt, ours_embeds in zip(prompts, embeds, strict=True):
        ref_embeds, ref_mask = reference.encode_prompt(prompt=prompt, device=torch.device("cpu"))
        assert ref_mask is None  # one prompt: Diffusers drops the all-ones mask
        assert ours_embeds.shape == ref_embeds[0].shape
        torch.testing.assert_close(ours_embeds, ref_embeds[0], rtol=1e-5, atol=1e-5)


def test_qwen_image_rejects_guidance_scale(t2i) -> None:
    ours, _ = t2i
    with pytest.raises(InvalidRequestError, match="guidance_scale.*true_cfg_scale") as info:
        ours.generate(prompt=PROMPT, guidance_scale=4.0, height=32, width=32, num_inference_steps=1)
    assert info.value.param == "guidance_scale"


@pytest.fixture(scope="module")
def edit(tmp_path_factory):
    root = build_tiny_qwen_image_edit(tmp_path_factory.mktemp("qwen-image-edit"))
    patch = pytest.MonkeyPatch()
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit as diffusers_edit

    full_area = diffusers_edit.calculate_dimensions
    patch.setattr(
        diffusers_edit, "calculate_dimensions", lambda area, ratio: full_area(CONDITION_AREA, ratio)
    )
    patch.setattr(
        qwen_pipelines.QwenImageEditPipeline,
        "config",
        QwenImageEditPipelineConfig(condition_image_area=CONDITION_AREA),
    )
    ours = DiffGenerator.from_pretrained(root, device="cpu", show_progress=False)
    reference = QwenImageEditPipeline.from_pretrained(
        root, torch_dtype=torch.float32, processor=load_qwen_vl_processor(root / "processor")
    )
    yield ours, reference
    patch.undo()


def _input_image(height: int, width: int, seed: int = 0) -> Image.Image:
    """A smooth image with structure (gradients plus blocks), so the VAE sees more than noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x / width, y / height, (x + y) / (width + height)], axis=-1) * 200
    blocks = (
        rng.integers(0, 55, (height // 8 + 1, width // 8 + 1, 3)).repeat(8, 0).repeat(8, 1)[:height, :width]
    )
    return Image.fromarray((base + blocks).astype(np.uint8))


@pytest.mark.parametrize(
    ("size", "extra"),
    [
        ((60, 90), {"true_cfg_scale": 4.0, "negative_prompt": "blurry"}),  # wide input, true CFG
        ((100, 70), {"true_cfg_scale": 1.0}),  # tall input, no CFG
        # Diffusers' edit pipelines never cut the states to max_sequence_length (vision tokens included)
        ((60, 90), {"true_cfg_scale": 1.0, "max_sequence_length": 4}),
    ],
)
def test_qwen_image_edit_pixels_match_diffusers(edit, size, extra) -> None:
    ours, reference = edit
    image = _input_image(*size)
    kwargs = {"num_inference_steps": 3, "max_sequence_length": 64, **extra}
    out = ours.generate(prompt="make the sky red", image=image, seed=5, **kwargs)
    ref_u8 = diffusers_uint8(reference, seed=5, prompt="make the sky red", image=image, **kwargs)
    ours_u8 = stack_uint8(out.images)
    height, width = ours_u8.shape[1:3]
    # The output follows the input's aspect ratio (within the 32-pixel rounding of each side).
    assert abs(width / height - size[1] / size[0]) < 0.35
    label = f"Qwen-Image-Edit input {size} -> {height}x{width} {extra}"
    assert_images_match(ours_u8, ref_u8, label, min_db=PSNR_BAR_DB)


@pytest.mark.parametrize("size", [(8, 200), (200, 8)])
def test_qwen_image_edit_refuses_an_image_too_elongated_to_resize(edit, size) -> None:
    """Resized to the condition area with sides rounded to 32, one side would be 0 pixels (Diffusers fails
    in PIL's resize): a 400 naming the image, before any model work, whether a size is given or not."""
    ours, _ = edit
    for extra in ({}, {"height": 32, "width": 32}):
        with pytest.raises(InvalidRequestError, match="input image 1 .* is too elongated") as info:
            ours.generate(prompt="make it red", image=_input_image(*size), num_inference_steps=1, **extra)
        assert info.value.param == "image"


def test_qwen_image_edit_needs_an_image_and_refuses_a_mask(edit) -> None:
    ours, _ = edit
    with pytest.raises(InvalidRequestError, match="needs an input image") as info:
        ours.generate(prompt="make it red", num_inference_steps=1)
    assert info.value.param == "image"
    image = _input_image(32, 32)
    with pytest.raises(InvalidRequestError, match="mask is not supported") as info:
        ours.generate(prompt="make it red", image=image, mask=image, num_inference_steps=1)
    assert info.value.param == "mask"


VISION_AREA = 56 * 84


@pytest.fixture(scope="module")
def edit_plus(tmp_path_factory):
    root = build_tiny_qwen_image_edit_plus(tmp_path_factory.mktemp("qwen-image-edit-plus"))
    patch = pytest.MonkeyPatch()
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as diffusers_plus

    full_area = diffusers_plus.calculate_dimensions
    patch.setattr(diffusers_plus, "VAE_IMAGE_SIZE", CONDITION_AREA)
    patch.setattr(diffusers_plus, "CONDITION_IMAGE_SIZE", VISION_AREA)
    # The default output size is computed from a literal 1024 * 1024 area; map it to the same small one.
    patch.setattr(
        diffusers_plus,
        "calculate_dimensions",
        lambda area, ratio: full_area(CONDITION_AREA if area == 1024 * 1024 else area, ratio),
    )
    patch.setattr(
        qwen_pipelines.QwenImageEditPlusPipeline,
        "config",
        QwenImageEditPlusPipelineConfig(condition_image_area=CONDITION_AREA, vision_image_area=VISION_AREA),
    )
    ours = DiffGenerator.from_pretrained(root, device="cpu", show_progress=False)
    reference = QwenImageEditPlusPipeline.from_pretrained(
        root, torch_dtype=torch.float32, processor=load_qwen_vl_processor(root / "processor")
    )
    yield ours, reference
    patch.undo()


@pytest.mark.parametrize("num_images", [1, 2])
def test_qwen_image_edit_plus_pixels_match_diffusers(edit_plus, num_images) -> None:
    ours, reference = edit_plus
    images = [_input_image(60, 90, seed=1), _input_image(80, 64, seed=2)][:num_images]
    kwargs = dict(num_inference_steps=2, true_cfg_scale=4.0, negative_prompt=" ", max_sequence_length=128)
    out = ours.generate(prompt="put the two together", image=images, seed=7, **kwargs)
    ref_u8 = diffusers_uint8(reference, seed=7, prompt="put the two together", image=images, **kwargs)
    ours_u8 = stack_uint8(out.images)
    label = f"Qwen-Image-Edit-Plus with {num_images} image(s) -> {ours_u8.shape[1:3]}"
    assert_images_match(ours_u8, ref_u8, label, min_db=PSNR_BAR_DB)


#: A tiny DiT that fits the tiny text encoder (32 wide) and the released VAE config; each refusal case
#: changes a config key.
FIT_DIT = {"num_layers": 1, "num_attention_heads": 2, "attention_head_dim": 16, "joint_attention_dim": 32,
           "axes_dims_rope": [4, 6, 6]}  # fmt: skip


def _build_on_meta(pipeline_cls, dit: dict, vae: dict, text_width: int):
    """`pipeline_cls` built from a DiT made on the meta device from FIT_DIT updated by `dit`, a VAE stand-in
    with the released config updated by `vae`, and a text encoder stand-in `text_width` wide: the folder
    checks read only configs, and run before any stage is built."""
    with torch.device("meta"):
        transformer = QwenImageTransformer2DModel.from_config({**FIT_DIT, **dit})
    text_config = Qwen2_5_VLConfig(text_config={"hidden_size": text_width})
    values = {
        "transformer": transformer,
        "vae": SimpleNamespace(config={**QWEN_IMAGE_VAE_CONFIG_DEFAULTS, **vae}),
        "text_encoder": SimpleNamespace(config=text_config),
        "scheduler": None,
    }
    components = {name: LoadedComponent(name, type(v).__name__, v) for name, v in values.items()}
    return pipeline_cls(PipelineContext(components, CpuPlatform(), torch.float32))


@pytest.mark.parametrize(
    ("pipeline_cls", "dit", "vae", "text_width", "message"),
    [
        # Diffusers packs 2x2 latent patches whatever the DiT's patch_size: a shape error at the first step
        (qwen_pipelines.QwenImagePipeline, {"patch_size": 1}, {}, 32, "patch_size=1"),
        # out_channels null means in_channels (64): a 64-channel prediction of 16-channel latents
        (
            qwen_pipelines.QwenImagePipeline,
            {"out_channels": None},
            {},
            32,
            "in_channels=64 is not 4 x out_channels=64",
        ),
        (
            qwen_pipelines.QwenImagePipeline,
            {"in_channels": 32, "out_channels": 8},
            {},
            32,
            "the VAE's z_dim=16",
        ),
        (qwen_pipelines.QwenImagePipeline, {}, {"latents_std": [1.0] * 8}, 32, "latents_std has 8 entries"),
        # Diffusers' VAE scale is 2 ** len(temperal_downsample): 4x latents of a VAE with three levels (8x)
        (qwen_pipelines.QwenImagePipeline, {}, {"temperal_downsample": [False, True]}, 32, "one entry per"),
        (qwen_pipelines.QwenImagePipeline, {}, {}, 48, "joint_attention_dim=32 differs .* hidden_size=48"),
        # only Diffusers' Layered pipeline passes additional_t_cond
        (
            qwen_pipelines.QwenImageEditPipeline,
            {"use_additional_t_cond": True},
            {},
            32,
            "use_additional_t_cond",
        ),
        # the Edit pipelines encode RGB images, Layered RGBA ones
        (qwen_pipelines.QwenImageEditPlusPipeline, {}, {"input_channels": 4}, 32, "input_channels=4"),
        (layered.QwenImageLayeredPipeline, {}, {}, 32, "input_channels=3: QwenImageLayeredPipeline"),
    ],
)
def test_a_folder_whose_components_do_not_fit_is_refused_at_load(
    pipeline_cls, dit, vae, text_width, message
) -> None:
    """Configs Diffusers' pipelines fail on mid-generation (a shape error) are refused when the folder loads,
    naming the keys (they ran into a torch shape error deep in the first request before)."""
    with pytest.raises(ModelLoadError, match=message):
        _build_on_meta(pipeline_cls, dit, vae, text_width)
