"""LoRA parity with Diffusers for HunyuanVideo (text- and image-to-video) and HiDream-I1: whole generations
of diffserve (`load_lora` + per-request `loras=[...]`) against Diffusers' pipeline (`load_lora_weights` +
`set_adapters(names, weights)`), same tiny folder, seed and size, float32.

Per family: one Diffusers/PEFT-format LoRA at scale 0.8 whose metadata sets alpha != rank; two LoRAs at
different scales; HiDream's `diffusion_model.` files (Diffusers' names under that prefix); each at
PSNR >= 40 dB and each changing the output far more than that (else the comparison would prove nothing);
after all that, a request without LoRA equals diffserve's own output from before any adapter was loaded,
bit for bit. Every generation uses CFG, so the adapters run on two-row batches.

HunyuanImage 2.1 has no LoRA here: Diffusers' `HunyuanImagePipeline` has no LoRA loader; its refusal is
tested, as are the files HunyuanVideo (original checkpoint names) and HiDream (routed MoE experts)
refuse.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import HiDreamImagePipeline, HunyuanVideoImageToVideoPipeline, HunyuanVideoPipeline
from diffusers.pipelines.pipeline_utils import DiffusionPipeline
from safetensors.torch import load_file, save_file

from diffserve import DiffGenerator
from diffserve.errors import LoraError
from diffserve.families.hidream.tiny import build_tiny_hidream
from diffserve.families.hunyuan_image.tiny import build_tiny_hunyuan_image
from diffserve.families.hunyuan_video.image_to_video_tiny import build_tiny_hunyuan_video_i2v
from diffserve.families.hunyuan_video.tiny import build_tiny_hunyuan_video
from diffserve.testing import tiny_lora
from diffserve.testing.image_metrics import psnr_uint8 as psnr
from diffserve.testing.parity import assert_images_match, diffusers_uint8, smooth_random_image, stack_uint8

PSNR_BAR_DB = 40.0
#: A LoRA output must be further than this from the base output (and the second adapter's output from
#: the first's alone), so that matching Diffusers at PSNR_BAR_DB shows the adapter was applied right.
CHANGED_BAR_DB = 32.0
PROMPT = "a red fox in the snow"
SEED = 3
RANK = 4
STD = 0.2  # of the random LoRA factors: large enough that every adapter visibly changes the output
ONE = (("a", 0.8),)
TWO = (("a", 0.8), ("b", 0.5))
#: Every Linear of the repeated blocks: HunyuanVideo's double- and single-stream blocks; HiDream's
#: (`double_stream_blocks.0.block.…`) but its routed MoE experts, on which adapters are refused.
BLOCKS = re.compile(
    r"(^|\.)(transformer_blocks|single_transformer_blocks|\w+_stream_blocks)\.\d+\.(?!block\.ff_i\.experts\.)"
)
ROUTED_EXPERTS = re.compile(r"\.ff_i\.experts\.\d+\.")


def _write_lora(root: Path, out: Path, pattern: re.Pattern[str] = BLOCKS, **kwargs) -> Path:
    """`write_random_lora` over these families' DiTs."""
    return tiny_lora.write_random_lora(root, out, pattern=pattern, **kwargs)


def _diffusion_model_file(root: Path, out: Path, pattern: re.Pattern[str] = BLOCKS) -> Path:
    """A `diffusion_model.`-prefixed file (ComfyUI / ai-toolkit style: Diffusers' module names), which
    Diffusers' HiDream loader reads by stripping the prefix; without `.alpha` tensors (alpha = rank), which
    that loader refuses (every key must name `lora`)."""
    peft = load_file(
        str(
            _write_lora(
                root, out.with_suffix(".peft.safetensors"), pattern, rank=RANK, seed=12, std=1.5 * STD
            )
        )
    )
    tensors = {f"diffusion_model.{key.removeprefix('transformer.')}": t for key, t in peft.items()}
    save_file(tensors, str(out))
    return out


@dataclass(frozen=True)
class Family:
    """How to build, run and LoRA-load one family; `request`: generation arguments both sides take."""

    build: Callable[[Path], Path]
    reference: type[DiffusionPipeline]
    request: dict[str, object]
    #: the family's non-Diffusers files, by name (the test ids)
    originals: tuple[str, ...] = ()
    video: bool = False
    #: diffserve's name of an input image argument Diffusers calls `image`
    image: object = None


