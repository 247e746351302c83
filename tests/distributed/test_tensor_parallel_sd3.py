"""Tensor parallelism for SD3's / SD3.5's DiT: loaded as TP shards (each rank reading only its slices of the
safetensors file) it equals the one-device DiT, alone and with Ulysses.

The tiny model is SD3.5-medium-like so that every sharded path runs: RMS QK-norm (per head, so it stays
whole on every rank), dual-attention blocks (`attn2`), among them the last, `context_pre_only` block (no
text output projection, no text MLP). The sharded-load checks run in this process; the forwards run on
gloo ranks (`run_distributed`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn

from diffserve.distributed.config import ParallelConfig
from diffserve.distributed.state import ParallelState, build_parallel_state, parallel_scope
from diffserve.layers.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    tensor_parallel_shards,
)
from diffserve.errors import ModelLoadError
from diffserve.layers.norms import RMSNorm
from diffserve.loader.safetensors_weights import load_safetensors_into
from diffserve.models.dits.sd3 import SD3Transformer2DModel
from diffserve.testing.distributed import run_distributed

CHANNELS, TEXT_DIM, POOLED_DIM, HEADS, HEAD_DIM = 4, 16, 12, 4, 8
INNER = HEADS * HEAD_DIM
DIT_CONFIG = {
    "sample_size": 8, "patch_size": 2, "in_channels": CHANNELS, "num_layers": 3,
    "attention_head_dim": HEAD_DIM, "num_attention_heads": HEADS, "joint_attention_dim": TEXT_DIM,
    "caption_projection_dim": INNER, "pooled_projection_dim": POOLED_DIM, "out_channels": CHANNELS,
    "pos_embed_max_size": 16, "dual_attention_layers": [0, 2], "qk_norm": "rms_norm",
}  # fmt: skip
BATCH, HEIGHT, WIDTH, TEXT_LEN = 3, 12, 10, 7  # patch 2: a 6x5 grid of image tokens (non-square)
WEIGHTS = "diffusion_pytorch_model.safetensors"


@dataclass(frozen=True)
class LoadOnlyRank:
    """A TP rank for building and loading shards in this process (no group: no forward)."""

    tp_size: int
    tp_rank: int
    tp_group: dist.ProcessGroup | None = None


@pytest.fixture(scope="module")
def dit_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A seeded SD3.5-style transformer folder, weights large enough that every block matters."""
    from diffserve.testing.tiny_writing import save_diffusers_model

    torch.manual_seed(0)
    model = SD3Transformer2DModel.from_config(DIT_CONFIG)
    for p in model.parameters():  # the position table is a buffer: it keeps its sincos values
        nn.init.normal_(p, std=0.2)
    directory = tmp_path_factory.mktemp("tp-sd3") / "transformer"
    save_diffusers_model(model, directory, "SD3Transformer2DModel", DIT_CONFIG)
    return directory


def dit_inputs() -> dict[str, torch.Tensor]:
    """A CFG-like pair (one latent, two prompts, one timestep) plus a row at another timestep."""
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(BATCH, CHANNELS, HEIGHT, WIDTH, generator=g)
    latents[1] = latents[0]
    return {
        "hidden_states": latents,
        "encoder_hidden_states": torch.randn(BATCH, TEXT_LEN, TEXT_DIM, generator=g),
        "pooled_projections": torch.randn(BATCH, POOLED_DIM, generator=g),
        "timestep": torch.tensor([700.0, 700.0, 250.0]),
    }


def load_dit(directory: Path, tp: LoadOnlyRank | ParallelState | None) -> SD3Transformer2DModel:
    """The loader's steps (without importing the component loader, which imports transformers: seconds
    per rank process): build on meta, shard when `tp` is given, read the (shard's) weights."""
    with torch.device("meta"):
        model = SD3Transformer2DModel.from_config(DIT_CONFIG)
    if tp is not None:
        model.shard_for_tensor_parallel(tp)
    load_safetensors_into(model, [directory / WEIGHTS], torch.device("cpu"), torch.float32)
    return model.eval()


