"""`--compile` (regional torch.compile of the DiT blocks) and `--warmup-resolutions`.

The compiled tests share one tiny FLUX (1 double + 1 single block) compiled once with inductor, so
the whole file costs about one compilation of two block graphs for two batch kinds; the LoRA and int8 tests
compile a FLUX of one single-stream block only (their graphs are new ones: half as many to build, cold, in
a run; the plain single-stream graphs are the shared FLUX's, found in inductor's cache).
"""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest
import torch
from torch import nn

from diffserve.configs.sampling_params import SamplingParams
from diffserve.errors import UserError
from diffserve.runtime.compile import (
    ScopedCompiledCall,
    cfg_overrides,
    compile_pipeline,
    find_block_lists,
    warmup_params,
    warmup_plan,
)
from diffserve.testing.image_metrics import psnr_uint8

#: (height, width): a square size and a non-square one (both multiples of the tiny VAE's 16 pixels).
WARMUP_SIZES = [(64, 64), (32, 48)]
PROMPT = "a red square on a blue background"


def inductor_cxx() -> str | None:
    """The C++ compiler inductor would use on CPU, if it is installed."""
    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch._inductor.exc import InvalidCxxCompiler

    try:
        return shutil.which(get_cpp_compiler())
    except InvalidCxxCompiler:
        return None


needs_cxx = pytest.mark.skipif(
    inductor_cxx() is None, reason="inductor needs a C++ compiler on CPU (g++ / $CXX) and none was found"
)


def graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


# ------------------------------------------------------------------------------ without compiling


@pytest.mark.parametrize(
    ("module", "cls_name", "expected"),
    [
        ("flux", "FluxTransformer2DModel",
         [("transformer_blocks", "FluxTransformerBlock", 19), ("single_transformer_blocks", "FluxSingleTransformerBlock", 38)]),
        ("sd3", "SD3Transformer2DModel", [("transformer_blocks", "JointTransformerBlock", 18)]),
        ("qwen_image", "QwenImageTransformer2DModel", [("transformer_blocks", "QwenImageTransformerBlock", 60)]),
        ("z_image", "ZImageTransformer2DModel",
         [("noise_refiner", "ZImageTransformerBlock", 2), ("context_refiner", "ZImageTransformerBlock", 2),
          ("layers", "ZImageTransformerBlock", 30)]),
        ("wan", "WanTransformer3DModel", [("blocks", "WanTransformerBlock", 40)]),
    ],
)  # fmt: skip
def test_block_lists_of_every_family(module: str, cls_name: str, expected: list) -> None:
    """Each family's full-size DiT (its config's defaults, built on the meta device: no memory) exposes
    exactly its block lists, not the small ModuleLists inside blocks (`to_out`, a feed-forward's `net`)."""
    import importlib

    cls = getattr(importlib.import_module(f"diffserve.models.dits.{module}"), cls_name)
    with torch.device("meta"):
        model = cls.from_config({})
    found = [(name, type(blocks[0]).__name__, len(blocks)) for name, blocks in find_block_lists(model)]
    assert found == expected


def test_warmup_plan_covers_one_row_and_multi_row_batches() -> None:
    """No CFG (one DiT row) and CFG (two rows, texts of equal and of different lengths) at the first
    size; the family default at the others."""
    assert warmup_plan([(64, 64), (32, 48)]) == [
        (64, 64, "no-cfg"), (64, 64, "cfg"), (64, 64, "cfg-uneven-text"), (32, 48, "default"),
    ]  # fmt: skip
    assert warmup_plan([]) == []


def test_a_family_without_cfg_warms_up_on_its_own_defaults() -> None:
    """Guidance-distilled families (FLUX.2-dev, SANA-Sprint) refuse every CFG setting: their warm-up runs
    one row with no CFG override at all."""
    assert warmup_plan([(64, 64), (32, 48)], "none") == [(64, 64, "no-cfg"), (32, 48, "default")]
    params = warmup_params(64, 64, "no-cfg", "none", video=False)
    assert params.true_cfg_scale is None and params.guidance_scale is None and params.negative_prompt is None


@pytest.mark.parametrize("cfg_mode", ["true_cfg", "classic", "positive_gap"])
def test_warmup_params_of_each_kind(cfg_mode: str) -> None:
    """The uneven-text run's negative prompt is many times the prompt's length; the others keep theirs."""
    from diffserve.runtime.compile import WARMUP_KINDS, warmup_params

    params = {kind: warmup_params(64, 64, kind, cfg_mode, video=False) for kind in (*WARMUP_KINDS, "default")}
    uneven = params["cfg-uneven-text"]
    assert len(uneven.negative_prompt.split()) >= 10 * len(uneven.prompt.split())
    assert params["cfg"].negative_prompt != uneven.negative_prompt
    assert params["default"].negative_prompt == SamplingParams().negative_prompt


