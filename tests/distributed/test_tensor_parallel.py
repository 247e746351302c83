"""Tensor parallelism: column/row-parallel Linears, a FLUX DiT loaded as TP shards (each rank reading only
its slices of the safetensors file) equal to the one-device DiT, and TP end to end in the engine.

The sharded-load checks run in this process (a TP "rank" needs no process group until a row-parallel
layer's forward all-reduces); the forwards run on gloo ranks (`run_distributed`, one torch thread each):
TP 2 alone and TP 2 x Ulysses 2 for the DiT, TP 2 and CFG 2 x TP 2 for whole generations.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn

from diffserve.distributed.config import ParallelConfig
from diffserve.distributed.state import ParallelState, build_parallel_state, parallel_scope
from diffserve.layers.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardSpec,
    shard_ranges,
    tensor_parallel_shards,
)
from diffserve.errors import ModelLoadError
from diffserve.loader import safetensors_weights
from diffserve.loader.safetensors_weights import load_safetensors_into
from diffserve.models.dits.flux import FluxTransformer2DModel
from diffserve.testing.distributed import run_distributed

DIT_CONFIG = {
    "patch_size": 1, "in_channels": 16, "out_channels": None, "num_layers": 2, "num_single_layers": 2,
    "attention_head_dim": 8, "num_attention_heads": 4, "joint_attention_dim": 24,
    "pooled_projection_dim": 12, "guidance_embeds": True, "axes_dims_rope": [2, 2, 4],
}  # fmt: skip
TEXT_LEN, GRID_H, GRID_W = 7, 6, 5


@dataclass(frozen=True)
class LoadOnlyRank:
    """A TP rank for building and loading shards in this process (no group: no forward)."""

    tp_size: int
    tp_rank: int
    tp_group: dist.ProcessGroup | None = None


@pytest.fixture(scope="module")
def dit_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A seeded FLUX transformer folder (config.json + safetensors), weights large enough that every
    block matters."""
    from diffserve.testing.tiny_writing import save_diffusers_model

    torch.manual_seed(0)
    model = FluxTransformer2DModel.from_config(DIT_CONFIG)
    for p in model.parameters():
        nn.init.normal_(p, std=0.2)
    directory = tmp_path_factory.mktemp("tp-flux") / "transformer"
    save_diffusers_model(model, directory, "FluxTransformer2DModel", DIT_CONFIG)
    return directory


def dit_inputs() -> dict[str, torch.Tensor]:
    """A CFG-like batch of 2 rows at different timesteps on a non-square grid. Made in this process and
    sent to the ranks: `diffserve.families.flux.tiny` imports transformers, seconds per rank process."""
    from diffserve.families.flux.tiny import flux_dit_inputs

    return flux_dit_inputs(GRID_H, GRID_W, TEXT_LEN, timesteps=[0.9, 0.3])


def load_dit(directory: Path, tp: LoadOnlyRank | None) -> FluxTransformer2DModel:
    """The DiT as the component loader loads it (sharded when `tp` is given, then fused)."""
    from diffserve.loader.component_loader import load_native_model
    from diffserve.loader.model_index import ComponentSpec
    from diffserve.platforms.cpu import CpuPlatform

    spec = ComponentSpec("transformer", "diffusers", "FluxTransformer2DModel", directory)
    module, _ = load_native_model(spec, FluxTransformer2DModel, CpuPlatform(), torch.float32, tp)
    assert isinstance(module, FluxTransformer2DModel)
    return module


def load_dit_on_rank(directory: Path, state: ParallelState) -> FluxTransformer2DModel:
    """`load_native_model`'s steps for this DiT on a rank (without importing the component loader, which
    imports transformers: seconds per rank process): build on meta, shard, read the shard, fuse."""
    with torch.device("meta"):
        model = FluxTransformer2DModel.from_config(DIT_CONFIG)
    model.shard_for_tensor_parallel(state)
    load_safetensors_into(
        model, [directory / "diffusion_pytorch_model.safetensors"], torch.device("cpu"), torch.float32
    )
    model.eval().fuse_for_inference()
    return model


# ----------------------------------------------------------------------------------- in this process


def test_shard_ranges_take_each_segments_piece() -> None:
    assert shard_ranges([8], 2, 1) == ((4, 8),)
    assert shard_ranges([8, 32], 2, 1) == ((4, 8), (24, 40))  # [attention; MLP]: its piece of each
    with pytest.raises(ValueError, match="a segment of 6 features does not split over 4 TP ranks"):
        shard_ranges([6], 4, 0)
    full = torch.arange(2 * 40).reshape(2, 40)
    spec = ShardSpec((2, 40), 1, shard_ranges([8, 32], 2, 1))
    assert spec.local_shape == (2, 20)
    assert torch.equal(spec.take(full), torch.cat([full[:, 4:8], full[:, 24:40]], dim=1))


def test_only_plain_linears_are_sharded() -> None:
    with pytest.raises(TypeError, match="only a plain nn.Linear"):
        ColumnParallelLinear.replacing(nn.Conv2d(2, 2, 1), LoadOnlyRank(2, 0))  # type: ignore[arg-type]


