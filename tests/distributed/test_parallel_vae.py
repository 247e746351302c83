"""Row-split (patch-parallel) VAE decode on gloo ranks equals the one-device decode.

Each world size (2, 4) is spawned once (module fixtures) and runs every case on every rank: the same
random weights and latents everywhere (seeded), the one-device decode as the reference, the split
decode, and the max abs difference. Latents have 7 rows (not a multiple of 2 or 4) and are not square.
The end-to-end test runs tiny FLUX on 2 ranks through the engine and checks that rank 0's decoder saw
half the latent rows and the pixels are the one-rank ones.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from diffserve.distributed.config import ParallelConfig
from diffserve.distributed.parallel_vae import (
    HaloConv2d,
    RowSplit,
    SplitGroupNorm,
    balanced_rows,
    decode_rows,
    decode_split,
    row_split_scope,
)
from diffserve.distributed.state import build_parallel_state, parallel_scope
from diffserve.models.vaes.autoencoder_kl import AutoencoderKL
from diffserve.models.vaes.autoencoder_kl_wan import AutoencoderKLWan
from diffserve.testing.distributed import run_distributed
from diffserve.testing.threads import one_torch_thread

#: fp32 tolerance, relative to the output's scale: 64 ulps (float32 eps is 1.19e-7). The split decode
#: runs the same ops on the same numbers except for the GroupNorm statistics' summation order and the
#: convolutions' blocking over a band instead of the whole image.
ULPS = 64 * torch.finfo(torch.float32).eps
LATENT_ROWS, LATENT_COLS = 7, 5

Results = dict[str, float | tuple[int, ...] | list[int]]
M = TypeVar("M", bound=nn.Module)


def _noisy(module: M, seed: int) -> M:
    """`module` with every parameter drawn N(0, 0.2) under `seed` (the same on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    return module.eval()


def image_vae() -> AutoencoderKL:
    """FLUX's VAE layout (no quant convs, mid-block attention) at tiny_flux's widths."""
    blocks = 4
    vae = AutoencoderKL(
        latent_channels=16,
        block_out_channels=(16, 32, 32, 32),
        down_block_types=("DownEncoderBlock2D",) * blocks,
        up_block_types=("UpDecoderBlock2D",) * blocks,
        norm_num_groups=8,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    return _noisy(vae, 0)


def video_vae() -> AutoencoderKLWan:
    """Wan 2.1's VAE layout (temporal upsampling, causal cache, mid-block attention), tiny."""
    vae = AutoencoderKLWan(
        base_dim=8,
        z_dim=4,
        dim_mult=(1, 2, 2, 2),
        num_res_blocks=1,
        latents_mean=(0.0,) * 4,
        latents_std=(1.0,) * 4,
    )
    return _noisy(vae, 1)


def _latents(*shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))


def _scaled_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| in units of the reference's largest magnitude."""
    return ((out - ref).abs().max() / ref.abs().max()).item()


def _group_norm_error(split: RowSplit, channels_last: bool, offset: float, reference: torch.dtype) -> float:
    """SplitGroupNorm over the bands against torch's GroupNorm over the whole tensor, run in `reference`
    (float64 where torch's own fp32 kernel is the imprecise one: its channels-last CPU kernel loses
    ~6e-4 to a mean of 100, against ~5e-6 for its contiguous one and for the split norm)."""
    norm = _noisy(nn.GroupNorm(8, 32, eps=1e-6), 2)
    split_norm = SplitGroupNorm(8, 32, eps=1e-6)
    split_norm.load_state_dict(norm.state_dict())
    x = _latents(2, 32, LATENT_ROWS, LATENT_COLS) * 3 + offset  # offset: a large mean must not cost precision
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    with torch.inference_mode(), row_split_scope(split):
        band = split_norm(split.take(x))
        ref = norm.to(reference)(x.to(reference))
    return _scaled_error(band.to(reference), split.take(ref))


def _decode_errors(split: RowSplit) -> Results:
    """The image and video VAEs' split decodes against their one-device decodes, and the rows each
    decoder saw on this rank."""
    seen: list[int] = []
    vae = image_vae()
    vae.decoder.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[-2]))
    z = _latents(2, 16, LATENT_ROWS, LATENT_COLS)
    wan = video_vae()
    video_z = _latents(1, 4, 3, LATENT_ROWS, LATENT_COLS)  # 3 latent frames: the causal cache is used
    with torch.inference_mode():
        ref = vae.decode(z)
        out = decode_rows(vae, z, split)
        video_ref = wan.decode(video_z)
        video_out = decode_rows(wan, video_z, split)
    return {
        "image": _scaled_error(out, ref),
        "image_shape": tuple(out.shape),
        "video": _scaled_error(video_out, video_ref),
        "video_shape": tuple(video_out.shape),
        "decoder_rows": seen[1:],  # after the one-device reference's
    }


def _decode_split_choices(world_size: int) -> Results:
    """`decode_split` as the stages call it, with this world's ParallelState in scope: split when every
    rank gets a row (bit-exact to `decode_rows`), whole (bit-exact to one device) when not."""
    state = build_parallel_state(
        ParallelConfig(num_gpus=world_size, ulysses_degree=world_size), 0, timedelta(seconds=60)
    )
    vae = image_vae()
    z = _latents(1, 16, LATENT_ROWS, LATENT_COLS)
    too_few = _latents(1, 16, world_size - 1, LATENT_COLS)
    with torch.inference_mode():
        expected = decode_rows(vae, z, RowSplit.over(dist.group.WORLD, LATENT_ROWS))
        whole = vae.decode(too_few)
        with parallel_scope(state):
            split_out = decode_split(vae, z)
            unsplit_out = decode_split(vae, too_few)
    return {
        "split_vs_rows": (split_out - expected).abs().max().item(),
        "too_few_rows_vs_one_device": (unsplit_out - whole).abs().max().item(),
        "too_few_rows_split": float(RowSplit.over(dist.group.WORLD, world_size - 1) is not None),
    }