@pytest.mark.parametrize("cfg_mode", ["true_cfg", "classic", "positive_gap"])
def test_cfg_overrides_switch_the_negative_branch(cfg_mode: str) -> None:
    """The overrides really turn CFG off and on under each family's rule (the validation stage decides)."""
    from diffserve.configs.sampling_params import SamplingParams
    from diffserve.platforms import CpuPlatform
    from diffserve.request import Req
    from diffserve.stages.input_validation import InputValidationStage

    stage = InputValidationStage(defaults=SamplingParams(num_inference_steps=2, guidance_scale=3.5),
                                 pixel_multiple=16, default_pixels=64, max_sequence_length_limit=None,
                                 cfg_mode=cfg_mode)  # fmt: skip
    for cfg, overrides in cfg_overrides(cfg_mode).items():
        req = stage(Req(params=SamplingParams(prompt="p", height=64, width=64, **overrides)), CpuPlatform())
        assert req.do_cfg is cfg


def test_compile_refuses_what_it_cannot_compile() -> None:
    """--compile never silently does nothing: no DiT, or a DiT without block lists, is an error."""
    with pytest.raises(UserError, match="no DiT component"):
        compile_pipeline({"vae": nn.Linear(2, 2)})
    with pytest.raises(UserError, match="no repeated block list"):
        compile_pipeline({"transformer": nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))})


# ---------------------------------------------------------------------------------- compiled (inductor)


@pytest.fixture(scope="module")
def tiny_flux_1x1(tmp_path_factory: pytest.TempPathFactory):
    from diffserve.families.flux.tiny import TinyFluxSpec, build_tiny_flux

    return build_tiny_flux(
        tmp_path_factory.mktemp("tiny-flux-1x1"), TinyFluxSpec(num_layers=1, num_single_layers=1)
    )


@pytest.fixture(scope="module")
def compiled(tiny_flux_1x1):
    """A compiled generator warmed up at WARMUP_SIZES, and the number of graphs compiled meanwhile."""
    from diffserve.api import DiffGenerator

    before = graphs_compiled()
    generator = DiffGenerator.from_pretrained(
        tiny_flux_1x1, device="cpu", show_progress=False, compile=True, warmup_resolutions=WARMUP_SIZES
    )
    return generator, graphs_compiled() - before


@pytest.fixture(scope="module")
def eager(tiny_flux_1x1):
    from diffserve.api import DiffGenerator

    return DiffGenerator.from_pretrained(tiny_flux_1x1, device="cpu", show_progress=False)


@needs_cxx
def test_blocks_are_compiled(compiled) -> None:
    generator, graphs = compiled
    dit = generator.pipeline.context.get("transformer")
    blocks = [*dit.transformer_blocks, *dit.single_transformer_blocks]
    # Entered with the request scope mirrored, so graphs resolve the backend and LoRA rows when traced.
    assert all(isinstance(block._compiled_call_impl, ScopedCompiledCall) for block in blocks)
    assert {r.cpu_gemm for r in generator.compiled_regions} <= {"onednn", "mkl"}
    assert [(r.path, r.block_class, r.blocks) for r in generator.compiled_regions] == [
        ("transformer.transformer_blocks", "FluxTransformerBlock", 1),
        ("transformer.single_transformer_blocks", "FluxSingleTransformerBlock", 1),
    ]
    # Two block classes x (one-row, multi-row) batches: 4 graphs, none broken (a break, e.g. a context
    # variable read inside a block, would split a block's graph in two).
    assert graphs == 4


@needs_cxx
def test_warmup_ran_the_configured_sizes(compiled) -> None:
    generator, _ = compiled
    runs = [(r.height, r.width, r.kind) for r in generator.warmup_runs]
    assert runs == [(64, 64, "no-cfg"), (64, 64, "cfg"), (64, 64, "cfg-uneven-text"), (32, 48, "default")]
    assert all(r.seconds > 0 for r in generator.warmup_runs)