class ReadSpy:
    """Wraps the loader's `open_safetensors`: records whole-tensor reads, sliced reads and their bytes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.whole: list[str] = []
        self.slices: dict[str, list[tuple[slice, ...]]] = {}
        self.bytes = 0
        real_open = safetensors_weights.open_safetensors
        spy = self

        class SpySlice:
            def __init__(self, inner, key: str) -> None:
                self.inner, self.key = inner, key

            def get_shape(self) -> list[int]:
                return self.inner.get_shape()

            def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
                spy.slices.setdefault(self.key, []).append(index)
                out = self.inner[index]
                spy.bytes += out.numel() * out.element_size()
                return out

        class SpyFile:
            def __init__(self, inner) -> None:
                self.inner = inner

            def __enter__(self) -> SpyFile:
                self.inner.__enter__()
                return self

            def __exit__(self, *exc: object) -> None:
                self.inner.__exit__(*exc)

            def keys(self) -> list[str]:
                return self.inner.keys()

            def get_tensor(self, key: str) -> torch.Tensor:
                spy.whole.append(key)
                out = self.inner.get_tensor(key)
                spy.bytes += out.numel() * out.element_size()
                return out

            def get_slice(self, key: str) -> SpySlice:
                return SpySlice(self.inner.get_slice(key), key)

        monkeypatch.setattr(
            safetensors_weights, "open_safetensors", lambda *a, **kw: SpyFile(real_open(*a, **kw))
        )


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_reads_only_its_shard(dit_dir: Path, monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
    full = load_file(str(dit_dir / "diffusion_pytorch_model.safetensors"))
    with torch.device("meta"):
        model = FluxTransformer2DModel.from_config(DIT_CONFIG)
    model.shard_for_tensor_parallel(LoadOnlyRank(2, rank))
    specs = tensor_parallel_shards(model)
    spy = ReadSpy(monkeypatch)
    num_bytes = load_safetensors_into(
        model, [dit_dir / "diffusion_pytorch_model.safetensors"], "cpu", torch.float32
    )

    # 2 double-stream blocks x (6 q/k/v + 2 out + 2 x 2 MLP) + 2 single x (4 columns + proj_out), weights and
    # column biases.
    assert len([k for k in specs if k.endswith(".weight")]) == 2 * 12 + 2 * 5
    assert not set(spy.whole) & set(specs), "a sharded tensor was read whole"
    assert set(spy.slices) == set(specs)
    state = model.state_dict()
    for key, spec in specs.items():
        assert spy.slices[key] == spec.indices(), key
        assert torch.equal(state[key], spec.take(full[key])), key
    for key in full.keys() - specs.keys():  # replicated: adaLN, embedders, row biases, norms, output head
        assert torch.equal(state[key], full[key]), key
    # proj_out of a single-stream block reads its piece of the attention columns and of the MLP columns.
    assert specs["single_transformer_blocks.0.proj_out.weight"].ranges == (
        ((0, 16), (32, 96)) if rank == 0 else ((16, 32), (96, 160))
    )

    sharded_full = sum(full[k].numel() * 4 for k in specs)
    sharded_here = sum(state[k].numel() * 4 for k in specs)
    whole = sum(t.numel() * 4 for k, t in full.items() if k not in specs)
    assert sharded_here * 2 == sharded_full  # each rank holds half of every sharded tensor
    assert num_bytes == spy.bytes == sharded_here + whole  # and read nothing else from them
    print(f"rank {rank}: read {num_bytes} of {sharded_full + whole} bytes")


def test_a_sharded_tensor_of_another_full_shape_is_refused_naming_it(dit_dir: Path, tmp_path: Path) -> None:
    """The shard's ranges are checked against the checkpoint's full shape before anything is sliced."""
    config = {**DIT_CONFIG, "num_layers": 1, "num_single_layers": 0}
    with torch.device("meta"):
        model = FluxTransformer2DModel.from_config(config)
    model.shard_for_tensor_parallel(LoadOnlyRank(2, 0))
    full = load_file(str(dit_dir / "diffusion_pytorch_model.safetensors"))
    tensors = {k: v for k, v in full.items() if not k.startswith(("transformer_blocks.1.", "single_"))}
    tensors["transformer_blocks.0.attn.to_q.weight"] = torch.zeros(40, 32)  # not (32, 32)
    save_file(tensors, str(tmp_path / "w.safetensors"))
    with pytest.raises(ModelLoadError, match=r"'transformer_blocks.0.attn.to_q.weight' has shape \(40, 32\)"):
        load_safetensors_into(model, [tmp_path / "w.safetensors"], torch.device("cpu"), torch.float32)


def test_heads_that_do_not_divide_the_tp_size_are_refused(dit_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="the FLUX DiT's 4 attention heads do not divide over 3"):
        load_dit(dit_dir, LoadOnlyRank(3, 0))


def test_a_loaded_model_cannot_be_sharded(dit_dir: Path) -> None:
    model = load_dit(dit_dir, None)
    with pytest.raises(RuntimeError, match="before loading"):
        model.shard_for_tensor_parallel(LoadOnlyRank(2, 0))


# ------------------------------------------------------------------------------------ on 2 gloo ranks


def _layer_errors(state: ParallelState) -> dict[str, float]:
    """Column, row (two segments) and a column -> GELU -> row MLP against plain Linears."""
    torch.manual_seed(3)
    first, second = nn.Linear(12, 16), nn.Linear(16, 12)
    x = torch.randn(3, 5, 12)
    column = ColumnParallelLinear.replacing(first, state)
    row = RowParallelLinear.replacing(second, state, segments=(4, 12))
    for sharded, whole in ((column, first), (row, second)):
        params = dict(whole.named_parameters())
        specs = sharded.shard_specs()
        sharded.load_state_dict({n: specs[n].take(p) if n in specs else p for n, p in params.items()})
    with torch.no_grad():
        pieces = [torch.empty(3, 5, 8) for _ in range(2)]
        dist.all_gather(pieces, column(x).contiguous(), group=state.tp_group)
        hidden = torch.nn.functional.gelu(first(x))
        local_hidden = ShardSpec(tuple(hidden.shape), 2, row.shard_specs()["weight"].ranges).take(hidden)
        return {
            "column": (torch.cat(pieces, dim=-1) - first(x)).abs().max().item(),
            "row": (row(local_hidden) - second(hidden)).abs().max().item(),
        }


def _tp_forward(
    rank: int, world_size: int, dit_dir: Path, ulysses: int, inputs: dict[str, torch.Tensor]
) -> dict[str, object]:
    config = ParallelConfig(num_gpus=world_size, tp_size=2, ulysses_degree=ulysses)
    state = build_parallel_state(config, local_rank=rank, control_timeout=timedelta(seconds=60))
    errors = _layer_errors(state) if ulysses == 1 else {}
    model = load_dit_on_rank(dit_dir, state)
    with torch.no_grad(), parallel_scope(state):
        out = model(**inputs)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"errors": errors, "out": out, "param_bytes": param_bytes}


def sharded_bytes() -> int:
    """fp32 bytes of the checkpoint tensors TP shards (the blocks' attention and MLP projections)."""
    with torch.device("meta"):
        model = FluxTransformer2DModel.from_config(DIT_CONFIG)
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
    results = run_distributed(_tp_forward, world_size, dit_dir, ulysses, dit_inputs(), timeout_s=120)
    for rank, result in enumerate(results):
        for layer, error in result["errors"].items():
            assert error < 1e-6, (layer, error)
        error = (result["out"] - expected).abs().max().item()
        print(f"tp 2 x ulysses {ulysses}, rank {rank}: max abs error {error:.2e}, "
              f"params {result['param_bytes']} of {whole_bytes} bytes")  # fmt: skip
        assert error < 1e-5 * expected.abs().max().item(), error
        # Half of every sharded tensor, all of the replicated ones.
        assert result["param_bytes"] == whole_bytes - sharded_bytes() // 2


# ------------------------------------------------------------------------------------- end to end


@pytest.fixture
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers take the parent's thread count
    yield
    torch.set_num_threads(threads)


PARAMS = dict(
    height=64, width=48, num_inference_steps=3, seed=7, negative_prompt="blurry", true_cfg_scale=3.0
)


def generate_pixels(model_dir: Path, **parallel: object) -> np.ndarray:
    from diffserve.api import DiffGenerator

    with DiffGenerator.from_pretrained(model_dir, show_progress=False, **parallel) as gen:
        if parallel:
            attn = gen.pipeline.denoiser.transformer.transformer_blocks[0].attn
            assert attn.to_out[0].tp_size == 2 and attn.to_qkv.out_features == 3 * 16  # 1 of 2 heads, fused
        return np.asarray(gen.generate("a red square", **PARAMS).images[0], dtype=np.int16)


@pytest.fixture(scope="module")
def one_rank_pixels(tiny_flux_dir: Path) -> np.ndarray:
    return generate_pixels(tiny_flux_dir)


@pytest.mark.parametrize(
    "parallel",
    [dict(num_gpus=2, tp_size=2), dict(num_gpus=4, tp_size=2, enable_cfg_parallel=True)],
    ids=["tp2", "cfg2xtp2"],
)
def test_tp_generation_equals_one_rank(
    tiny_flux_dir: Path, one_rank_pixels: np.ndarray, one_thread: None, parallel: dict[str, object]
) -> None:
    diff = int(np.abs(generate_pixels(tiny_flux_dir, **parallel) - one_rank_pixels).max())
    print(f"{parallel}: max pixel difference {diff}")
    assert diff <= 1


def test_tp_without_a_shardable_dit_is_refused_naming_the_family(tmp_path: Path) -> None:
    from diffserve.api import DiffGenerator
    from diffserve.distributed.config import ParallelConfigError

    index = {"_class_name": "StableDiffusion3Pipeline", "vae": ["diffusers", "AutoencoderKL"]}
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(
        ParallelConfigError, match=r"--tp-size 2: .* not for the sd3 family's DiT \(no transformer"
    ):
        DiffGenerator.from_pretrained(tmp_path, num_gpus=2, tp_size=2)