def _every_case(rank: int, world_size: int) -> Results:
    split = RowSplit.over(dist.group.WORLD, LATENT_ROWS)
    assert split is not None
    results: Results = {
        "group_norm": _group_norm_error(split, channels_last=False, offset=0.0, reference=torch.float32),
        "group_norm_channels_last_offset": _group_norm_error(
            split, channels_last=True, offset=100.0, reference=torch.float64
        ),
    }
    results.update(_decode_errors(split))
    results.update(_decode_split_choices(world_size))
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}ranks")
def ranks_results(request: pytest.FixtureRequest) -> tuple[int, list[Results]]:
    world_size = request.param
    return world_size, run_distributed(_every_case, world_size, timeout_s=120)


def test_balanced_rows() -> None:
    assert balanced_rows(7, 2) == (4, 3)
    assert balanced_rows(7, 4) == (2, 2, 2, 1)
    assert balanced_rows(8, 4) == (2, 2, 2, 2)
    with pytest.raises(ValueError, match="cannot split 3 rows over 4 ranks"):
        balanced_rows(3, 4)


def test_layers_are_plain_torch_outside_a_split() -> None:
    """Outside a row-split scope the layers are torch's, bit for bit (the one-device path)."""
    x = _latents(1, 32, 6, 5)
    conv, halo_conv = nn.Conv2d(32, 8, 3, padding=1), HaloConv2d(32, 8, 3, padding=1)
    halo_conv.load_state_dict(conv.state_dict())
    norm, split_norm = _noisy(nn.GroupNorm(8, 32, eps=1e-6), 3), SplitGroupNorm(8, 32, eps=1e-6)
    split_norm.load_state_dict(norm.state_dict())
    with torch.inference_mode():
        assert torch.equal(halo_conv(x), conv(x))
        assert torch.equal(split_norm(x), norm(x))


def test_group_norm_uses_whole_image_statistics(ranks_results) -> None:
    world_size, results = ranks_results
    for rank, result in enumerate(results):
        print(f"{world_size} ranks, rank {rank}: group norm error {result['group_norm']:.2e} (scaled), "
              f"channels-last with mean 100 against fp64: {result['group_norm_channels_last_offset']:.2e}")  # fmt: skip
        assert result["group_norm"] <= ULPS
        assert result["group_norm_channels_last_offset"] <= ULPS


def test_image_vae_split_decode_matches_one_device(ranks_results) -> None:
    world_size, results = ranks_results
    bands = balanced_rows(LATENT_ROWS, world_size)
    for rank, result in enumerate(results):
        print(f"{world_size} ranks, rank {rank}: image decode error {result['image']:.2e} (scaled)")
        assert result["image"] <= ULPS
        assert result["image_shape"] == (2, 3, LATENT_ROWS * 8, LATENT_COLS * 8)  # every rank: whole image
        assert result["decoder_rows"] == [bands[rank]]  # each decoder ran on its band only


def test_video_vae_split_decode_matches_one_device(ranks_results) -> None:
    world_size, results = ranks_results
    for rank, result in enumerate(results):
        print(f"{world_size} ranks, rank {rank}: video decode error {result['video']:.2e} (scaled)")
        assert result["video"] <= ULPS
        assert result["video_shape"] == (1, 3, 9, LATENT_ROWS * 8, LATENT_COLS * 8)


def test_decode_split_splits_only_when_every_rank_gets_a_row(ranks_results) -> None:
    _, results = ranks_results
    for result in results:
        assert result["split_vs_rows"] == 0.0
        assert result["too_few_rows_split"] == 0.0
        assert result["too_few_rows_vs_one_device"] == 0.0


# -- End to end ----------------------------------------------------------------------------------------

#: 80 x 48 pixels: FLUX latents of 10 x 6 (its packed 2x2 tokens: 5 x 3), not square.
E2E = dict(height=80, width=48, num_inference_steps=2, seed=3)


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    with one_torch_thread():  # the rank processes take the parent's thread count
        yield


def test_two_ranks_decode_split_and_match_one_rank(tiny_flux_dir: Path, one_thread: None) -> None:
    # Imported here, not at the top: every rank process `run_distributed` spawns imports this module, and
    # diffserve.api (transformers, diffusers) is seconds of each one's start-up.
    from diffserve.api import DiffGenerator

    one_rank = DiffGenerator.from_pretrained(tiny_flux_dir, show_progress=False)
    reference = np.asarray(one_rank.generate("a red square", **E2E).images[0], dtype=np.int16)
    with DiffGenerator.from_pretrained(
        tiny_flux_dir, show_progress=False, num_gpus=2, dist_timeout=60
    ) as gen:
        rows: list[int] = []
        decoder = gen.pipeline.decoding_stage.decode_layout().vae.decoder
        decoder.register_forward_pre_hook(lambda module, args: rows.append(args[0].shape[-2]))
        image = np.asarray(gen.generate("a red square", **E2E).images[0], dtype=np.int16)
    assert rows == [E2E["height"] // 8 // 2]  # rank 0 decoded half of the 10 latent rows
    assert image.shape == reference.shape
    assert np.abs(image - reference).max() <= 1