FAMILIES: dict[str, Family] = {
    "hunyuan-video": Family(
        build_tiny_hunyuan_video,
        HunyuanVideoPipeline,
        dict(
            height=32, width=48, num_frames=5, num_inference_steps=2, max_sequence_length=40,
            guidance_scale=3.5, true_cfg_scale=4.0, negative_prompt="blurry",
        ),
        video=True,
    ),
    "hunyuan-video-i2v": Family(
        build_tiny_hunyuan_video_i2v,
        HunyuanVideoImageToVideoPipeline,
        dict(
            height=32, width=48, num_frames=5, num_inference_steps=2, max_sequence_length=40,
            guidance_scale=3.5, true_cfg_scale=4.0, negative_prompt="blurry",
        ),
        video=True,
        image=smooth_random_image(width=40, height=30, seed=1),
    ),
    "hidream": Family(
        build_tiny_hidream,
        HiDreamImagePipeline,
        dict(
            height=32, width=32, num_inference_steps=2, max_sequence_length=24,
            guidance_scale=5.0, negative_prompt="blurry",
        ),
        originals=("diffusion_model",),
    ),
}  # fmt: skip

Loras = tuple[tuple[str, float], ...]


@dataclass
class Engines:
    """One family's two pipelines with every adapter loaded, and diffserve's base output taken before
    any adapter was; diffserve's LoRA outputs are kept per adapter set (each is generated once)."""

    family: Family
    root: Path
    ours: DiffGenerator
    reference: DiffusionPipeline
    ours_base: np.ndarray
    _ours_outputs: dict[Loras, np.ndarray] = field(default_factory=dict)

    def run_ours(self, loras: Loras) -> np.ndarray:
        if loras not in self._ours_outputs:
            self._ours_outputs[loras] = _generate(self.ours, self.family, loras)
        return self._ours_outputs[loras]

    def run_reference(self, loras: Loras) -> np.ndarray:
        names = [name for name, _ in loras]
        self.reference.set_adapters(names, adapter_weights=[scale for _, scale in loras])
        image = {} if self.family.image is None else {"image": self.family.image}
        return diffusers_uint8(
            self.reference, seed=SEED, video=self.family.video, prompt=PROMPT, **image, **self.family.request
        )


def _generate(ours: DiffGenerator, family: Family, loras: Loras) -> np.ndarray:
    image = {} if family.image is None else {"input_images": [family.image]}
    out = ours.generate(
        prompt=PROMPT, seed=SEED, loras=[{"name": n, "scale": s} for n, s in loras], **image, **family.request
    )
    return stack_uint8(out.frames if family.video else out.images)


def _start(name: str, directory: Path) -> Engines:
    """Build `name`'s folder and LoRA files under `directory`, both pipelines and diffserve's base
    output, then load every adapter into both."""
    family = FAMILIES[name]
    root = family.build(directory / "model")
    loras = directory / "loras"
    files = {
        # PEFT layout, alpha 8 != rank 4 in `lora_adapter_metadata` (scaling 2)
        "a": _write_lora(root, loras / "a.safetensors", rank=RANK, alpha=8.0, seed=1, std=STD),
        # rank 2, no metadata: alpha = rank (larger factors, so that its share of TWO is large too)
        "b": _write_lora(root, loras / "b.safetensors", rank=2, seed=2, std=1.5 * STD),
    }
    if "diffusion_model" in family.originals:
        files["diffusion_model"] = _diffusion_model_file(root, loras / "dm.safetensors")
    ours = DiffGenerator.from_pretrained(root, device="cpu", show_progress=False)
    reference = family.reference.from_pretrained(root, torch_dtype=torch.float32)
    reference.set_progress_bar_config(disable=True)
    engines = Engines(family, root, ours, reference, _generate(ours, family, ()))
    for adapter, path in files.items():
        ours.load_lora(adapter, path)
        reference.load_lora_weights(str(path), adapter_name=adapter)
    return engines


@pytest.fixture(scope="module")
def engines_of(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Engines]]:
    """A family's `Engines`, started on first use and kept for the module."""
    started: dict[str, Engines] = {}

    def get(name: str) -> Engines:
        if name not in started:
            started[name] = _start(name, tmp_path_factory.mktemp(name))
        return started[name]

    yield get
    for engines in started.values():
        engines.ours.close()


