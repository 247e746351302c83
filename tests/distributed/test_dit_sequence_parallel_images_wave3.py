"""Chroma's, HiDream-I1's, Qwen-Image 2.1's and HunyuanImage 2.1's DiTs split over sequence-parallel ranks
(Ulysses, Ulysses x Ring) equal their one-device forwards, and a 2-rank Ulysses engine gives the one-rank
image.

As in test_dit_sequence_parallel.py: each rank builds the same random-weight DiTs (a seeded init, std 0.2
so every block matters) and the same inputs, runs the forwards inside `parallel_scope` of a ParallelState
with the degrees under test, and returns the outputs; each family's test compares every rank's outputs
with the plain forwards (fp32, < 1e-4 relative). Batches are CFG-like pairs (one latent, two prompts, the
second's text padded), and no token length divides the degrees.

- Chroma: FLUX.1's shapes (7 text tokens, a 6x5 grid of 30 image tokens, 2 timesteps) with its text-padding
  bias `mask_q * mask_k` (the second prompt has 4 real tokens of 7), which the split carries in extra head
  channels (`token_bias_attention`).
- HiDream-I1, two models: a square 5x5 grid (25 tokens) with RoPE over whole heads, and a non-square 6x5
  grid padded to `max_seq` = 64 tokens (the padded keys zeroed) with RoPE over half heads. Three streams are
  split: image, text [T5 (5) ; Llama (5)] = 10 tokens, and each block's own Llama tokens (5).
- Qwen-Image 2.1: the first sample's prefix holds a condition image (a 2x4 grid of latent tokens in place of
  2 vision slots: 15 prefix tokens, block-causal), the second is text only (6 tokens, padded); the prefix
  runs whole on every rank, the 6x5 target is split.
- HunyuanImage 2.1: 3 heads (padded for Ulysses 2), a 6x5 grid, the packed context [glyph ; text] of 9
  tokens with the second row's padding masked as keys.

One `run_distributed` per mesh runs every family (starting the rank processes costs more than the tiny
forwards); a family that raises on the ranks fails its own test only. Helpers are copied from
test_dit_sequence_parallel.py rather than imported: importing that module would collect its tests here.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import pytest
import torch

from diffserve.distributed.config import ParallelConfig
from diffserve.distributed.state import build_parallel_state, parallel_scope
from diffserve.models.dits.chroma import ChromaTransformer2DModel, ChromaTransformerConfig
from diffserve.models.dits.hidream_image import HiDreamImageTransformer2DModel, HiDreamImageTransformerConfig
from diffserve.models.dits.hunyuan_image import HunyuanImageTransformer2DModel, HunyuanImageTransformerConfig
from diffserve.models.dits.qwen_image21 import (
    ConditionBlock,
    QwenImage21Transformer2DModel,
    QwenImage21TransformerConfig,
)
from diffserve.testing.distributed import CaseResult, MeshRuns, case_results, run_distributed
from diffserve.testing.threads import one_torch_thread

#: (world size, Ulysses degree, Ring degree) by test id.
MESHES = {"ulysses2": (2, 2, 1), "ulysses2xring2": (4, 2, 2)}
GRID_H, GRID_W = 6, 5


def randomised(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with every parameter drawn N(0, 0.2): larger than the init's zeros and tiny values, so every
    block matters (the caller seeds)."""
    with torch.no_grad():
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.2)
    return model.eval()


def check_close(outputs: list[dict[str, torch.Tensor]], expected: dict[str, torch.Tensor], mesh: str) -> None:
    """Every rank's outputs equal the one-device ones (fp32: Ulysses reorders no sum, exact up to SDPA's
    blocking; Ring merges blocks by log-sum-exp)."""
    _, ulysses, ring = MESHES[mesh]
    for rank, out in enumerate(outputs):
        for name, want in expected.items():
            error = (out[name] - want).abs().max().item()
            print(f"{name} ulysses {ulysses} x ring {ring}, rank {rank}: max abs error {error:.2e}")
            assert out[name].shape == want.shape
            assert error < 1e-4 * want.abs().max().item(), (name, error)


