"""Each family's DiT split over sequence-parallel ranks (Ulysses, Ring, both) equals its one-device forward.

Each rank builds the same random-weight DiTs (a seeded init) and the same inputs, runs the forwards inside
`parallel_scope` of a ParallelState with the degrees under test, and returns the outputs; each family's
test compares every rank's outputs with the plain forwards. Lengths do not divide the degrees and the
batches are CFG-like pairs (one latent, two prompts), so shards, padding masks and positions are all tested.

- FLUX: 7 text tokens, a 6x5 latent grid of 30 image tokens, 2 rows with different timesteps, RoPE
  positions following the grid.
- Qwen-Image, two models: text to image (a 6x5 grid, one shared RoPE table) and edit (Edit-2511 style,
  `zero_cond_t`: the generated 6x5 image followed by a conditioning image of 12 tokens whose grid differs
  per sample, 4x3 and 3x4, so the RoPE tables are per sample and the conditioning-token flags must follow
  the image tokens onto their ranks). The second prompt has 4 real tokens of 7 (a text padding mask); no
  length divides the degrees (7 text tokens; 30 and 42 image tokens).
- SD3 (joint attention over [image; text], no QK-norm) and SD3.5-medium-like (RMS QK-norm, dual-attention
  blocks whose image-only `attn2` is split too), both ending with the `context_pre_only` block: 7 text
  tokens, a 6x5 grid of 30 image tokens, 3 heads that do not divide the Ulysses degree (padded).
- Wan 2.1: the video tokens are split (a non-square 3 x 3 x 5 post-patch grid: 45 tokens, which neither 2
  nor 4 divides) with the 3D RoPE tables; the cross-attention reads the replicated text and (image-to-
  video) CLIP image tokens. Two forwards: an image-to-video model whose batch is a CFG-like pair plus a row
  at another timestep, and a text-to-video model with one timestep per token (Wan 2.2 TI2V-style), which
  is split with the tokens. The 3 heads do not divide the Ulysses degree 2.
- Z-Image: all three streams are split: the captions (context refiner), the image tokens (noise refiner)
  and the unified [image; caption] sequence (main layers). The batch has a CFG-like pair (one latent, a
  40- and a 5-token caption, one timestep) and a sample with another image size, caption length and
  timestep, so every stream carries batch padding masked per sample and per-sample RoPE tables. Z-Image
  pads every stream to a multiple of 32 tokens, so degrees 2 and 4 always divide them; the 3-rank case
  cuts them unevenly (shard padding, masked too). The 3 heads do not divide the Ulysses degree 2.
- LongCat-Image: FLUX's blocks and shapes with its own timestep embedding and position ids (a modality
  axis, the image grid after the text), on the Ulysses-2 mesh.

One `run_distributed` per mesh runs every family that mesh is tested on (starting the rank processes
costs more than the tiny forwards); a family that raises on the ranks fails its own test only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import pytest
import torch
from dit_split_fixtures import one_device_outputs_fixture

from diffserve.distributed.config import ParallelConfig
from diffserve.distributed.state import ParallelState, build_parallel_state, parallel_scope
from diffserve.models.dits.flux import FluxTransformer2DModel, FluxTransformerConfig
from diffserve.models.dits.longcat_image import LongCatImageTransformer2DModel, LongCatImageTransformerConfig
from diffserve.models.dits.qwen_image import QwenImageTransformer2DModel, QwenImageTransformerConfig
from diffserve.models.dits.sd3 import SD3Transformer2DModel, SD3TransformerConfig
from diffserve.models.dits.wan import WanTransformer3DModel, WanTransformerConfig
from diffserve.models.dits.z_image import ZImageTransformer2DModel, ZImageTransformerConfig
from diffserve.testing.distributed import CaseResult, MeshRuns, case_results, run_distributed

#: (world size, Ulysses degree, Ring degree) by test id.
MESHES = {"ulysses2": (2, 2, 1), "ulysses2xring2": (4, 2, 2), "ulysses3-uneven": (3, 3, 1)}

# ----------------------------------------------------------------------------------------------- FLUX

FLUX_TEXT_LEN, FLUX_GRID_H, FLUX_GRID_W = 7, 6, 5


def tiny_flux() -> FluxTransformer2DModel:
    torch.manual_seed(0)
    config = FluxTransformerConfig(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=8,
        num_attention_heads=4, joint_attention_dim=24, pooled_projection_dim=12, guidance_embeds=True,
        axes_dims_rope=(2, 2, 4),
    )  # fmt: skip
    model = FluxTransformer2DModel(config)
    for p in model.parameters():  # larger than the init's zeros/tiny values, so every block matters
        torch.nn.init.normal_(p, std=0.2)
    return model.eval()


def flux_inputs() -> dict[str, torch.Tensor]:
    """A CFG-like batch of 2 rows at different timesteps on a non-square grid. Made in this process and
    sent to the ranks: `diffserve.families.flux.tiny` imports transformers, seconds per rank process."""
    from diffserve.families.flux.tiny import flux_dit_inputs

    return flux_dit_inputs(FLUX_GRID_H, FLUX_GRID_W, FLUX_TEXT_LEN, timesteps=[0.9, 0.3])


def flux_one_device() -> torch.Tensor:
    with torch.no_grad():
        return tiny_flux()(**flux_inputs())


def flux_on_rank(state: ParallelState, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    model = tiny_flux()
    with torch.no_grad(), parallel_scope(state):
        return model(**inputs)


def flux_check(outputs: list[torch.Tensor], expected: torch.Tensor, mesh: str) -> None:
    _, ulysses, ring = MESHES[mesh]
    for rank, out in enumerate(outputs):
        error = (out - expected).abs().max().item()
        print(f"ulysses {ulysses} x ring {ring}, rank {rank}: max abs error {error:.2e}")
        assert out.shape == expected.shape
        # fp32: Ulysses reorders no sum (exact up to SDPA's blocking); Ring merges blocks by log-sum-exp.
        assert error < 1e-4 * expected.abs().max().item(), error


# ----------------------------------------------------------------------------------------- Qwen-Image

QWEN_TEXT_LEN, QWEN_REAL_TEXT, QWEN_BATCH = 7, (7, 4), 2
QWEN_VARIANTS = {
    "t2i": {"zero_cond_t": False, "img_shapes": [[(1, 6, 5)]] * QWEN_BATCH},
    "edit": {"zero_cond_t": True, "img_shapes": [[(1, 6, 5), (1, 4, 3)], [(1, 6, 5), (1, 3, 4)]]},
}


def tiny_qwen_image(variant: str) -> QwenImageTransformer2DModel:
    torch.manual_seed(0)
    config = QwenImageTransformerConfig(
        patch_size=2, in_channels=16, out_channels=4, num_layers=3, attention_head_dim=16,
        num_attention_heads=4, joint_attention_dim=24, axes_dims_rope=(4, 6, 6),
        zero_cond_t=QWEN_VARIANTS[variant]["zero_cond_t"],
    )  # fmt: skip
    model = QwenImageTransformer2DModel(config)
    with torch.no_grad():  # larger than the init's zeros/tiny values, so every block matters
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.2)
    return model.eval()


def qwen_inputs(variant: str) -> dict[str, object]:
    img_shapes = QWEN_VARIANTS[variant]["img_shapes"]
    img_seq = sum(f * h * w for f, h, w in img_shapes[0])
    g = torch.Generator().manual_seed(1)
    mask = torch.arange(QWEN_TEXT_LEN)[None, :] < torch.tensor(QWEN_REAL_TEXT)[:, None]
    return {
        "hidden_states": torch.randn(1, img_seq, 16, generator=g).expand(QWEN_BATCH, -1, -1),
        "encoder_hidden_states": torch.randn(QWEN_BATCH, QWEN_TEXT_LEN, 24, generator=g),
        "encoder_hidden_states_mask": mask,
        "timestep": torch.tensor([0.7]),
        "img_shapes": img_shapes,
    }


def qwen_forward_all() -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return {variant: tiny_qwen_image(variant)(**qwen_inputs(variant)) for variant in QWEN_VARIANTS}


def qwen_on_rank(state: ParallelState, inputs: None) -> dict[str, torch.Tensor]:
    with parallel_scope(state):
        return qwen_forward_all()


def variants_check(
    outputs: list[dict[str, torch.Tensor]], expected: dict[str, torch.Tensor], mesh: str
) -> None:
    _, ulysses, ring = MESHES[mesh]
    for rank, out in enumerate(outputs):
        for variant, want in expected.items():
            error = (out[variant] - want).abs().max().item()
            print(f"{variant} ulysses {ulysses} x ring {ring}, rank {rank}: max abs error {error:.2e}")
            assert out[variant].shape == want.shape
            # fp32: Ulysses reorders no sum (exact up to SDPA's blocking); Ring merges blocks by log-sum-exp.
            assert error < 1e-4 * want.abs().max().item(), (variant, error)


def test_qwen_image_inputs_exercise_masks_and_per_sample_positions(expected) -> None:
    """What the parity test relies on: the padded prompt's masked keys matter (unmasked, the output
    changes), the prompts reach the image (the CFG rows differ), and the edit model's tables are per sample."""
    for variant, out in expected("qwen-image").items():
        assert (out[0] - out[1]).abs().max() > 1e-2 * out.abs().max(), variant
        unmasked = dict(qwen_inputs(variant), encoder_hidden_states_mask=None)
        with torch.no_grad():
            changed = tiny_qwen_image(variant)(**unmasked)
        assert (changed[1] - out[1]).abs().max() > 1e-3 * out.abs().max(), variant
    cos, _ = tiny_qwen_image("edit").rope_tables(
        QWEN_VARIANTS["edit"]["img_shapes"], QWEN_TEXT_LEN, torch.device("cpu"), QWEN_BATCH
    )
    assert cos.shape[0] == QWEN_BATCH * (QWEN_TEXT_LEN + 42)


