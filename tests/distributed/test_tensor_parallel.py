"""Tensor parallelism: how column/row-parallel Linears cut their features, and TP end to end in the engine:
whole generations (FLUX under TP 2 and CFG 2 x TP 2, Wan 2.1 text-to-video under TP 2) give the one-rank
images or frames.

Each family's DiT loaded as TP shards against its one-device forward is in test_dit_tensor_parallel.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from diffserve.layers.tensor_parallel import (
    ColumnParallelLinear,
    ParallelRMSNorm,
    ShardSpec,
    shard_ranges,
)
from diffserve.testing.distributed import LoadOnlyRank
from diffserve.testing.threads import one_torch_thread


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


# ------------------------------------------------------------------------------------- end to end


@pytest.fixture
def one_thread() -> Iterator[None]:
    with one_torch_thread():  # the workers take the parent's thread count
        yield


@pytest.fixture(scope="module")
def tiny_wan_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from diffserve.families.wan.tiny import build_tiny_wan

    return build_tiny_wan(tmp_path_factory.mktemp("tiny-wan"))


def flux_sharded(gen: Any) -> None:
    attn = gen.pipeline.denoiser.transformer.transformer_blocks[0].attn
    assert attn.to_out[0].tp_size == 2 and attn.to_qkv.out_features == 3 * 16  # 1 of 2 heads, fused


def wan_sharded(gen: Any) -> None:
    attn = gen.pipeline.denoising_stage.denoise_step.transformer.blocks[0].attn1
    assert attn.to_out[0].tp_size == 2 and isinstance(attn.norm_q, ParallelRMSNorm)
    assert attn.num_heads == 1  # 1 of the tiny model's 2 heads


WAN_FRAMES = 5


def wan_frames(out: np.ndarray, expected: np.ndarray) -> None:
    assert out.shape[:2] == (1, WAN_FRAMES)  # (videos, frames, height, width, 3)
    assert expected.std() > 10, "the tiny model's frames are flat: the comparison would prove nothing"


@dataclass(frozen=True)
class Generation:
    #: The fixture of the tiny model folder.
    model_dir: str
    params: dict[str, object]
    #: The output as an int16 array: the image, or the videos' frames.
    pixels: Callable[[Any], np.ndarray]
    #: Checks of the sharded pipeline's DiT.
    sharded: Callable[[Any], None]
    #: Checks of the TP output and the one-rank reference beyond their equality.
    check: Callable[[np.ndarray, np.ndarray], None] | None = None


GENERATIONS = {
    "flux": Generation(
        "tiny_flux_dir",
        dict(height=64, width=48, num_inference_steps=3, seed=7, negative_prompt="blurry", true_cfg_scale=3.0),
        lambda out: np.asarray(out.images[0], dtype=np.int16),
        flux_sharded,
    ),
    "wan": Generation(
        "tiny_wan_dir",
        dict(height=32, width=32, num_frames=WAN_FRAMES, num_inference_steps=2, guidance_scale=4.0, seed=7,
             negative_prompt="blurry"),
        lambda out: np.asarray(out.frames, dtype=np.int16),
        wan_sharded,
        wan_frames,
    ),
}  # fmt: skip


def generate(family: str, model_dir: Path, **parallel: object) -> np.ndarray:
    from diffserve.api import DiffGenerator

    spec = GENERATIONS[family]
    with DiffGenerator.from_pretrained(model_dir, show_progress=False, **parallel) as gen:
        if parallel:
            spec.sharded(gen)
        return spec.pixels(gen.generate("a red square", **spec.params))


@pytest.fixture(scope="module")
def one_rank_pixels() -> Callable[[str, Path], np.ndarray]:
    """A family's one-rank output (generated once)."""
    cache: dict[str, np.ndarray] = {}

    def get(family: str, model_dir: Path) -> np.ndarray:
        if family not in cache:
            cache[family] = generate(family, model_dir)
        return cache[family]

    return get


PARALLEL = {
    "flux-tp2": ("flux", dict(num_gpus=2, tp_size=2)),
    "flux-cfg2xtp2": ("flux", dict(num_gpus=4, tp_size=2, enable_cfg_parallel=True)),
    "wan-tp2": ("wan", dict(num_gpus=2, tp_size=2)),
}


@pytest.mark.parametrize(("family", "parallel"), PARALLEL.values(), ids=PARALLEL.keys())
def test_tp_generation_equals_one_rank(
    request: pytest.FixtureRequest, one_rank_pixels, one_thread: None, family: str, parallel: dict
) -> None:
    model_dir = request.getfixturevalue(GENERATIONS[family].model_dir)
    expected = one_rank_pixels(family, model_dir)
    out = generate(family, model_dir, **parallel)
    assert out.shape == expected.shape
    if GENERATIONS[family].check is not None:
        GENERATIONS[family].check(out, expected)
    diff = int(np.abs(out - expected).max())
    print(f"{family} {parallel}: max pixel difference {diff} over {out.shape}")
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