# --------------------------------------------------------------------------------------------- Chroma

CHROMA_TEXT_LEN, CHROMA_REAL_TEXT = 7, (7, 4)


def tiny_chroma() -> ChromaTransformer2DModel:
    torch.manual_seed(0)
    config = ChromaTransformerConfig(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=8,
        num_attention_heads=4, joint_attention_dim=24, axes_dims_rope=(2, 2, 4), approximator_num_channels=16,
        approximator_hidden_dim=32, approximator_layers=2,
    )  # fmt: skip
    return randomised(ChromaTransformer2DModel(config))


def chroma_inputs(masked: bool = True) -> dict[str, torch.Tensor | None]:
    g = torch.Generator().manual_seed(1)
    rows = torch.arange(GRID_H, dtype=torch.float32).repeat_interleave(GRID_W)
    cols = torch.arange(GRID_W, dtype=torch.float32).repeat(GRID_H)
    mask = (torch.arange(CHROMA_TEXT_LEN)[None, :] < torch.tensor(CHROMA_REAL_TEXT)[:, None]).float()
    return {
        "hidden_states": torch.randn(1, GRID_H * GRID_W, 16, generator=g).expand(2, -1, -1),
        "encoder_hidden_states": torch.randn(2, CHROMA_TEXT_LEN, 24, generator=g),
        "timestep": torch.tensor([0.9, 0.3]),
        "img_ids": torch.stack([torch.zeros_like(rows), rows, cols], dim=-1),
        "txt_ids": torch.zeros(CHROMA_TEXT_LEN, 3),
        "text_mask": mask if masked else None,
    }


def chroma_forward() -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return {"chroma": tiny_chroma()(**chroma_inputs())}


def test_chroma_inputs_exercise_the_text_bias(expected) -> None:
    """The padded prompt's bias matters (without it the output changes) and the prompts reach the image."""
    out = expected("chroma")["chroma"]
    assert (out[0] - out[1]).abs().max() > 1e-2 * out.abs().max()
    with torch.no_grad():
        unmasked = tiny_chroma()(**chroma_inputs(masked=False))
    assert (unmasked[1] - out[1]).abs().max() > 1e-3 * out.abs().max()


# ------------------------------------------------------------------------------------------ HiDream-I1

HIDREAM_T5_LEN, HIDREAM_LLAMA_LEN, HIDREAM_LLAMA_LAYERS = 5, 5, 3
#: model -> (head dim, latent (H, W)): whole-head RoPE on a square grid; half-head RoPE on a padded grid.
HIDREAM_VARIANTS = {"square": (8, (10, 10)), "padded": (16, (12, 10))}


def tiny_hidream(variant: str) -> HiDreamImageTransformer2DModel:
    torch.manual_seed(0)
    head_dim, _ = HIDREAM_VARIANTS[variant]
    config = HiDreamImageTransformerConfig(
        patch_size=2, in_channels=4, out_channels=4, num_layers=2, num_single_layers=2,
        attention_head_dim=head_dim, num_attention_heads=32 // head_dim, caption_channels=(12, 10),
        text_emb_dim=16, num_routed_experts=4, num_activated_experts=2, axes_dims_rope=(2, 2, 4),
        max_resolution=(16, 16), llama_layers=(0, 1, 2, 1),
    )  # fmt: skip
    return randomised(HiDreamImageTransformer2DModel(config))


