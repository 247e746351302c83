"""Tensor parallelism for Wan 2.1's DiT: loaded as TP shards (each rank reading only its slices of the
safetensors file, the across-heads QK-norm weights included) it equals the one-device DiT, alone and
with Ulysses; and a whole text-to-video generation under TP 2 gives the one-rank frames.

Wan's QK-norm is an RMSNorm over all heads together, so a head shard must all-reduce the sum of squares
(`ParallelRMSNorm`); with a per-shard norm instead, the outputs would differ far beyond the bounds here.
The sharded-load checks run in this process; the forwards run on gloo ranks (`run_distributed`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn

from diffserve.distributed.config import ParallelConfig
from diffserve.distributed.state import ParallelState, build_parallel_state, parallel_scope
from diffserve.layers.tensor_parallel import ParallelRMSNorm, tensor_parallel_shards
from diffserve.errors import ModelLoadError
from diffserve.layers.norms import RMSNorm
from diffserve.loader.safetensors_weights import load_safetensors_into
from diffserve.models.dits.wan import WanTransformer3DModel
from diffserve.testing.distributed import run_distributed

CHANNELS, TEXT_DIM, IMAGE_DIM, HEADS, HEAD_DIM = 4, 16, 12, 4, 12
DIT_CONFIG = {
    "patch_size": [1, 2, 2], "num_attention_heads": HEADS, "attention_head_dim": HEAD_DIM,
    "in_channels": CHANNELS, "out_channels": CHANNELS, "text_dim": TEXT_DIM, "freq_dim": 16, "ffn_dim": 48,
    "num_layers": 2, "image_dim": IMAGE_DIM, "added_kv_proj_dim": HEADS * HEAD_DIM,
}  # fmt: skip
BATCH, FRAMES, HEIGHT, WIDTH = 3, 3, 6, 10  # post-patch grid 3 x 3 x 5: 45 tokens, split unevenly
TEXT_LEN, IMAGE_LEN = 7, 5
WEIGHTS = "diffusion_pytorch_model.safetensors"


@dataclass(frozen=True)
class LoadOnlyRank:
    """A TP rank for building and loading shards in this process (no group: no forward)."""

    tp_size: int
    tp_rank: int
    tp_group: dist.ProcessGroup | None = None


@pytest.fixture(scope="module")
def dit_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A seeded image-to-video Wan transformer folder, weights large enough that every block matters."""
    from diffserve.testing.tiny_writing import save_diffusers_model

    torch.manual_seed(0)
    model = WanTransformer3DModel.from_config(DIT_CONFIG)
    for p in model.parameters():
        nn.init.normal_(p, std=0.2)
    directory = tmp_path_factory.mktemp("tp-wan") / "transformer"
    save_diffusers_model(model, directory, "WanTransformer3DModel", DIT_CONFIG)
    return directory


def dit_inputs() -> dict[str, torch.Tensor]:
    """A CFG-like pair (one latent, two texts, one timestep) plus a row at another timestep, I2V."""
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(BATCH, CHANNELS, FRAMES, HEIGHT, WIDTH, generator=g)
    latents[1] = latents[0]
    return {
        "hidden_states": latents,
        "timestep": torch.tensor([700.0, 700.0, 250.0]),
        "encoder_hidden_states": torch.randn(BATCH, TEXT_LEN, TEXT_DIM, generator=g),
        "encoder_hidden_states_image": torch.randn(BATCH, IMAGE_LEN, IMAGE_DIM, generator=g),
    }


def load_dit(directory: Path, tp: LoadOnlyRank | ParallelState | None) -> WanTransformer3DModel:
    """The loader's steps (without importing the component loader, which imports transformers: seconds
    per rank process): build on meta, shard when `tp` is given, read the (shard's) weights."""
    with torch.device("meta"):
        model = WanTransformer3DModel.from_config(DIT_CONFIG)
    if tp is not None:
        model.shard_for_tensor_parallel(tp)
    load_safetensors_into(model, [directory / WEIGHTS], torch.device("cpu"), torch.float32)
    return model.eval()


