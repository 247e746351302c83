"""LoRA parity with Diffusers for Qwen-Image 2.1, CogVideoX (1.0 text-to-video, 1.5 image-to-video) and
Mochi 1: whole generations of diffserve (`load_lora` + per-request `loras=[...]`) against Diffusers'
pipeline (`load_lora_weights` + `set_adapters(names, weights)`), same tiny folder, seed and size, float32.

Per family: one Diffusers/PEFT-format LoRA at scale 0.8 on every Linear of the DiT (embedders and head
included) whose metadata sets alpha != rank; two LoRAs at different scales (the second on the blocks
only, no metadata: alpha = rank); for Qwen-Image 2.1, whose Diffusers loader is Qwen-Image's
(`QwenImageLoraLoaderMixin`), the non-Diffusers layouts it converts (kohya `lora_unet_` keys and
original-checkpoint `diffusion_model.` keys, per-module `.alpha` != rank). Each at PSNR >= 40 dB and
each changing the output far more than that (else the comparison would prove nothing); and after all
that, a request without LoRA equals diffserve's own output from before any adapter was loaded, bit for
bit, and Diffusers' base output. Every generation uses CFG, so the adapters run on two-row batches.
CogVideoX's and Mochi's Diffusers loaders (`CogVideoXLoraLoaderMixin`, `Mochi1LoraLoaderMixin`) convert
no other layout: such files are refused, as `test_non_diffusers_layouts_are_refused` checks.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import CogVideoXImageToVideoPipeline, CogVideoXPipeline, MochiPipeline
from diffusers import QwenImage21Pipeline as DiffusersQwenImage21
from diffusers.pipelines.pipeline_utils import DiffusionPipeline
from lora_suite_tests import engines_fixture, generation_test, no_lora_after_loras_test

from diffserve import DiffGenerator, SamplingParams
from diffserve.configs.sampling_params import LoraChoice
from diffserve.errors import LoraError
from diffserve.families.cogvideox.tiny import TinyCogVideoXSpec, build_tiny_cogvideox
from diffserve.families.mochi.tiny import build_tiny_mochi
from diffserve.families.qwen_image21.tiny import build_tiny_qwen_image21
from diffserve.loader.processors import load_image_text_processor
from diffserve.testing.lora_parity import (
    PROMPT,
    SEED,
    Engines,
    Family,
    Suite,
    check_adapter_matches,
    write_original,
)
from diffserve.testing.parity import gradient_image, stack_uint8
from diffserve.testing.tiny_lora import dit_linears
from diffserve.testing.tiny_lora_original import FileModule, Layout, Suffix

EVERY_LINEAR = re.compile("")


def _every_linear(root: Path) -> list[FileModule]:
    """Every Linear of the folder's DiT, by Diffusers module path."""
    return [FileModule(name, o, i) for name, (o, i) in dit_linears(root).items()]


#: Qwen-Image 2.1 Linears whose kohya names Diffusers' converter (Qwen-Image's protected n-grams) splits
#: wrongly, so that it refuses a file holding them (ValueError): the parity test's kohya file leaves them
#: out; `test_qwen21_kohya_names_diffusers_splits_wrongly_land_on_their_modules` checks them.
_QWEN21_KOHYA_MISSPLIT = re.compile(r"(^|\.)(img_mlp\.gate_layer|txt_in\.(in|out)_layer|modulation\.1)$")


def _qwen21_files(root: Path, out: Path) -> dict[str, Path]:
    """Qwen-Image 2.1's original code uses Diffusers' module names: `diffusion_model.` files name every
    Linear as Diffusers does; kohya files join them with underscores."""
    modules = _every_linear(root)
    kohya = [m for m in modules if not _QWEN21_KOHYA_MISSPLIT.search(m.name)]
    return {
        "kohya": write_original(kohya, out / "kohya.safetensors", Layout.KOHYA, Suffix.DOWN_UP, seed=11),
        "diffusion_model": write_original(
            modules, out / "dm.safetensors", Layout.DIFFUSION_MODEL, Suffix.A_B, seed=12
        ),
    }


def _qwen21_reference(root: Path) -> DiffusionPipeline:
    """Diffusers' pipeline, given the processor diffserve loads (transformers builds a Qwen3-VL processor
    only with torchvision) with the folder's chat template."""
    processor = load_image_text_processor("Qwen3VLProcessor", root / "processor")
    processor.chat_template = (root / "processor" / "chat_template.jinja").read_text()
    return DiffusersQwenImage21.from_pretrained(root, processor=processor, dtype=torch.float32)


FAMILIES: dict[str, Family] = {
    "qwen-image-2.1": Family(
        build_tiny_qwen_image21,
        _qwen21_reference,
        dict(height=32, width=64, num_inference_steps=2, true_cfg_scale=4.0, negative_prompt="blurry"),
        original_files=_qwen21_files,
        originals=("kohya", "diffusion_model"),
    ),
    "cogvideox-t2v": Family(
        build_tiny_cogvideox,
        lambda root: CogVideoXPipeline.from_pretrained(root, dtype=torch.float32),
        dict(height=32, width=48, num_frames=5, num_inference_steps=2, guidance_scale=6.0, negative_prompt="blurry"),
        video=True,
    ),
    # CogVideoX 1.5 I2V: the ofs embedding and the Linear patch embedder
    "cogvideox-1.5-i2v": Family(
        lambda out: build_tiny_cogvideox(out, TinyCogVideoXSpec(variant="1.5", image_to_video=True)),
        lambda root: CogVideoXImageToVideoPipeline.from_pretrained(root, dtype=torch.float32),
        dict(
            height=32, width=48, num_frames=9, num_inference_steps=2, guidance_scale=6.0,
            image=gradient_image(width=60, height=40),
        ),
        video=True,
    ),
    "mochi": Family(
        build_tiny_mochi,
        lambda root: MochiPipeline.from_pretrained(root, dtype=torch.float32),
        dict(height=32, width=32, num_frames=7, num_inference_steps=2, guidance_scale=4.5, negative_prompt="blurry"),
        video=True,
    ),
}  # fmt: skip