# ------------------------------------------------------------------------------------------ SD3 / SD3.5

SD3_TEXT_LEN, SD3_LATENT_H, SD3_LATENT_W, SD3_BATCH = 7, 12, 10, 2  # patch 2: a 6x5 grid of image tokens
SD3_VARIANTS = {
    "sd3": {"dual_attention_layers": (), "qk_norm": None},
    "sd3.5": {"dual_attention_layers": (0, 1), "qk_norm": "rms_norm"},
}


def tiny_sd3(variant: str) -> SD3Transformer2DModel:
    torch.manual_seed(0)
    config = SD3TransformerConfig(
        sample_size=8, patch_size=2, in_channels=4, num_layers=3, attention_head_dim=8,
        num_attention_heads=3, joint_attention_dim=16, caption_projection_dim=24,
        pooled_projection_dim=12, out_channels=4, pos_embed_max_size=16, **SD3_VARIANTS[variant],
    )  # fmt: skip
    model = SD3Transformer2DModel(config)
    with torch.no_grad():  # larger than the init's zeros/tiny values, so every block matters
        for name, p in model.named_parameters():
            if name != "pos_embed.pos_embed":
                torch.nn.init.normal_(p, std=0.2)
    return model.eval()


def sd3_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(1, 4, SD3_LATENT_H, SD3_LATENT_W, generator=g)
    return {
        "hidden_states": latents.expand(SD3_BATCH, -1, -1, -1),  # CFG: one latent, two prompts
        "encoder_hidden_states": torch.randn(SD3_BATCH, SD3_TEXT_LEN, 16, generator=g),
        "pooled_projections": torch.randn(SD3_BATCH, 12, generator=g),
        "timestep": torch.tensor([700.0]),
    }


