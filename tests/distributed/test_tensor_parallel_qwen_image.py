"""Tensor parallelism for Qwen-Image's DiT: loaded as TP shards (each rank reading only its slices of the
safetensors file) it equals the one-device DiT, for a batch whose rows run at different timesteps and
whose second prompt is padded (text mask), on a non-square latent grid.

Qwen-Image's QK-norms are per head, so a head shard keeps them whole (no communication); the joint
attention finds this rank's head count from the projections' width. The sharded-load checks run in this
process; the forwards run on gloo ranks (`run_distributed`).
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
from diffserve.models.dits.qwen_image import QwenImageTransformer2DModel
from diffserve.testing.distributed import run_distributed

CHANNELS, TEXT_DIM, HEADS, HEAD_DIM = 16, 24, 4, 16
DIT_CONFIG = {
    "patch_size": 2, "in_channels": CHANNELS, "out_channels": 4, "num_layers": 2,
    "attention_head_dim": HEAD_DIM, "num_attention_heads": HEADS, "joint_attention_dim": TEXT_DIM,
    "axes_dims_rope": [4, 6, 6],
}  # fmt: skip
GRID = (1, 6, 5)  # (frames, rows, columns) in patches: 30 image tokens, not square
TEXT_LEN, REAL_TEXT = 7, (7, 4, 7)  # the second prompt is padded: 4 real tokens of 7
TIMESTEPS = (0.9, 0.9, 0.3)  # a CFG-like pair, then a row at another timestep
WEIGHTS = "diffusion_pytorch_model.safetensors"


@dataclass(frozen=True)
class LoadOnlyRank:
    """A TP rank for building and loading shards in this process (no group: no forward)."""

    tp_size: int
    tp_rank: int
    tp_group: dist.ProcessGroup | None = None


@pytest.fixture(scope="module")
def dit_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A seeded Qwen-Image transformer folder, weights large enough that every block matters."""
    from diffserve.testing.tiny_writing import save_diffusers_model

    torch.manual_seed(0)
    model = QwenImageTransformer2DModel.from_config(DIT_CONFIG)
    for p in model.parameters():
        nn.init.normal_(p, std=0.2)
    directory = tmp_path_factory.mktemp("tp-qwen-image") / "transformer"
    save_diffusers_model(model, directory, "QwenImageTransformer2DModel", DIT_CONFIG)
    return directory


def dit_inputs() -> dict[str, object]:
    """Rows 0 and 1 share the latent and timestep (two prompts, the second padded); row 2 is at another t."""
    g = torch.Generator().manual_seed(1)
    batch = len(TIMESTEPS)
    latents = torch.randn(batch, math.prod(GRID), CHANNELS, generator=g)
    latents[1] = latents[0]
    return {
        "hidden_states": latents,
        "encoder_hidden_states": torch.randn(batch, TEXT_LEN, TEXT_DIM, generator=g),
        "encoder_hidden_states_mask": torch.arange(TEXT_LEN)[None, :] < torch.tensor(REAL_TEXT)[:, None],
        "timestep": torch.tensor(TIMESTEPS),
        "img_shapes": [[GRID]] * batch,
    }


def load_dit(directory: Path, tp: LoadOnlyRank | ParallelState | None) -> QwenImageTransformer2DModel:
    """The loader's steps (without importing the component loader, which imports transformers: seconds
    per rank process): build on meta, shard when `tp` is given, read the (shard's) weights."""
    with torch.device("meta"):
        model = QwenImageTransformer2DModel.from_config(DIT_CONFIG)
    if tp is not None:
        model.shard_for_tensor_parallel(tp)
    load_safetensors_into(model, [directory / WEIGHTS], torch.device("cpu"), torch.float32)
    return model.eval()