def hidream_inputs(variant: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    _, (h, w) = HIDREAM_VARIANTS[variant]
    return {
        "hidden_states": torch.randn(1, 4, h, w, generator=g).expand(2, -1, -1, -1),
        "timesteps": torch.tensor([700.0, 200.0]),
        "encoder_hidden_states_t5": torch.randn(2, HIDREAM_T5_LEN, 12, generator=g),
        "encoder_hidden_states_llama3": torch.randn(
            HIDREAM_LLAMA_LAYERS, 2, HIDREAM_LLAMA_LEN, 10, generator=g
        ),
        "pooled_embeds": torch.randn(2, 16, generator=g),
    }


def hidream_forward() -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return {variant: tiny_hidream(variant)(**hidream_inputs(variant)) for variant in HIDREAM_VARIANTS}


def test_hidream_padded_grid_is_masked(expected) -> None:
    """The non-square grid is padded to max_seq with its keys zeroed, and the prompts reach the image."""
    model = tiny_hidream("padded")
    _, mask = model.patchify(hidream_inputs("padded")["hidden_states"])
    assert mask is not None and mask.shape[1] == model.max_seq == 64 and int(mask[0].sum()) == GRID_H * GRID_W
    for out in expected("hidream").values():
        assert (out[0] - out[1]).abs().max() > 1e-2 * out.abs().max()


# ------------------------------------------------------------------------------------- Qwen-Image 2.1

QWEN21_TEXT_LEN, QWEN21_LENGTHS = 9, [9, 6]


def tiny_qwen_image21() -> QwenImage21Transformer2DModel:
    torch.manual_seed(0)
    config = QwenImage21TransformerConfig(
        in_channels=16, out_channels=16, num_layers=2, attention_head_dim=8, num_attention_heads=4,
        context_in_dim=24, mlp_ratio=3, axes_dims_rope=(2, 2, 4), causal_condition=True,
    )  # fmt: skip
    return randomised(QwenImage21Transformer2DModel(config))


def qwen_image21_inputs() -> dict[str, object]:
    """Sample 0: 9 text states whose slots 2-3 hold a 2x4 condition image (prefix 7 + 8 = 15 tokens);
    sample 1: 6 text tokens, no condition (its prefix padded to 15)."""
    g = torch.Generator().manual_seed(1)
    condition = ConditionBlock(slot=2, slots=2, latents=torch.randn(8, 16, generator=g), grid=(2, 4))
    return {
        "hidden_states": torch.randn(1, GRID_H * GRID_W, 16, generator=g).expand(2, -1, -1),
        "encoder_hidden_states": torch.randn(2, QWEN21_TEXT_LEN, 24, generator=g),
        "text_lengths": QWEN21_LENGTHS,
        "timestep": torch.tensor([0.7, 0.7]),
        "grid": (GRID_H, GRID_W),
        "conditions": [[condition], []],
    }


def qwen_image21_forward() -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return {"qwen-image-2.1": tiny_qwen_image21()(**qwen_image21_inputs())}


# ---------------------------------------------------------------------------------- HunyuanImage 2.1

HUNYUAN_TEXT_LEN, HUNYUAN_GLYPH_LEN = 7, 3


def tiny_hunyuan_image() -> HunyuanImageTransformer2DModel:
    torch.manual_seed(0)
    config = HunyuanImageTransformerConfig(
        in_channels=4, out_channels=4, num_attention_heads=3, attention_head_dim=8, num_layers=2,
        num_single_layers=2, num_refiner_layers=1, text_embed_dim=16, text_embed_2_dim=12,
        rope_axes_dim=(4, 4),
    )  # fmt: skip
    return randomised(HunyuanImageTransformer2DModel(config))


def hunyuan_image_inputs() -> dict[str, torch.Tensor]:
    """Row 0: 7 text and 2 glyph tokens; row 1: 4 text tokens, no glyph (the packed context: 9, 4 valid)."""
    g = torch.Generator().manual_seed(1)
    return {
        "hidden_states": torch.randn(1, 4, GRID_H, GRID_W, generator=g).expand(2, -1, -1, -1),
        "timestep": torch.tensor([700.0, 700.0]),
        "encoder_hidden_states": torch.randn(2, HUNYUAN_TEXT_LEN, 16, generator=g),
        "encoder_attention_mask": torch.tensor([[1] * 7, [1] * 4 + [0] * 3]),
        "encoder_hidden_states_2": torch.randn(2, HUNYUAN_GLYPH_LEN, 12, generator=g),
        "encoder_attention_mask_2": torch.tensor([[1, 1, 0], [0, 0, 0]]),
    }


def hunyuan_image_forward() -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return {"hunyuan-image": tiny_hunyuan_image()(**hunyuan_image_inputs())}


# ------------------------------------------------------------------------------------- on gloo ranks


@dataclass(frozen=True)
class Family:
    forward: Callable[[], dict[str, torch.Tensor]]


FAMILIES = {
    "chroma": Family(chroma_forward),
    "hidream": Family(hidream_forward),
    "qwen-image-2.1": Family(qwen_image21_forward),
    "hunyuan-image": Family(hunyuan_image_forward),
}


def forward_on_rank(
    rank: int, world_size: int, ulysses: int, ring: int, families: dict[str, None]
) -> dict[str, CaseResult]:
    """The split forwards of every family in `families` on this rank."""
    config = ParallelConfig(num_gpus=world_size, ulysses_degree=ulysses, ring_degree=ring)
    state = build_parallel_state(config, local_rank=rank, control_timeout=timedelta(seconds=60))

    def run(family: str) -> dict[str, torch.Tensor]:
        with parallel_scope(state):
            return FAMILIES[family].forward()

    return case_results(run, families)


@pytest.fixture(scope="module")
def expected() -> Callable[[str], dict[str, torch.Tensor]]:
    """A family's one-device outputs (computed once)."""
    return functools.cache(lambda family: FAMILIES[family].forward())


@pytest.fixture(scope="module")
def split_outputs() -> MeshRuns:
    """A family's outputs by rank on a mesh: one `run_distributed` per mesh, for every family."""

    def start(mesh: str) -> list[dict[str, CaseResult]]:
        world_size, ulysses, ring = MESHES[mesh]
        families = dict.fromkeys(FAMILIES)
        return run_distributed(forward_on_rank, world_size, ulysses, ring, families, timeout_s=240)

    return MeshRuns(start)


CASES = [(name, mesh) for name in FAMILIES for mesh in MESHES]


@pytest.mark.parametrize(("family", "mesh"), CASES, ids=[f"{name}-{mesh}" for name, mesh in CASES])
def test_split_forward_equals_one_device(expected, split_outputs, family: str, mesh: str) -> None:
    check_close(split_outputs(family, mesh), expected(family), mesh)


# ------------------------------------------------------------------------------------------ end to end


@pytest.fixture
def one_thread() -> Iterator[None]:
    with one_torch_thread():  # the workers take the parent's thread count
        yield


#: family -> the builder of its tiny checkpoint ("module:function").
TINY_BUILDERS = {
    "chroma": "diffserve.families.chroma.tiny:build_tiny_chroma",
    "hidream": "diffserve.families.hidream.tiny:build_tiny_hidream",
    "qwen-image-2.1": "diffserve.families.qwen_image21.tiny:build_tiny_qwen_image21",
    "hunyuan-image": "diffserve.families.hunyuan_image.tiny:build_tiny_hunyuan_image",
}


@pytest.mark.parametrize("family", list(TINY_BUILDERS))
def test_ulysses_two_ranks_matches_one_rank(
    family: str, one_thread: None, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The engine with 2 Ulysses ranks gives the one-rank image of the family's tiny checkpoint (within one
    uint8 level): the pipeline's real inputs (text masks, CFG batches) reach the split DiT."""
    from diffserve.api import DiffGenerator

    module, name = TINY_BUILDERS[family].split(":")
    folder = getattr(importlib.import_module(module), name)(tmp_path_factory.mktemp(family))
    request = dict(prompt="a red square", height=64, width=64, num_inference_steps=1, seed=7)
    with DiffGenerator.from_pretrained(folder, show_progress=False) as gen:
        alone = np.asarray(gen.generate(**request).images[0], dtype=np.int16)
    with DiffGenerator.from_pretrained(folder, show_progress=False, num_gpus=2, ulysses_degree=2) as gen:
        assert gen.ranks is not None and gen.ranks.state is not None
        assert gen.ranks.state.ulysses_degree == 2
        split = np.asarray(gen.generate(**request).images[0], dtype=np.int16)
    error = int(np.abs(split - alone).max())
    print(f"{family} engine, ulysses 2 vs one rank: max uint8 difference {error} (image {alone.shape})")
    assert error <= 1