@needs_cxx
def test_compiled_dit_matches_eager(compiled, eager) -> None:
    """Same weights, same inputs: the compiled blocks agree with eager to float32 rounding."""
    ours = compiled[0].pipeline.context.get("transformer")
    ref = eager.pipeline.context.get("transformer")
    config = ref.config
    gen = torch.Generator().manual_seed(0)
    batch, image_tokens, text_tokens = 2, 16, 512
    side = int(image_tokens**0.5)
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    inputs = {
        "hidden_states": torch.randn(batch, image_tokens, config.in_channels, generator=gen),
        "encoder_hidden_states": torch.randn(batch, text_tokens, config.joint_attention_dim, generator=gen),
        "pooled_projections": torch.randn(batch, config.pooled_projection_dim, generator=gen),
        "timestep": torch.tensor([0.9, 0.4]),
        "img_ids": torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3).float(),
        "txt_ids": torch.zeros(text_tokens, 3),
        "guidance": torch.full((batch,), 3.5),
    }
    with torch.inference_mode():
        expected, got = ref(**inputs), ours(**inputs)
    diff = (got - expected).abs().max().item()
    print(
        f"compiled vs eager DiT output: max |diff| = {diff:.2e} (output max |x| {expected.abs().max().item():.2f})"
    )
    assert diff <= 1e-5


@needs_cxx
def test_compiled_generation_matches_eager_and_does_not_recompile(compiled, eager) -> None:
    """Requests at warmed sizes, with any number of DiT rows, reuse the warm-up's graphs; and the
    pixels match eager's."""
    generator, _ = compiled
    before = graphs_compiled()
    requests = [
        {"height": 64, "width": 64},
        {"height": 64, "width": 64, "num_outputs_per_prompt": 3},  # 3 rows: a batch size never seen
        {"height": 32, "width": 48, "true_cfg_scale": 2.0, "negative_prompt": "blurry"},  # CFG: 2 rows
    ]
    for params in requests:
        out = generator.generate(PROMPT, num_inference_steps=2, seed=7, **params)
        ref = eager.generate(PROMPT, num_inference_steps=2, seed=7, **params)
        for image, expected in zip(out.images, ref.images, strict=True):
            psnr = psnr_uint8(np.asarray(image), np.asarray(expected))
            print(f"{params}: compiled vs eager PSNR {psnr:.1f} dB")
            assert psnr >= 40.0
    assert graphs_compiled() == before, "a request at a warmed size compiled new graphs"


@needs_cxx
def test_attention_reuse_runs_its_forwards_eagerly_on_a_compiled_engine(compiled, eager) -> None:
    """A PAB request on a compiled engine reuses attention as on an eager one (its forwards run the blocks
    eagerly: a graph cannot skip a module inside it), with the same pixels and counts; so does FasterCache
    on a true-CFG request, whose skipped steps run its prompt branch alone (a one-row view)."""
    generator, _ = compiled
    base = {"num_inference_steps": 8, "seed": 7, "height": 64, "width": 64}
    faster = {"cache": {"method": "fastercache"}, "negative_prompt": "blurry", "true_cfg_scale": 3.0}
    for kwargs in ({**base, "cache": {"method": "pab"}}, {**base, **faster}):
        out, ref = generator.generate(PROMPT, **kwargs), eager.generate(PROMPT, **kwargs)
        assert out.cache == ref.cache and out.cache["attention_reused"] > 0
        np.testing.assert_array_equal(np.asarray(out.images[0]), np.asarray(ref.images[0]))
    assert out.cache["unconditional_skipped"] > 0


@pytest.fixture(scope="module")
def compiled_zimage(tmp_path_factory: pytest.TempPathFactory):
    from diffserve.api import DiffGenerator
    from diffserve.families.z_image.tiny import build_tiny_zimage

    path = build_tiny_zimage(tmp_path_factory.mktemp("tiny-zimage"))
    return DiffGenerator.from_pretrained(path, device="cpu", show_progress=False, compile=True)


@needs_cxx
def test_zimage_texts_of_any_lengths_reuse_the_warmup_graphs(compiled_zimage) -> None:
    """Z-Image keeps each row's text length and masks the shorter row's padding: CFG with a negative
    prompt much longer or shorter than the prompt, or of the same length, and no CFG, all run on
    graphs the warm-up built (a masked one among them)."""
    before = graphs_compiled()
    requests = [
        {"prompt": "a cat"},
        {"prompt": "a cat", "guidance_scale": 3.0},  # empty negative prompt: same padded length
        {"prompt": "a very long prompt about a cat on a mat in the sun, " * 4, "negative_prompt": "x",
         "guidance_scale": 3.0},
        {"prompt": "dog", "negative_prompt": "a much longer negative prompt than the prompt, " * 4,
         "guidance_scale": 3.0},
    ]  # fmt: skip
    for params in requests:
        out = compiled_zimage.generate(height=32, width=48, num_inference_steps=2, seed=1, **params)
        assert len(out.images) == 1
    assert graphs_compiled() == before, "a Z-Image request compiled new graphs after the warm-up"


