"""Tensor parallelism for Z-Image's DiT: loaded as TP shards (each rank reading only its slices of the
safetensors file) it equals the one-device DiT.

Every block kind is sharded: the main layers, the noise refiner and the context refiner (q/k/v and the
SwiGLU's w1/w3 column-parallel, `to_out` and w2 row-parallel). The QK-norm is per head and stays whole.
The batch has two captions of different lengths, two timesteps and two non-square latents of different
sizes, so every stream carries batch padding (masked) and per-sample RoPE tables. The sharded-load checks
run in this process; the TP 2 forward runs on two gloo ranks (`run_distributed`); TP x Ulysses goes
through the same sequence-split machinery as FLUX's and Wan's, which their TP tests cover.
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
from diffserve.layers.tensor_parallel import tensor_parallel_shards
from diffserve.errors import ModelLoadError
from diffserve.loader.safetensors_weights import load_safetensors_into
from diffserve.models.dits.z_image import ZImageTransformer2DModel
from diffserve.testing.distributed import run_distributed

CAP_DIM, CHANNELS, HEADS, HEAD_DIM = 24, 4, 4, 16
DIT_CONFIG = {
    "all_patch_size": [2], "all_f_patch_size": [1], "in_channels": CHANNELS, "dim": HEADS * HEAD_DIM,
    "n_layers": 2, "n_refiner_layers": 1, "n_heads": HEADS, "n_kv_heads": HEADS, "cap_feat_dim": CAP_DIM,
    "axes_dims": [4, 6, 6], "axes_lens": [256, 64, 64],
}  # fmt: skip
HIDDEN = 170  # the SwiGLU width int(64 * 8 / 3): 85 features per rank at TP 2, not divisible by 4
#: (latent (F, H, W), caption tokens, t) per row: non-square latents of two sizes, two caption lengths.
ROWS = (((1, 8, 12), 40, 0.3), ((1, 10, 6), 5, 0.7))
WEIGHTS = "diffusion_pytorch_model.safetensors"


@dataclass(frozen=True)
class LoadOnlyRank:
    """A TP rank for building and loading shards in this process (no group: no forward)."""

    tp_size: int
    tp_rank: int
    tp_group: dist.ProcessGroup | None = None


@pytest.fixture(scope="module")
def dit_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A seeded Z-Image transformer folder, weights large enough that every block matters."""
    from diffserve.testing.tiny_writing import save_diffusers_model

    torch.manual_seed(0)
    model = ZImageTransformer2DModel.from_config(DIT_CONFIG)
    for p in model.parameters():
        nn.init.normal_(p, std=0.2)
    directory = tmp_path_factory.mktemp("tp-z-image") / "transformer"
    save_diffusers_model(model, directory, "ZImageTransformer2DModel", DIT_CONFIG)
    return directory


def dit_inputs() -> dict[str, object]:
    g = torch.Generator().manual_seed(1)
    return {
        "x": [torch.randn(CHANNELS, *size, generator=g) for size, _, _ in ROWS],
        "t": torch.tensor([t for _, _, t in ROWS]),
        "cap_feats": [torch.randn(n, CAP_DIM, generator=g) for _, n, _ in ROWS],
    }


def load_dit(directory: Path, tp: LoadOnlyRank | ParallelState | None) -> ZImageTransformer2DModel:
    """The loader's steps (without importing the component loader, which imports transformers: seconds
    per rank process): build on meta, shard when `tp` is given, read the (shard's) weights."""
    with torch.device("meta"):
        model = ZImageTransformer2DModel.from_config(DIT_CONFIG)
    if tp is not None:
        model.shard_for_tensor_parallel(tp)
    load_safetensors_into(model, [directory / WEIGHTS], torch.device("cpu"), torch.float32)
    return model.eval()