# ----------------------------------------------------------------------------------- in this process


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_holds_only_its_heads_and_ffn_features(dit_dir: Path, rank: int) -> None:
    full = load_file(str(dit_dir / WEIGHTS))
    with torch.device("meta"):
        model = WanTransformer3DModel.from_config(DIT_CONFIG)
    model.shard_for_tensor_parallel(LoadOnlyRank(2, rank))
    num_bytes = load_safetensors_into(model, [dit_dir / WEIGHTS], torch.device("cpu"), torch.float32)
    specs = tensor_parallel_shards(model)
    # The loader read this rank's slices of the sharded tensors and nothing more (it counts what it read).
    assert num_bytes == sum(p.numel() * 4 for p in model.parameters())
    assert num_bytes < sum(t.numel() * 4 for t in full.values())
    # Per block: self q/k/v/out + 2 norms, cross q/k/v/out + image k/v + 3 norms, FFN 2: 17 weights.
    assert len([k for k in specs if k.endswith(".weight")]) == 2 * 17
    state = model.state_dict()
    for key, spec in specs.items():
        assert torch.equal(state[key], spec.take(full[key])), key
    for key in full.keys() - specs.keys():  # embedders, modulation tables, LayerNorms, row biases, head
        assert torch.equal(state[key], full[key]), key
    half = (rank * 24, rank * 24 + 24)  # 2 of the 4 heads x 12
    assert specs["blocks.0.attn1.norm_q.weight"].ranges == (half,)
    assert specs["blocks.1.attn2.norm_added_k.weight"].ranges == (half,)
    assert specs["blocks.0.attn2.to_out.0.weight"].ranges == (half,)
    assert model.blocks[0].attn1.num_heads == model.blocks[0].attn2.num_heads == 2


def test_heads_that_do_not_divide_the_tp_size_are_refused(dit_dir: Path) -> None:
    from diffserve.loader.component_loader import load_native_model
    from diffserve.loader.model_index import ComponentSpec
    from diffserve.platforms.cpu import CpuPlatform

    spec = ComponentSpec("transformer", "diffusers", "WanTransformer3DModel", dit_dir)
    with pytest.raises(ModelLoadError, match="the Wan DiT's 4 attention heads do not divide over 3"):
        load_native_model(spec, WanTransformer3DModel, CpuPlatform(), torch.float32, LoadOnlyRank(3, 0))


def test_an_ffn_width_that_does_not_divide_is_refused() -> None:
    with torch.device("meta"):
        model = WanTransformer3DModel.from_config({**DIT_CONFIG, "ffn_dim": 50})
    with pytest.raises(ValueError, match="FFN width ffn_dim=50 does not divide over 4"):
        model.shard_for_tensor_parallel(LoadOnlyRank(4, 0))


def test_a_loaded_model_cannot_be_sharded(dit_dir: Path) -> None:
    with pytest.raises(RuntimeError, match="before loading"):
        load_dit(dit_dir, None).shard_for_tensor_parallel(LoadOnlyRank(2, 0))


def test_only_an_rms_norm_with_its_rounding_is_sharded() -> None:
    with pytest.raises(TypeError, match="round_once=True"):
        ParallelRMSNorm.replacing(RMSNorm(8, round_once=False), LoadOnlyRank(2, 0))
    with pytest.raises(TypeError, match="affine RMSNorm"):
        ParallelRMSNorm.replacing(RMSNorm(8, elementwise_affine=False, round_once=True), LoadOnlyRank(2, 0))


# ------------------------------------------------------------------------------------ on gloo ranks


def _norm_errors(state: ParallelState) -> dict[str, float]:
    """`ParallelRMSNorm` on this rank's half of the features against the full-width RMSNorm's same half,
    in fp32 and in bf16 (relative to the output's largest magnitude)."""
    torch.manual_seed(3)
    whole = RMSNorm(16, eps=1e-6, round_once=True)
    nn.init.normal_(whole.weight)
    x = torch.randn(2, 5, 16) * 3
    errors = {}
    for dtype in (torch.float32, torch.bfloat16):
        reference = copy.deepcopy(whole).to(dtype)
        sharded = ParallelRMSNorm.replacing(reference, state)
        spec = sharded.shard_specs()["weight"]
        sharded.load_state_dict({"weight": spec.take(reference.weight.detach())})
        ((lo, hi),) = spec.ranges
        want = reference(x.to(dtype))[..., lo:hi].float()
        got = sharded(x.to(dtype)[..., lo:hi])
        assert got.dtype == dtype, got.dtype
        errors[str(dtype)] = ((got.float() - want).abs().max() / want.abs().max()).item()
    return errors