# ----------------------------------------------------------------------------------- in this process


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_holds_only_its_heads_and_mlp_features(dit_dir: Path, rank: int) -> None:
    full = load_file(str(dit_dir / WEIGHTS))
    with torch.device("meta"):
        model = SD3Transformer2DModel.from_config(DIT_CONFIG)
    model.shard_for_tensor_parallel(LoadOnlyRank(2, rank))
    num_bytes = load_safetensors_into(model, [dit_dir / WEIGHTS], torch.device("cpu"), torch.float32)
    specs = tensor_parallel_shards(model)
    # The loader read this rank's slices of the sharded tensors and nothing more (it counts what it read).
    assert num_bytes == sum(t.numel() * 4 for t in model.state_dict().values())
    assert num_bytes < sum(t.numel() * 4 for t in full.values())
    # Joint attention 6 q/k/v + to_out + to_add_out, attn2 3 + 1, MLPs 2 + 2; the last block has no
    # to_add_out and no text MLP. Blocks: 0 dual (16), 1 plain (12), 2 last and dual (13).
    assert len([k for k in specs if k.endswith(".weight")]) == 16 + 12 + 13
    assert not any(k.startswith("transformer_blocks.2.ff_context") for k in specs)
    state = model.state_dict()
    for key, spec in specs.items():
        assert torch.equal(state[key], spec.take(full[key])), key
    # Embedders, adaLN, per-head QK-norms, row-parallel biases, the output head, the position table.
    for key in full.keys() - specs.keys():
        assert torch.equal(state[key], full[key]), key
    half = (rank * INNER // 2, (rank + 1) * INNER // 2)  # 2 of the 4 heads x 8
    assert specs["transformer_blocks.0.attn.add_k_proj.weight"].ranges == (half,)
    assert specs["transformer_blocks.1.attn.to_add_out.weight"].ranges == (half,)
    assert specs["transformer_blocks.2.attn2.to_out.0.weight"].ranges == (half,)
    assert specs["transformer_blocks.1.ff_context.net.0.proj.bias"].ranges == ((rank * 64, rank * 64 + 64),)
    last = model.transformer_blocks[2]
    assert isinstance(last.attn.add_v_proj, ColumnParallelLinear) and last.attn.to_add_out is None
    assert isinstance(last.attn2.to_out[0], RowParallelLinear) and last.ff_context is None
    assert type(last.attn.norm_added_k) is RMSNorm and last.attn.norm_added_k.weight.shape == (HEAD_DIM,)


def test_heads_that_do_not_divide_the_tp_size_are_refused(dit_dir: Path) -> None:
    from diffserve.loader.component_loader import load_native_model
    from diffserve.loader.model_index import ComponentSpec
    from diffserve.platforms.cpu import CpuPlatform

    spec = ComponentSpec("transformer", "diffusers", "SD3Transformer2DModel", dit_dir)
    with pytest.raises(ModelLoadError, match=r"--tp-size 3: the SD3 DiT's 4 attention heads do not divide"):
        load_native_model(spec, SD3Transformer2DModel, CpuPlatform(), torch.float32, LoadOnlyRank(3, 0))


def test_a_loaded_model_cannot_be_sharded(dit_dir: Path) -> None:
    with pytest.raises(RuntimeError, match="before loading"):
        load_dit(dit_dir, None).shard_for_tensor_parallel(LoadOnlyRank(2, 0))


# ------------------------------------------------------------------------------------ on gloo ranks


def _tp_forward(rank: int, world_size: int, dit_dir: Path, ulysses: int) -> dict[str, object]:
    config = ParallelConfig(num_gpus=world_size, tp_size=2, ulysses_degree=ulysses)
    state = build_parallel_state(config, local_rank=rank, control_timeout=timedelta(seconds=60))
    with torch.no_grad():
        model = load_dit(dit_dir, state)
        with parallel_scope(state):
            out = model(**dit_inputs())
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"out": out, "param_bytes": param_bytes}


def sharded_bytes() -> int:
    """fp32 bytes of the checkpoint tensors TP shards (the attention and MLP projections)."""
    with torch.device("meta"):
        model = SD3Transformer2DModel.from_config(DIT_CONFIG)
    model.shard_for_tensor_parallel(LoadOnlyRank(2, 0))
    return sum(4 * math.prod(spec.full_shape) for spec in tensor_parallel_shards(model).values())


@pytest.fixture(scope="module")
def one_device(dit_dir: Path) -> tuple[torch.Tensor, int]:
    model = load_dit(dit_dir, None)
    with torch.no_grad():
        out = model(**dit_inputs())
    # The prompts and the timesteps reach the image: a shard that lost either could not pass the parity.
    assert (out[0] - out[1]).abs().max() > 1e-2 * out.abs().max()
    assert (out[0] - out[2]).abs().max() > 1e-2 * out.abs().max()
    return out, sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize(("world_size", "ulysses"), [(2, 1)], ids=["tp2"])
def test_tp_dit_equals_one_device(dit_dir: Path, one_device, world_size: int, ulysses: int) -> None:
    expected, whole_bytes = one_device
    results = run_distributed(_tp_forward, world_size, dit_dir, ulysses, timeout_s=120)
    for rank, result in enumerate(results):
        assert result["out"].shape == expected.shape == (BATCH, CHANNELS, HEIGHT, WIDTH)
        error = (result["out"] - expected).abs().max().item()
        print(f"tp 2 x ulysses {ulysses}, rank {rank}: max abs error {error:.2e} "
              f"(output max {expected.abs().max().item():.2f}), "
              f"params {result['param_bytes']} of {whole_bytes} bytes")  # fmt: skip
        # fp32: the row-parallel all-reduce only reorders each output projection's sum.
        assert error < 1e-5 * expected.abs().max().item(), error
        assert result["param_bytes"] == whole_bytes - sharded_bytes() // 2