# ----------------------------------------------------------------------------------- in this process


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_holds_only_its_heads_and_mlp_features(dit_dir: Path, rank: int) -> None:
    full = load_file(str(dit_dir / WEIGHTS))
    with torch.device("meta"):
        model = ZImageTransformer2DModel.from_config(DIT_CONFIG)
    model.shard_for_tensor_parallel(LoadOnlyRank(2, rank))
    num_bytes = load_safetensors_into(model, [dit_dir / WEIGHTS], torch.device("cpu"), torch.float32)
    specs = tensor_parallel_shards(model)
    # The loader read this rank's slices of the sharded tensors and nothing more (it counts what it read).
    assert num_bytes == sum(p.numel() * 4 for p in model.parameters())
    assert num_bytes < sum(t.numel() * 4 for t in full.values())
    # q/k/v/out + w1/w2/w3 in each of the 4 blocks (2 main layers, 1 noise refiner, 1 context refiner).
    assert len(specs) == 4 * 7
    assert {k.split(".")[0] for k in specs} == {"layers", "noise_refiner", "context_refiner"}
    state = model.state_dict()
    for key, spec in specs.items():
        assert torch.equal(state[key], spec.take(full[key])), key
    for key in full.keys() - specs.keys():  # per-head QK-norms, sandwich norms, adaLN, embedders, head
        assert torch.equal(state[key], full[key]), key
    heads = (rank * 32, rank * 32 + 32)  # 2 of the 4 heads x 16
    features = (rank * 85, rank * 85 + 85)
    assert specs["context_refiner.0.attention.to_k.weight"].ranges == (heads,)
    assert specs["context_refiner.0.attention.to_k.weight"].dim == 0
    assert specs["layers.1.attention.to_out.0.weight"].ranges == (heads,)
    assert specs["layers.1.attention.to_out.0.weight"].dim == 1
    assert specs["noise_refiner.0.feed_forward.w3.weight"].ranges == (features,)
    assert specs["noise_refiner.0.feed_forward.w2.weight"].ranges == (features,)
    assert specs["noise_refiner.0.feed_forward.w2.weight"].dim == 1
    assert state["layers.0.attention.norm_q.weight"].shape == (HEAD_DIM,)


def test_heads_that_do_not_divide_the_tp_size_are_refused(dit_dir: Path) -> None:
    from diffserve.loader.component_loader import load_native_model
    from diffserve.loader.model_index import ComponentSpec
    from diffserve.platforms.cpu import CpuPlatform

    spec = ComponentSpec("transformer", "diffusers", "ZImageTransformer2DModel", dit_dir)
    with pytest.raises(
        ModelLoadError, match="--tp-size 3: the Z-Image DiT's 4 attention heads do not divide"
    ):
        load_native_model(spec, ZImageTransformer2DModel, CpuPlatform(), torch.float32, LoadOnlyRank(3, 0))


def test_an_mlp_width_that_does_not_divide_is_refused() -> None:
    with torch.device("meta"):
        model = ZImageTransformer2DModel.from_config(DIT_CONFIG)
    with pytest.raises(ValueError, match=f"MLP hidden width {HIDDEN} .* does not divide over 4"):
        model.shard_for_tensor_parallel(LoadOnlyRank(4, 0))


def test_a_loaded_model_cannot_be_sharded(dit_dir: Path) -> None:
    with pytest.raises(RuntimeError, match="before loading"):
        load_dit(dit_dir, None).shard_for_tensor_parallel(LoadOnlyRank(2, 0))


# ------------------------------------------------------------------------------------ on gloo ranks


def _tp_forward(rank: int, world_size: int, dit_dir: Path) -> dict[str, object]:
    config = ParallelConfig(num_gpus=world_size, tp_size=2)
    state = build_parallel_state(config, local_rank=rank, control_timeout=timedelta(seconds=60))
    with torch.no_grad():
        model = load_dit(dit_dir, state)
        with parallel_scope(state):
            out = model(**dit_inputs())
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"out": out, "param_bytes": param_bytes}


def sharded_bytes() -> int:
    """fp32 bytes of the checkpoint tensors TP shards (attention and MLP projections)."""
    with torch.device("meta"):
        model = ZImageTransformer2DModel.from_config(DIT_CONFIG)
    model.shard_for_tensor_parallel(LoadOnlyRank(2, 0))
    return sum(4 * math.prod(spec.full_shape) for spec in tensor_parallel_shards(model).values())


@pytest.fixture(scope="module")
def one_device(dit_dir: Path) -> tuple[list[torch.Tensor], int]:
    model = load_dit(dit_dir, None)
    with torch.no_grad():
        out = model(**dit_inputs())
    return out, sum(p.numel() * p.element_size() for p in model.parameters())


def test_tp2_dit_equals_one_device(dit_dir: Path, one_device) -> None:
    expected, whole_bytes = one_device
    scale = max(e.abs().max().item() for e in expected)
    results = run_distributed(_tp_forward, 2, dit_dir, timeout_s=120)
    for rank, result in enumerate(results):
        outs = result["out"]
        assert [o.shape for o in outs] == [e.shape for e in expected]
        error = max((o - e).abs().max().item() for o, e in zip(outs, expected, strict=True))
        print(f"tp 2, rank {rank}: max abs error {error:.2e} (max |out| {scale:.1f}), "
              f"params {result['param_bytes']} of {whole_bytes} bytes")  # fmt: skip
        # fp32: the row-parallel all-reduce only reorders the projections' sums (a few ulps of |out|).
        assert error < 1e-6 * scale, error
        assert result["param_bytes"] == whole_bytes - sharded_bytes() // 2