# ----------------------------------------------------------------------------------- in this process


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_holds_only_its_heads_and_mlp_features(dit_dir: Path, rank: int) -> None:
    full = load_file(str(dit_dir / WEIGHTS))
    with torch.device("meta"):
        model = QwenImageTransformer2DModel.from_config(DIT_CONFIG)
    model.shard_for_tensor_parallel(LoadOnlyRank(2, rank))
    num_bytes = load_safetensors_into(model, [dit_dir / WEIGHTS], torch.device("cpu"), torch.float32)
    specs = tensor_parallel_shards(model)
    # The loader read this rank's slices of the sharded tensors and nothing more (it counts what it read).
    assert num_bytes == sum(p.numel() * 4 for p in model.parameters())
    assert num_bytes < sum(t.numel() * 4 for t in full.values())
    # Per block: 6 q/k/v (image and text) + to_out.0 + to_add_out + 2 MLPs x 2: 12 weights.
    assert len([k for k in specs if k.endswith(".weight")]) == 2 * 12
    state = model.state_dict()
    for key, spec in specs.items():
        assert torch.equal(state[key], spec.take(full[key])), key
    for key in full.keys() - specs.keys():  # embedders, adaLN, QK-norms, row biases, output head
        assert torch.equal(state[key], full[key]), key
    heads = (rank * 32, rank * 32 + 32)  # 2 of the 4 heads x 16
    mlp = (rank * 128, rank * 128 + 128)  # half of 4 x 64 MLP features
    attn = model.transformer_blocks[1].attn
    assert specs["transformer_blocks.1.attn.add_k_proj.weight"].ranges == (heads,)
    assert specs["transformer_blocks.1.attn.add_k_proj.bias"].ranges == (heads,)
    assert specs["transformer_blocks.0.attn.to_add_out.weight"].ranges == (heads,)
    assert specs["transformer_blocks.0.txt_mlp.net.2.weight"].ranges == (mlp,)
    assert isinstance(attn.to_v, ColumnParallelLinear) and isinstance(attn.to_out[0], RowParallelLinear)
    assert type(attn.norm_added_q) is RMSNorm and attn.norm_added_q.weight.shape == (HEAD_DIM,)


def test_heads_that_do_not_divide_the_tp_size_are_refused(dit_dir: Path) -> None:
    from diffserve.loader.component_loader import load_native_model
    from diffserve.loader.model_index import ComponentSpec
    from diffserve.platforms.cpu import CpuPlatform

    spec = ComponentSpec("transformer", "diffusers", "QwenImageTransformer2DModel", dit_dir)
    with pytest.raises(
        ModelLoadError, match=r"--tp-size 3: the Qwen-Image DiT's 4 attention heads do not divide"
    ):
        load_native_model(spec, QwenImageTransformer2DModel, CpuPlatform(), torch.float32, LoadOnlyRank(3, 0))


def test_a_loaded_model_cannot_be_sharded(dit_dir: Path) -> None:
    with pytest.raises(RuntimeError, match="before loading"):
        load_dit(dit_dir, None).shard_for_tensor_parallel(LoadOnlyRank(2, 0))


# ------------------------------------------------------------------------------------ on gloo ranks


def _tp_forward(rank: int, world_size: int, dit_dir: Path) -> dict[str, object]:
    config = ParallelConfig(num_gpus=world_size, tp_size=world_size)
    state = build_parallel_state(config, local_rank=rank, control_timeout=timedelta(seconds=60))
    with torch.no_grad():
        model = load_dit(dit_dir, state)
        with parallel_scope(state):
            out = model(**dit_inputs())
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"out": out, "param_bytes": param_bytes}


def sharded_bytes() -> int:
    """fp32 bytes of the checkpoint tensors TP shards (the blocks' attention and MLP projections)."""
    with torch.device("meta"):
        model = QwenImageTransformer2DModel.from_config(DIT_CONFIG)
    model.shard_for_tensor_parallel(LoadOnlyRank(2, 0))
    return sum(4 * math.prod(spec.full_shape) for spec in tensor_parallel_shards(model).values())


@pytest.fixture(scope="module")
def one_device(dit_dir: Path) -> tuple[torch.Tensor, int]:
    model = load_dit(dit_dir, None)
    with torch.no_grad():
        out = model(**dit_inputs())
        unmasked = model(**dict(dit_inputs(), encoder_hidden_states_mask=None))
    # What the parity test relies on: the prompts reach the image (the CFG rows differ), the padded row's
    # mask matters (unmasked, its output changes), and the timestep matters (rows 0 and 2 differ).
    scale = out.abs().max()
    assert (out[0] - out[1]).abs().max() > 1e-2 * scale
    assert (unmasked[1] - out[1]).abs().max() > 1e-3 * scale
    assert torch.equal(unmasked[0], out[0])
    return out, sum(p.numel() * p.element_size() for p in model.parameters())


def test_tp2_dit_equals_one_device(dit_dir: Path, one_device) -> None:
    expected, whole_bytes = one_device
    results = run_distributed(_tp_forward, 2, dit_dir, timeout_s=120)
    for rank, result in enumerate(results):
        assert result["out"].shape == expected.shape == (len(TIMESTEPS), math.prod(GRID), 2 * 2 * 4)
        error = (result["out"] - expected).abs().max().item()
        print(f"tp 2, rank {rank}: max abs error {error:.2e} (output max {expected.abs().max().item():.2f}), "
              f"params {result['param_bytes']} of {whole_bytes} bytes")  # fmt: skip
        # fp32: the row-parallel all-reduces only reorder the output projections' sums.
        assert error < 2e-6 * expected.abs().max().item(), error
        # Half of every sharded tensor, all of the replicated ones.
        assert result["param_bytes"] == whole_bytes - sharded_bytes() // 2
