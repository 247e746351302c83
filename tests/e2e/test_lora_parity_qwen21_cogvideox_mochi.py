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

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import CogVideoXImageToVideoPipeline, CogVideoXPipeline, MochiPipeline
from diffusers import QwenImage21Pipeline as DiffusersQwenImage21
from diffusers.pipelines.pipeline_utils import DiffusionPipeline
from safetensors.torch import save_file
from torch import nn

from diffserve import DiffGenerator, SamplingParams
from diffserve.configs.sampling_params import LoraChoice
from diffserve.errors import LoraError
from diffserve.families.cogvideox.tiny import TinyCogVideoXSpec, build_tiny_cogvideox
from diffserve.families.mochi.tiny import build_tiny_mochi
from diffserve.families.qwen_image21.tiny import build_tiny_qwen_image21
from diffserve.loader.model_index import read_json, read_model_index
from diffserve.loader.processors import load_image_text_processor
from diffserve.models.dits.cogvideox import CogVideoXTransformer3DModel
from diffserve.models.dits.mochi import MochiTransformer3DModel
from diffserve.models.dits.qwen_image21 import QwenImage21Transformer2DModel
from diffserve.testing.image_metrics import psnr_uint8 as psnr
from diffserve.testing.parity import assert_images_match, diffusers_uint8, gradient_image, stack_uint8
from diffserve.testing.tiny_lora import BLOCK_LINEARS
from diffserve.testing.tiny_lora_original import FileModule, Layout, Suffix, write_original_lora

PSNR_BAR_DB = 40.0
#: A LoRA output must be further than this from the base output (and the second adapter's output from
#: the first's alone), so that matching Diffusers at PSNR_BAR_DB shows the adapter was applied right.
CHANGED_BAR_DB = 32.0
PROMPT = "a red fox in the snow"
SEED = 3
RANK = 4
#: The `.alpha` of the non-Diffusers files' modules, in turn: none equals RANK, and they differ per module.
ALPHAS = (2.0, 8.0, 3.0)
STD = 0.2  # of the random LoRA factors: large enough that every adapter visibly changes the output
ONE = (("a", 0.8),)
TWO = (("a", 0.8), ("b", 0.5))
EVERY_LINEAR = re.compile("")

#: The native DiT of each Diffusers class these families' folders name.
_DITS: dict[str, type[nn.Module]] = {
    cls.diffusers_class_name: cls
    for cls in (QwenImage21Transformer2DModel, CogVideoXTransformer3DModel, MochiTransformer3DModel)
}