# ------------------------------------------------------------------ LoRA and quantized layers, compiled


@pytest.fixture(scope="module")
def tiny_flux_single_stream(tmp_path_factory: pytest.TempPathFactory):
    """No double-stream block: one block list, one block class."""
    from diffserve.families.flux.tiny import TinyFluxSpec, build_tiny_flux

    return build_tiny_flux(
        tmp_path_factory.mktemp("tiny-flux-0x1"), TinyFluxSpec(num_layers=0, num_single_layers=1)
    )


@pytest.fixture(scope="module")
def style_lora(tiny_flux_single_stream, tmp_path_factory: pytest.TempPathFactory):
    from diffserve.testing.tiny_lora import write_random_lora

    path = tmp_path_factory.mktemp("compile-lora") / "style.safetensors"
    return write_random_lora(tiny_flux_single_stream, path, rank=4, alpha=8.0, seed=1, std=0.08)


def _pixels(output) -> np.ndarray:  # noqa: ANN001 - a GenerationOutput
    return np.asarray(output.images[0])


@needs_cxx
def test_a_mixed_lora_batch_compiles_at_warm_up_and_matches_eager(
    tiny_flux_single_stream, style_lora
) -> None:
    """With an adapter loaded at start-up the warm-up also traces the LoRA batches' graphs (they resolve
    "some row has LoRA" at trace time); a batch of a LoRA row and a plain row then compiles nothing and
    each row matches eager's. On the single-stream FLUX: LoRA wraps every Linear the same way in both block
    classes, and one class's LoRA graphs are half the cold compile of two."""
    from diffserve.api import DiffGenerator
    from diffserve.configs.sampling_params import LoraChoice

    loras = {"style": style_lora}
    compiled = DiffGenerator.from_pretrained(
        tiny_flux_single_stream, device="cpu", show_progress=False, compile=True, loras=loras
    )
    eager = DiffGenerator.from_pretrained(
        tiny_flux_single_stream, device="cpu", show_progress=False, loras=loras
    )
    assert [r.kind for r in compiled.warmup_runs] == [
        "no-cfg", "cfg", "cfg-uneven-text", "no-cfg+lora", "cfg+lora", "cfg-uneven-text+lora",
    ]  # fmt: skip
    requests = [
        SamplingParams(prompt=PROMPT, loras=[LoraChoice("style", 0.8)], height=64, width=64,
                       num_inference_steps=2, seed=3),
        SamplingParams(prompt="a plain row", height=64, width=64, num_inference_steps=2, seed=4),
    ]  # fmt: skip
    before = graphs_compiled()
    got = compiled.generate_many([dataclasses.replace(p) for p in requests])
    assert graphs_compiled() == before, "a LoRA batch compiled new graphs after the warm-up"
    expected = eager.generate_many(requests)
    for out, ref in zip(got, expected, strict=True):
        psnr = psnr_uint8(_pixels(out), _pixels(ref))
        print(f"compiled vs eager, LoRA batch row: PSNR {psnr:.1f} dB")
        assert psnr >= 40.0
    plain = eager.generate(PROMPT, height=64, width=64, num_inference_steps=2, seed=3)
    assert np.abs(_pixels(got[0]).astype(int) - _pixels(plain).astype(int)).max() > 5  # LoRA applied


@needs_cxx
def test_int8_quantized_layers_compile_and_match_eager(tiny_flux_single_stream) -> None:
    """int8 Linears (the fused QKV + MLP input projection and the output projection of a single-stream
    block) compile, and the compiled pixels match eager's."""
    from diffserve.api import DiffGenerator

    kwargs = {"device": "cpu", "show_progress": False, "quantization": "int8"}
    compiled = DiffGenerator.from_pretrained(tiny_flux_single_stream, compile=True, **kwargs)
    assert [(r.path, r.blocks) for r in compiled.compiled_regions] == [
        ("transformer.single_transformer_blocks", 1)
    ]
    eager = DiffGenerator.from_pretrained(tiny_flux_single_stream, **kwargs)
    params = {"height": 64, "width": 64, "num_inference_steps": 2, "seed": 5}
    psnr = psnr_uint8(_pixels(compiled.generate(PROMPT, **params)), _pixels(eager.generate(PROMPT, **params)))
    print(f"int8, compiled vs eager: PSNR {psnr:.1f} dB")
    assert psnr >= 40.0