def sd3_forward_all() -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return {variant: tiny_sd3(variant)(**sd3_inputs()) for variant in SD3_VARIANTS}


def sd3_on_rank(state: ParallelState, inputs: None) -> dict[str, torch.Tensor]:
    with parallel_scope(state):
        return sd3_forward_all()


def test_sd3_cfg_rows_differ(expected) -> None:
    """The two prompts reach the image: a split that lost the text keys could not pass the parity test."""
    for variant, out in expected("sd3").items():
        assert (out[0] - out[1]).abs().max() > 1e-2 * out.abs().max(), variant


# ------------------------------------------------------------------------------------------------ Wan

WAN_BATCH, WAN_CHANNELS, WAN_TEXT_DIM, WAN_IMAGE_DIM = 3, 4, 16, 12
WAN_FRAMES, WAN_HEIGHT, WAN_WIDTH = 3, 6, 10  # post-patch grid 3 x 3 x 5 with patch (1, 2, 2)
WAN_TEXT_LEN, WAN_IMAGE_LEN = 7, 5


def tiny_wan(image_to_video: bool) -> WanTransformer3DModel:
    torch.manual_seed(0)
    config = WanTransformerConfig(
        num_attention_heads=3, attention_head_dim=12, in_channels=WAN_CHANNELS, out_channels=WAN_CHANNELS,
        text_dim=WAN_TEXT_DIM, freq_dim=16, ffn_dim=48, num_layers=2,
        image_dim=WAN_IMAGE_DIM if image_to_video else None, added_kv_proj_dim=36 if image_to_video else None,
    )  # fmt: skip
    model = WanTransformer3DModel(config)
    for p in model.parameters():  # larger than the init's zeros/tiny values, so every block matters
        torch.nn.init.normal_(p, std=0.2)
    return model.eval()