def _linears(root: Path) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of every Linear of the folder's DiT, by module path (meta device)."""
    spec = read_model_index(str(root)).components["transformer"]
    with torch.device("meta"):
        model = _DITS[spec.class_name].from_config(read_json(spec.path / "config.json"))
    return {n: (m.out_features, m.in_features) for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def _write_peft_lora(
    root: Path, out: Path, pattern: re.Pattern[str], rank: int, alpha: float | None, seed: int, std: float
) -> Path:
    """A random LoRA in the layout Diffusers' `save_lora_weights` writes (`transformer.<module>.lora_A.weight`
    keys, alpha and rank in `lora_adapter_metadata`; None: no metadata, alpha = rank), as
    `diffserve.testing.tiny_lora.write_random_lora` writes one for the DiTs it knows."""
    g = torch.Generator().manual_seed(seed)
    shapes = {name: shape for name, shape in _linears(root).items() if pattern.search(name)}
    tensors = {}
    for name, (out_features, in_features) in shapes.items():
        tensors[f"transformer.{name}.lora_A.weight"] = torch.randn(rank, in_features, generator=g) * std
        tensors[f"transformer.{name}.lora_B.weight"] = torch.randn(out_features, rank, generator=g) * std
    metadata = {"format": "pt"}
    if alpha is not None:
        config = {
            "transformer.r": rank,
            "transformer.lora_alpha": alpha,
            "transformer.target_modules": list(shapes),
        }
        metadata["lora_adapter_metadata"] = json.dumps(config, sort_keys=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata=metadata)
    return out


#: Qwen-Image 2.1 Linears whose kohya names Diffusers' converter (Qwen-Image's protected n-grams) splits
#: wrongly, so that it refuses a file holding them (ValueError): the parity test's kohya file leaves them
#: out; `test_qwen21_kohya_names_diffusers_splits_wrongly_land_on_their_modules` checks them.
_QWEN21_KOHYA_MISSPLIT = re.compile(r"(^|\.)(img_mlp\.gate_layer|txt_in\.(in|out)_layer|modulation\.1)$")


def _qwen21_files(root: Path, out: Path) -> dict[str, Path]:
    """Qwen-Image 2.1's original code uses Diffusers' module names: `diffusion_model.` files name every
    Linear as Diffusers does; kohya files join them with underscores."""
    modules = [FileModule(name, o, i) for name, (o, i) in _linears(root).items()]
    kohya = [m for m in modules if not _QWEN21_KOHYA_MISSPLIT.search(m.name)]
    return {
        "kohya": _write(kohya, out / "kohya.safetensors", Layout.KOHYA, Suffix.DOWN_UP, seed=11),
        "diffusion_model": _write(
            modules, out / "dm.safetensors", Layout.DIFFUSION_MODEL, Suffix.A_B, seed=12
        ),
    }


def _no_files(root: Path, out: Path) -> dict[str, Path]:
    return {}


def _write(modules: list[FileModule], path: Path, layout: Layout, suffix: Suffix, seed: int) -> Path:
    return write_original_lora(modules, path, layout, suffix, rank=RANK, alphas=ALPHAS, seed=seed, std=STD)


def _qwen21_reference(root: Path) -> DiffusionPipeline:
    """Diffusers' pipeline, given the processor diffserve loads (transformers builds a Qwen3-VL processor
    only with torchvision) with the folder's chat template."""
    processor = load_image_text_processor("Qwen3VLProcessor", root / "processor")
    processor.chat_template = (root / "processor" / "chat_template.jinja").read_text()
    return DiffusersQwenImage21.from_pretrained(root, processor=processor, dtype=torch.float32)


@dataclass(frozen=True)
class Family:
    """How to build, run and LoRA-load one family; `request`: generation arguments both sides take."""

    build: Callable[[Path], Path]
    reference: Callable[[Path], DiffusionPipeline]
    original_files: Callable[[Path, Path], dict[str, Path]]
    #: the names `original_files` gives its files (the test ids), in order
    originals: tuple[str, ...]
    request: dict[str, object]
    video: bool = False


FAMILIES: dict[str, Family] = {
    "qwen-image-2.1": Family(
        build_tiny_qwen_image21,
        _qwen21_reference,
        _qwen21_files,
        ("kohya", "diffusion_model"),
        dict(height=32, width=64, num_inference_steps=2, true_cfg_scale=4.0, negative_prompt="blurry"),
    ),
    "cogvideox-t2v": Family(
        build_tiny_cogvideox,
        lambda root: CogVideoXPipeline.from_pretrained(root, dtype=torch.float32),
        _no_files,
        (),
        dict(height=32, width=48, num_frames=5, num_inference_steps=2, guidance_scale=6.0, negative_prompt="blurry"),
        video=True,
    ),
    # CogVideoX 1.5 I2V: the ofs embedding and the Linear patch embedder
    "cogvideox-1.5-i2v": Family(
        lambda out: build_tiny_cogvideox(out, TinyCogVideoXSpec(variant="1.5", image_to_video=True)),
        lambda root: CogVideoXImageToVideoPipeline.from_pretrained(root, dtype=torch.float32),
        _no_files,
        (),
        dict(
            height=32, width=48, num_frames=9, num_inference_steps=2, guidance_scale=6.0,
            image=gradient_image(width=60, height=40),
        ),
        video=True,
    ),
    "mochi": Family(
        build_tiny_mochi,
        lambda root: MochiPipeline.from_pretrained(root, dtype=torch.float32),
        _no_files,
        (),
        dict(height=32, width=32, num_frames=7, num_inference_steps=2, guidance_scale=4.5, negative_prompt="blurry"),
        video=True,
    ),
}  # fmt: skip

Loras = tuple[tuple[str, float], ...]


@dataclass
class Engines:
    """One family's two pipelines with every adapter loaded, and the base outputs of both taken before
    any adapter was; diffserve's LoRA outputs are kept per adapter set (each is generated once)."""

    family: Family
    root: Path
    ours: DiffGenerator
    reference: DiffusionPipeline
    ours_base: np.ndarray
    reference_base: np.ndarray
    _ours_outputs: dict[Loras, np.ndarray] = field(default_factory=dict)

    def run_ours(self, loras: Loras) -> np.ndarray:
        if loras not in self._ours_outputs:
            self._ours_outputs[loras] = _generate(self.ours, self.family, loras)
        return self._ours_outputs[loras]

    def run_reference(self, loras: Loras) -> np.ndarray:
        names = [name for name, _ in loras]
        self.reference.set_adapters(names, adapter_weights=[scale for _, scale in loras])
        return _reference_output(self.reference, self.family)


def _generate(ours: DiffGenerator, family: Family, loras: Loras) -> np.ndarray:
    out = ours.generate(
        prompt=PROMPT, seed=SEED, loras=[{"name": n, "scale": s} for n, s in loras], **family.request
    )
    return stack_uint8(out.frames if family.video else out.images)


def _reference_output(pipe: DiffusionPipeline, family: Family) -> np.ndarray:
    return diffusers_uint8(pipe, seed=SEED, video=family.video, prompt=PROMPT, **family.request)


def _start(name: str, directory: Path) -> Engines:
    """Build `name`'s folder and LoRA files under `directory`, both pipelines, their base outputs, then
    load every adapter into both."""
    family = FAMILIES[name]
    root = family.build(directory / "model")
    loras = directory / "loras"
    files = {
        # PEFT layout on every Linear, alpha 8 != rank 4 in `lora_adapter_metadata` (scaling 2)
        "a": _write_peft_lora(root, loras / "a.safetensors", EVERY_LINEAR, RANK, 8.0, seed=1, std=STD),
        # the blocks, rank 2, no metadata: alpha = rank (larger factors, so that its share of TWO is large)
        "b": _write_peft_lora(root, loras / "b.safetensors", BLOCK_LINEARS, 2, None, seed=2, std=1.5 * STD),
        **family.original_files(root, loras),
    }
    assert tuple(files)[2:] == family.originals
    ours = DiffGenerator.from_pretrained(root, device="cpu", show_progress=False, batch_policy="throughput")
    reference = family.reference(root)
    reference.set_progress_bar_config(disable=True)
    engines = Engines(
        family, root, ours, reference, _generate(ours, family, ()), _reference_output(reference, family)
    )
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
    assert_images_match(after, engines.reference_base, "base after LoRA requests", min_db=PSNR_BAR_DB)


@pytest.mark.parametrize("family", ["cogvideox-t2v", "mochi"])
@pytest.mark.parametrize("layout", [Layout.KOHYA, Layout.DIFFUSION_MODEL])
def test_non_diffusers_layouts_are_refused(
    engines_of: Callable[[str], Engines], family: str, layout: Layout, tmp_path: Path
) -> None:
    """CogVideoX's and Mochi's Diffusers loaders convert no kohya or `diffusion_model.` file."""
    engines = engines_of(family)
    modules = [FileModule(name, o, i) for name, (o, i) in _linears(engines.root).items()]
    path = _write(modules, tmp_path / "original.safetensors", layout, Suffix.DOWN_UP, seed=13)
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
    modules = [FileModule(name, o, i) for name, (o, i) in _linears(engines.root).items()]
    assert sum(bool(_QWEN21_KOHYA_MISSPLIT.search(m.name)) for m in modules) == 3 + 2  # 2 blocks' gate_layer
    kohya = _write(modules, tmp_path / "kohya_all.safetensors", Layout.KOHYA, Suffix.DOWN_UP, seed=14)
    twin = _write(modules, tmp_path / "dm_all.safetensors", Layout.DIFFUSION_MODEL, Suffix.DOWN_UP, seed=14)
    engines.ours.load_lora("kohya_all", kohya)
    engines.reference.load_lora_weights(str(twin), adapter_name="dm_all")
    ours = engines.run_ours((("kohya_all", 0.7),))
    engines.reference.set_adapters(["dm_all"], adapter_weights=[0.7])
    reference = _reference_output(engines.reference, engines.family)
    assert psnr(ours, engines.ours_base) < CHANGED_BAR_DB
    assert_images_match(ours, reference, "qwen-image-2.1 kohya over every Linear", min_db=PSNR_BAR_DB)


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