def _tp_forward(rank: int, world_size: int, dit_dir: Path, ulysses: int) -> dict[str, object]:
    config = ParallelConfig(num_gpus=world_size, tp_size=2, ulysses_degree=ulysses)
    state = build_parallel_state(config, local_rank=rank, control_timeout=timedelta(seconds=60))
    with torch.no_grad():
        errors = _norm_errors(state) if ulysses == 1 else {}
        model = load_dit(dit_dir, state)
        with parallel_scope(state):
            out = model(**dit_inputs())
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"errors": errors, "out": out, "param_bytes": param_bytes}


def sharded_bytes() -> int:
    """fp32 bytes of the checkpoint tensors TP shards (attention and FFN projections, QK-norm weights)."""
    with torch.device("meta"):
        model = WanTransformer3DModel.from_config(DIT_CONFIG)
    model.shard_for_tensor_parallel(LoadOnlyRank(2, 0))
    return sum(4 * math.prod(spec.full_shape) for spec in tensor_parallel_shards(model).values())


@pytest.fixture(scope="module")
def one_device(dit_dir: Path) -> tuple[torch.Tensor, int]:
    model = load_dit(dit_dir, None)
    with torch.no_grad():
        out = model(**dit_inputs())
    return out, sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize(("world_size", "ulysses"), [(2, 1), (4, 2)], ids=["tp2", "tp2xulysses2"])
def test_tp_dit_equals_one_device(dit_dir: Path, one_device, world_size: int, ulysses: int) -> None:
    expected, whole_bytes = one_device
    results = run_distributed(_tp_forward, world_size, dit_dir, ulysses, timeout_s=120)
    for rank, result in enumerate(results):
        for dtype, error in result["errors"].items():
            # The all-reduced sum only reorders fp32 additions; bf16 rounds once, as F.rms_norm does.
            assert error < (1e-6 if dtype == "torch.float32" else 2**-7), (dtype, error)
        error = (result["out"] - expected).abs().max().item()
        print(f"tp 2 x ulysses {ulysses}, rank {rank}: max abs error {error:.2e}, "
              f"params {result['param_bytes']} of {whole_bytes} bytes")  # fmt: skip
        assert error < 1e-5 * expected.abs().max().item(), error
        assert result["param_bytes"] == whole_bytes - sharded_bytes() // 2


# ------------------------------------------------------------------------------------- end to end


@pytest.fixture
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers take the parent's thread count
    yield
    torch.set_num_threads(threads)


PARAMS = dict(height=32, width=32, num_frames=5, num_inference_steps=2, guidance_scale=4.0, seed=7)


@pytest.fixture(scope="module")
def tiny_wan_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from diffserve.families.wan.tiny import build_tiny_wan

    return build_tiny_wan(tmp_path_factory.mktemp("tiny-wan"))


def generate_frames(model_dir: Path, **parallel: object) -> np.ndarray:
    from diffserve.api import DiffGenerator

    with DiffGenerator.from_pretrained(model_dir, show_progress=False, **parallel) as gen:
        if parallel:
            attn = gen.pipeline.denoising_stage.denoise_step.transformer.blocks[0].attn1
            assert attn.to_out[0].tp_size == 2 and isinstance(attn.norm_q, ParallelRMSNorm)
            assert attn.num_heads == 1  # 1 of the tiny model's 2 heads
        out = gen.generate("a red square", negative_prompt="blurry", **PARAMS)
        return np.asarray(out.frames, dtype=np.int16)  # (videos, frames, height, width, 3)


def test_tp_generation_equals_one_rank(tiny_wan_dir: Path, one_thread: None) -> None:
    expected = generate_frames(tiny_wan_dir)
    frames = generate_frames(tiny_wan_dir, num_gpus=2, tp_size=2)
    assert frames.shape == expected.shape and frames.shape[:2] == (1, PARAMS["num_frames"])
    assert expected.std() > 10, "the tiny model's frames are flat: the comparison would prove nothing"
    diff = int(np.abs(frames - expected).max())
    print(f"tp 2: max pixel difference {diff} over {frames.shape}")
    assert diff <= 1