def wan_forward() -> list[torch.Tensor]:
    """The image-to-video forward (per-sample timesteps), then the text-to-video one (per-token)."""
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(WAN_BATCH, WAN_CHANNELS, WAN_FRAMES, WAN_HEIGHT, WAN_WIDTH, generator=g)
    latents[1] = latents[0]  # the CFG pair denoises one latent
    text = torch.randn(WAN_BATCH, WAN_TEXT_LEN, WAN_TEXT_DIM, generator=g)
    image = torch.randn(WAN_BATCH, WAN_IMAGE_LEN, WAN_IMAGE_DIM, generator=g)
    per_token_t = torch.rand(WAN_BATCH, WAN_FRAMES * (WAN_HEIGHT // 2) * (WAN_WIDTH // 2), generator=g) * 1000
    return [
        tiny_wan(True)(latents, torch.tensor([700.0, 700.0, 250.0]), text, image),
        tiny_wan(False)(latents, per_token_t, text),
    ]


def wan_one_device() -> list[torch.Tensor]:
    with torch.no_grad():
        return wan_forward()


def wan_on_rank(state: ParallelState, inputs: None) -> list[torch.Tensor]:
    with torch.no_grad(), parallel_scope(state):
        return wan_forward()


def wan_check(outputs: list[list[torch.Tensor]], expected: list[torch.Tensor], mesh: str) -> None:
    _, ulysses, ring = MESHES[mesh]
    for rank, outs in enumerate(outputs):
        for name, out, want in zip(("i2v", "t2v per-token t"), outs, expected, strict=True):
            error = (out - want).abs().max().item()
            print(f"ulysses {ulysses} x ring {ring}, rank {rank}, {name}: max abs error {error:.2e}")
            assert out.shape == want.shape
            # fp32: Ulysses reorders no sum (exact up to SDPA's blocking); Ring merges blocks by log-sum-exp.
            assert error < 1e-4 * want.abs().max().item(), error


# --------------------------------------------------------------------------------------------- Z-Image

ZIMAGE_CAP_DIM, ZIMAGE_CHANNELS = 24, 4
#: (latent (C, F, H, W), caption tokens, t) per row: a CFG-like pair, then another size.
ZIMAGE_ROWS = (((1, 8, 12), 40, 0.3), ((1, 8, 12), 5, 0.3), ((1, 10, 14), 20, 0.7))


def tiny_z_image() -> ZImageTransformer2DModel:
    torch.manual_seed(0)
    config = ZImageTransformerConfig(
        in_channels=ZIMAGE_CHANNELS, dim=48, n_layers=2, n_refiner_layers=1, n_heads=3, n_kv_heads=3,
        cap_feat_dim=ZIMAGE_CAP_DIM, axes_dims=(4, 6, 6), axes_lens=(256, 64, 64),
    )  # fmt: skip
    model = ZImageTransformer2DModel(config)
    for p in model.parameters():  # larger than the init's zeros/tiny values, so every block matters
        torch.nn.init.normal_(p, std=0.2)
    return model.eval()


def z_image_forward(model: ZImageTransformer2DModel) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    latents = [torch.randn(ZIMAGE_CHANNELS, *size, generator=g) for size, _, _ in ZIMAGE_ROWS]
    latents[1] = latents[0]  # the CFG pair denoises one latent
    captions = [torch.randn(n, ZIMAGE_CAP_DIM, generator=g) for _, n, _ in ZIMAGE_ROWS]
    t = torch.tensor([t for _, _, t in ZIMAGE_ROWS])
    return model(latents, t, cap_feats=captions)


def z_image_one_device() -> list[torch.Tensor]:
    with torch.no_grad():
        return z_image_forward(tiny_z_image())


def z_image_on_rank(state: ParallelState, inputs: None) -> list[torch.Tensor]:
    model = tiny_z_image()
    with torch.no_grad(), parallel_scope(state):
        return z_image_forward(model)


def z_image_check(outputs: list[list[torch.Tensor]], expected: list[torch.Tensor], mesh: str) -> None:
    _, ulysses, ring = MESHES[mesh]
    scale = max(e.abs().max().item() for e in expected)
    for rank, outs in enumerate(outputs):
        assert [o.shape for o in outs] == [e.shape for e in expected]
        error = max((o - e).abs().max().item() for o, e in zip(outs, expected, strict=True))
        print(
            f"ulysses {ulysses} x ring {ring}, rank {rank}: max abs error {error:.2e} (max |out| {scale:.1f})"
        )
        # fp32: Ulysses reorders no sum (exact up to SDPA's blocking); Ring merges blocks by log-sum-exp.
        assert error < 1e-4 * scale, error


# ------------------------------------------------------------------------------------- on gloo ranks

# -------------------------------------------------------------------------------------- LongCat-Image


def tiny_longcat_image() -> LongCatImageTransformer2DModel:
    torch.manual_seed(0)
    config = LongCatImageTransformerConfig(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=8,
        num_attention_heads=4, joint_attention_dim=24, pooled_projection_dim=24, axes_dims_rope=(2, 2, 4),
    )  # fmt: skip
    model = LongCatImageTransformer2DModel(config)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return model.eval()


def longcat_image_inputs() -> dict[str, torch.Tensor]:
    """FLUX's shapes and timesteps, with LongCat-Image's ids: (0, i, i) for the text, (1, text + row,
    text + col) for the image."""
    g = torch.Generator().manual_seed(1)
    text, h, w = FLUX_TEXT_LEN, FLUX_GRID_H, FLUX_GRID_W
    index = torch.arange(text, dtype=torch.float32)
    rows = torch.arange(h, dtype=torch.float32).repeat_interleave(w) + text
    cols = torch.arange(w, dtype=torch.float32).repeat(h) + text
    return {
        "hidden_states": torch.randn(2, h * w, 16, generator=g),
        "encoder_hidden_states": torch.randn(2, text, 24, generator=g),
        "timestep": torch.tensor([0.9, 0.3]),
        "img_ids": torch.stack([torch.ones_like(rows), rows, cols], dim=-1),
        "txt_ids": torch.stack([torch.zeros_like(index), index, index], dim=-1),
    }


def longcat_image_one_device() -> torch.Tensor:
    with torch.no_grad():
        return tiny_longcat_image()(**longcat_image_inputs())


def longcat_image_on_rank(state: ParallelState, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    model = tiny_longcat_image()
    with torch.no_grad(), parallel_scope(state):
        return model(**inputs)


def no_inputs() -> None:
    return None


@dataclass(frozen=True)
class Family:
    one_device: Callable[[], object]
    #: The forward on a rank, given `inputs()` (made in this process: None for the families that make
    #: their own on the rank).
    on_rank: Callable[[ParallelState, object], object]
    check: Callable[[list, object, str], None]
    #: The meshes it is tested on. Pure ring (ring2, ring4) and ulysses4 are checked at the attention
    #: level in test_sequence_parallel.py; per family, the 2x2 mesh runs both through the DiT's own split.
    meshes: tuple[str, ...]
    inputs: Callable[[], object] = no_inputs


FAMILIES = {
    "flux": Family(flux_one_device, flux_on_rank, flux_check, ("ulysses2", "ulysses2xring2"), flux_inputs),
    "qwen-image": Family(qwen_forward_all, qwen_on_rank, variants_check, ("ulysses2xring2",)),
    "sd3": Family(sd3_forward_all, sd3_on_rank, variants_check, ("ulysses2xring2",)),
    "wan": Family(wan_one_device, wan_on_rank, wan_check, ("ulysses2xring2",)),
    "z-image": Family(
        z_image_one_device, z_image_on_rank, z_image_check, ("ulysses2xring2", "ulysses3-uneven")
    ),
    "longcat-image": Family(
        longcat_image_one_device, longcat_image_on_rank, flux_check, ("ulysses2",), longcat_image_inputs
    ),
}


def forward_on_rank(
    rank: int, world_size: int, ulysses: int, ring: int, inputs: dict[str, object]
) -> dict[str, CaseResult]:
    """The split forward of every family in `inputs` on this rank."""
    config = ParallelConfig(num_gpus=world_size, ulysses_degree=ulysses, ring_degree=ring)
    state = build_parallel_state(config, local_rank=rank, control_timeout=timedelta(seconds=60))
    return case_results(lambda family: FAMILIES[family].on_rank(state, inputs[family]), inputs)


expected = one_device_outputs_fixture(FAMILIES)


@pytest.fixture(scope="module")
def split_outputs() -> MeshRuns:
    """A family's outputs by rank on a mesh: one `run_distributed` per mesh, for every family tested on it."""

    def start(mesh: str) -> list[dict[str, CaseResult]]:
        world_size, ulysses, ring = MESHES[mesh]
        inputs = {name: f.inputs() for name, f in FAMILIES.items() if mesh in f.meshes}
        return run_distributed(forward_on_rank, world_size, ulysses, ring, inputs, timeout_s=240)

    return MeshRuns(start)


CASES = [(name, mesh) for name, family in FAMILIES.items() for mesh in family.meshes]


@pytest.mark.parametrize(("family", "mesh"), CASES, ids=[f"{name}-{mesh}" for name, mesh in CASES])
def test_split_forward_equals_one_device(expected, split_outputs, family: str, mesh: str) -> None:
    FAMILIES[family].check(split_outputs(family, mesh), expected(family), mesh)