# adapter "a" on every Linear of the DiT (embedders and head included), "b" on the blocks only;
# the shared-batch test needs the throughput batch policy
SUITE = Suite(
    DiffGenerator, FAMILIES, a_pattern=EVERY_LINEAR, generator_kwargs=dict(batch_policy="throughput")
)


engines_of = engines_fixture(SUITE)
test_lora_generation_matches_diffusers = generation_test(SUITE)
test_no_lora_after_loras_is_the_base_bit_for_bit = no_lora_after_loras_test(SUITE)


@pytest.mark.parametrize("family", ["cogvideox-t2v", "mochi"])
@pytest.mark.parametrize("layout", [Layout.KOHYA, Layout.DIFFUSION_MODEL])
def test_non_diffusers_layouts_are_refused(
    engines_of: Callable[[str], Engines], family: str, layout: Layout, tmp_path: Path
) -> None:
    """CogVideoX's and Mochi's Diffusers loaders convert no kohya or `diffusion_model.` file."""
    engines = engines_of(family)
    modules = _every_linear(engines.root)
    path = write_original(modules, tmp_path / "original.safetensors", layout, Suffix.DOWN_UP, seed=13)
    dit_class = type(engines.ours.pipeline.context.get("transformer")).diffusers_class_name
    with pytest.raises(
        LoraError, match=f"{layout.value}-format LoRA files are not supported for {dit_class}"
    ):
        engines.ours.load_lora("original", path)


def test_qwen21_kohya_names_diffusers_splits_wrongly_land_on_their_modules(
    engines_of: Callable[[str], Engines], tmp_path: Path
) -> None:
    """Diffusers' Qwen-Image n-grams split four Qwen-Image 2.1 kohya names wrongly (`img_mlp_gate_layer`,
    `txt_in_in_layer`, `txt_in_out_layer`, `modulation_1`; it refuses a file that holds them), diffserve's
    table right: a kohya file over every Linear gives what Diffusers gives for the same tensors under
    `diffusion_model.` names."""
    engines = engines_of("qwen-image-2.1")
    modules = _every_linear(engines.root)
    assert sum(bool(_QWEN21_KOHYA_MISSPLIT.search(m.name)) for m in modules) == 3 + 2  # 2 blocks' gate_layer
    kohya = write_original(modules, tmp_path / "kohya_all.safetensors", Layout.KOHYA, Suffix.DOWN_UP, seed=14)
    twin = write_original(
        modules, tmp_path / "dm_all.safetensors", Layout.DIFFUSION_MODEL, Suffix.DOWN_UP, seed=14
    )
    engines.ours.load_lora("kohya_all", kohya)
    engines.reference.load_lora_weights(str(twin), adapter_name="dm_all")
    ours = engines.run_ours((("kohya_all", 0.7),))
    reference = engines.run_reference((("dm_all", 0.7),))
    check_adapter_matches(engines, ours, reference, "qwen-image-2.1 kohya over every Linear")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_requests_with_different_adapters_share_a_batch_and_each_equals_its_own_run(
    engines_of: Callable[[str], Engines], family: str
) -> None:
    """Three requests (CFG: two rows each) with adapter "a" (every Linear: also the timestep embedders,
    Qwen-Image 2.1's modulation shared by its blocks and CogVideoX 1.5-I2V's ofs embedding), with "a" and
    "b", and with none, denoised in shared DiT batches: each row applies its own adapters, so each request
    gives what it gives alone (within 1: a batched matmul may round a pixel the other way)."""
    engines = engines_of(family)
    sets = [[LoraChoice("a", 0.8)], [LoraChoice("a", 0.8), LoraChoice("b", -0.5)], []]
    prompts = [PROMPT, "a blue bird", "a green tree"]
    request = dict(engines.family.request)
    if "image" in request:  # `generate`'s argument; the field is a list of images
        request["input_images"] = [request.pop("image")]
    params = [
        SamplingParams(prompt=p, seed=SEED, loras=loras, **request)
        for p, loras in zip(prompts, sets, strict=True)
    ]
    video = engines.family.video

    def pixels(output) -> np.ndarray:
        return stack_uint8(output.frames if video else output.images)

    alone = [pixels(engines.ours.generate_from_params(p)) for p in params]
    counts = engines.ours.engine.scheduler.batch_size_counts
    shared_before = sum(n for size, n in counts.items() if size >= 2)
    together = [pixels(out) for out in engines.ours.generate_many(params)]
    assert sum(n for size, n in counts.items() if size >= 2) > shared_before, "no DiT batch was shared"
    for got, want, loras in zip(together, alone, sets, strict=True):
        diff = int(np.abs(got.astype(np.int16) - want.astype(np.int16)).max())
        print(f"{family} {[c.name for c in loras]}: batched vs alone max diff {diff}")
        assert diff <= 1