def _cases() -> list:
    cases = []
    for name, family in FAMILIES.items():
        cases.append(pytest.param(name, ONE, id=f"{name}-one"))
        cases.append(pytest.param(name, TWO, id=f"{name}-two"))
        cases.extend(pytest.param(name, ((o, 0.7),), id=f"{name}-{o}") for o in family.originals)
    return cases


@pytest.mark.parametrize(("family", "loras"), _cases())
def test_lora_generation_matches_diffusers(
    engines_of: Callable[[str], Engines], family: str, loras: Loras
) -> None:
    engines = engines_of(family)
    ours = engines.run_ours(loras)
    reference = engines.run_reference(loras)
    assert ours.shape == reference.shape == engines.ours_base.shape
    changed = psnr(ours, engines.ours_base)
    print(f"{family} {loras}: {changed:.2f} dB against the base output")
    assert changed < CHANGED_BAR_DB, "the adapters barely change the output: the comparison proves nothing"
    assert_images_match(ours, reference, f"{family} {loras} against Diffusers", min_db=PSNR_BAR_DB)
    if len(loras) > 1:
        alone = psnr(ours, engines.run_ours(loras[:1]))
        print(f"  against {loras[0][0]} alone: {alone:.2f} dB")
        assert alone < CHANGED_BAR_DB, "the second adapter barely changes the output"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_no_lora_after_loras_is_the_base_bit_for_bit(
    engines_of: Callable[[str], Engines], family: str
) -> None:
    engines = engines_of(family)
    engines.run_ours(TWO)
    after = _generate(engines.ours, engines.family, ())
    assert np.array_equal(after, engines.ours_base)


def test_hunyuan_image_refuses_lora(tmp_path: Path) -> None:
    """Diffusers' `HunyuanImagePipeline` loads no LoRA: diffserve refuses one naming the DiT."""
    assert not hasattr(__import__("diffusers").HunyuanImagePipeline, "load_lora_weights")
    root = build_tiny_hunyuan_image(tmp_path / "model")
    lora = _write_lora(root, tmp_path / "a.safetensors", rank=RANK, seed=1)
    gen = DiffGenerator.from_pretrained(root, device="cpu", show_progress=False)
    try:
        with pytest.raises(LoraError, match="not supported for HunyuanImageTransformer2DModel"):
            gen.load_lora("a", lora)
    finally:
        gen.close()


@pytest.mark.parametrize("layout", ["diffusers", "diffusion_model"])
def test_hidream_lora_on_routed_experts_is_refused(
    engines_of: Callable[[str], Engines], tmp_path: Path, layout: str
) -> None:
    """Diffusers applies these; diffserve refuses them at load, naming the keys (the routed experts run
    on tokens gathered across the batch, which per-request adapters cannot tell apart by row)."""
    engines = engines_of("hidream")
    root = engines.root
    out = tmp_path / f"{layout}.safetensors"
    path = (
        _write_lora(root, out, ROUTED_EXPERTS, rank=RANK, seed=5)
        if layout == "diffusers"
        else _diffusion_model_file(root, out, ROUTED_EXPERTS)
    )
    with pytest.raises(LoraError, match=r"routed MoE experts .*ff_i\.experts\.0\.w1"):
        engines.ours.load_lora("experts", path)


@pytest.mark.parametrize("prefix", ["diffusion_model.", "transformer.", ""])
def test_hunyuan_video_original_names_are_refused(
    engines_of: Callable[[str], Engines], tmp_path: Path, prefix: str
) -> None:
    """Original-checkpoint names (diffusion-pipe's files), which Diffusers converts, are refused with
    that reason rather than as another family's file."""
    engines = engines_of("hunyuan-video")
    g = torch.Generator().manual_seed(0)
    tensors = {
        f"{prefix}double_blocks.0.img_attn_qkv.lora_A.weight": torch.randn(RANK, 64, generator=g),
        f"{prefix}double_blocks.0.img_attn_qkv.lora_B.weight": torch.randn(192, RANK, generator=g),
    }
    path = tmp_path / "original.safetensors"
    save_file(tensors, str(path))
    with pytest.raises(LoraError, match=r"original checkpoint's names .*img_attn_qkv"):
        engines.ours.load_lora("original", path)
