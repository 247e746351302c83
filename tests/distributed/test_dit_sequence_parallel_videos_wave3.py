"""HunyuanVideo 1.0, CogVideoX, Mochi 1 and SANA-Video split over sequence-parallel ranks (Ulysses, Ring,
both) equal their one-device forwards.

The pattern of `test_dit_sequence_parallel.py`: each rank builds the same random-weight DiTs (a seeded
init, std 0.2 so every block matters) and the same inputs, runs the forwards inside `parallel_scope` of a
ParallelState with the degrees under test and returns the outputs; each family's test compares every
rank's outputs with the plain forwards. One `run_distributed` per mesh runs every family; a family that
raises on the ranks fails its own test only. Every video has a 3 x 3 x 5 post-patch grid (45 tokens, which
neither 2 nor 4 divides; CogVideoX 1.5: 2 x 3 x 5) and 7 text tokens; the batches hold a CFG-like pair
(one latent, two prompts) and a row at another timestep; heads are 3 (not divisible by Ulysses 2).

- HunyuanVideo 1.0, text-to-video and "token_replace" image-to-video (the first frame's tokens modulated
  at t = 0, on the shards that hold them): double and single blocks, a text mask of 7, 4 and 6 tokens.
- CogVideoX: 1.0 with sin-cos positions (2B), 1.0 with RoPE (5B) and 1.5 (RoPE over 2-frame patches).
- Mochi 1: three blocks (the last context-pre-only), prefix text masks of 7, 4 and 6 tokens; a non-prefix
  mask is refused under the split.
- SANA-Video, split by whole frames: 5 latent frames (2 ranks: 2 + 1 real and 1 padded frame per rank, 4
  ranks: a rank with neighbours on both sides and one of padding only), so the linear attention's
  all-reduced sums, the temporal conv's edge frames and the padding are all tested; a text mask of 7, 4, 6.

End to end (`DiffGenerator` on two Ulysses ranks against one rank, the tiny checkpoints, within 1 uint8
level): HunyuanVideo 1.0 and Mochi only, to keep the file under 30 s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
from dit_split_fixtures import one_device_outputs_fixture

from diffserve.api import DiffGenerator
from diffserve.distributed.config import ParallelConfig
from diffserve.distributed.state import ParallelState, build_parallel_state, parallel_scope
from diffserve.models.dits.cogvideox import CogVideoXTransformer3DModel, CogVideoXTransformerConfig
from diffserve.models.dits.hunyuan_video import HunyuanVideoTransformer3DModel, HunyuanVideoTransformerConfig
from diffserve.models.dits.mochi import MochiTransformer3DModel, MochiTransformerConfig
from diffserve.models.dits.sana_video import SanaVideoTransformer3DModel, SanaVideoTransformerConfig
from diffserve.testing.distributed import CaseResult, MeshRuns, case_results, run_distributed
from diffserve.testing.threads import one_torch_thread

#: (world size, Ulysses degree, Ring degree) by test id.
MESHES = {"ulysses2": (2, 2, 1), "ulysses2xring2": (4, 2, 2)}
BATCH, CHANNELS, TEXT_LEN = 3, 4, 7
FRAMES, HEIGHT, WIDTH = 3, 6, 10  # latents; a 3 x 3 x 5 grid of 45 tokens with 2 x 2 spatial patches
TIMESTEPS = (700.0, 700.0, 250.0)  # the CFG pair, then a row at another step
VALID_TEXT = (7, 4, 6)  # real tokens per row (right padding)


def randomised(model: torch.nn.Module, skip: tuple[str, ...] = ()) -> torch.nn.Module:
    """Every parameter ~ N(0, 0.2) but those named in `skip`: larger than the init's zeros/tiny values, so
    every block matters."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name not in skip:
                torch.nn.init.normal_(p, std=0.2)
    return model.eval()


def video_latents(g: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    """(BATCH, *shape) latents whose first two rows (the CFG pair) are one latent."""
    latents = torch.randn(BATCH, *shape, generator=g)
    latents[1] = latents[0]
    return latents


def text_mask() -> torch.Tensor:
    return torch.arange(TEXT_LEN)[None, :] < torch.tensor(VALID_TEXT)[:, None]


# ------------------------------------------------------------------------------------ HunyuanVideo 1.0

HV_VARIANTS = ("t2v", "token_replace")


def tiny_hunyuan_video(variant: str) -> HunyuanVideoTransformer3DModel:
    torch.manual_seed(0)
    config = HunyuanVideoTransformerConfig(
        in_channels=CHANNELS, out_channels=CHANNELS, num_attention_heads=3, attention_head_dim=16,
        num_layers=2, num_single_layers=2, num_refiner_layers=1, text_embed_dim=24, pooled_projection_dim=12,
        rope_axes_dim=(4, 6, 6), image_condition_type=None if variant == "t2v" else "token_replace",
    )  # fmt: skip
    return randomised(HunyuanVideoTransformer3DModel(config))


def hunyuan_video_forward_all() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    inputs = {
        "hidden_states": video_latents(g, (CHANNELS, FRAMES, HEIGHT, WIDTH)),
        "timestep": torch.tensor(TIMESTEPS),
        "encoder_hidden_states": torch.randn(BATCH, TEXT_LEN, 24, generator=g),
        "encoder_attention_mask": text_mask(),
        "pooled_projections": torch.randn(BATCH, 12, generator=g),
        "guidance": torch.tensor([6000.0]),
    }
    with torch.no_grad():
        return {variant: tiny_hunyuan_video(variant)(**inputs) for variant in HV_VARIANTS}


# ------------------------------------------------------------------------------------------- CogVideoX

#: variant -> (config fields, latent frames): 1.0 2B (sin-cos), 1.0 5B (RoPE), 1.5 (RoPE, 2-frame patches).
COG_VARIANTS = {
    "2b": ({"use_rotary_positional_embeddings": False}, FRAMES),
    "5b": ({"use_rotary_positional_embeddings": True}, FRAMES),
    "1.5": ({"use_rotary_positional_embeddings": True, "patch_size_t": 2, "patch_bias": False}, 4),
}


def tiny_cogvideox(variant: str) -> CogVideoXTransformer3DModel:
    torch.manual_seed(0)
    config = CogVideoXTransformerConfig(
        num_attention_heads=3, attention_head_dim=16, in_channels=CHANNELS, out_channels=CHANNELS,
        time_embed_dim=24, text_embed_dim=16, num_layers=2, sample_width=WIDTH, sample_height=HEIGHT,
        sample_frames=9, max_text_seq_length=TEXT_LEN, **COG_VARIANTS[variant][0],
    )  # fmt: skip
    return randomised(CogVideoXTransformer3DModel(config))


def cogvideox_forward_all() -> dict[str, torch.Tensor]:
    outputs = {}
    for variant, (_, frames) in COG_VARIANTS.items():
        g = torch.Generator().manual_seed(1)
        latents = video_latents(g, (frames, CHANNELS, HEIGHT, WIDTH))  # CogVideoX's (F, C, H, W) layout
        text = torch.randn(BATCH, TEXT_LEN, 16, generator=g)
        with torch.no_grad():
            outputs[variant] = tiny_cogvideox(variant)(latents, text, torch.tensor(TIMESTEPS))
    return outputs


# ---------------------------------------------------------------------------------------------- Mochi


def tiny_mochi() -> MochiTransformer3DModel:
    torch.manual_seed(0)
    config = MochiTransformerConfig(
        in_channels=CHANNELS, num_attention_heads=3, attention_head_dim=16, num_layers=3,
        pooled_projection_dim=24, text_embed_dim=16, time_embed_dim=16,
    )  # fmt: skip
    return randomised(MochiTransformer3DModel(config))


def mochi_inputs(mask: torch.Tensor) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "hidden_states": video_latents(g, (CHANNELS, FRAMES, HEIGHT, WIDTH)),
        "encoder_hidden_states": torch.randn(BATCH, TEXT_LEN, 16, generator=g),
        "timestep": torch.tensor(TIMESTEPS),
        "encoder_attention_mask": mask,
    }


def mochi_forward_all() -> dict[str, torch.Tensor]:
    """The masked batch, and the same batch with every text token valid (the unmasked attention)."""
    model = tiny_mochi()
    with torch.no_grad():
        return {
            "masked": model(**mochi_inputs(text_mask())),
            "unmasked": model(**mochi_inputs(torch.ones(BATCH, TEXT_LEN, dtype=torch.bool))),
        }


def mochi_on_rank() -> dict[str, object]:
    """The forwards, and the refusal of a non-prefix mask (its message) under the split."""
    outputs: dict[str, object] = dict(mochi_forward_all())
    holes = text_mask()
    holes[0, 2] = False
    try:
        with torch.no_grad():
            tiny_mochi()(**mochi_inputs(holes))
        outputs["refusal"] = None
    except ValueError as error:
        outputs["refusal"] = str(error)
    return outputs


def mochi_check(outputs: list[dict[str, object]], expected: dict[str, torch.Tensor], mesh: str) -> None:
    variants_check([{k: v for k, v in out.items() if k != "refusal"} for out in outputs], expected, mesh)
    for out in outputs:
        assert out["refusal"] is not None and "Mochi" in out["refusal"], out["refusal"]


# ----------------------------------------------------------------------------------------- SANA-Video

SANA_FRAMES = 5


def tiny_sana_video() -> SanaVideoTransformer3DModel:
    torch.manual_seed(0)
    config = SanaVideoTransformerConfig(
        in_channels=CHANNELS, out_channels=CHANNELS, num_attention_heads=3, attention_head_dim=12,
        num_layers=2, num_cross_attention_heads=3, cross_attention_head_dim=12, cross_attention_dim=36,
        caption_channels=16,
    )  # fmt: skip
    return randomised(SanaVideoTransformer3DModel(config))


def sana_video_forward_all() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    latents = video_latents(g, (CHANNELS, SANA_FRAMES, HEIGHT, WIDTH))
    text = torch.randn(BATCH, TEXT_LEN, 16, generator=g)
    with torch.no_grad():
        out = tiny_sana_video()(latents, text, text_mask().long(), torch.tensor(TIMESTEPS))
    return {"t2v": out}


# ------------------------------------------------------------------------------------ on gloo ranks


def variants_check(
    outputs: list[dict[str, torch.Tensor]], expected: dict[str, torch.Tensor], mesh: str
) -> None:
    _, ulysses, ring = MESHES[mesh]
    assert outputs and all(out.keys() == expected.keys() for out in outputs)
    for rank, out in enumerate(outputs):
        for variant, want in expected.items():
            error = (out[variant] - want).abs().max().item()
            scale = want.abs().max().item()
            print(
                f"{variant} ulysses {ulysses} x ring {ring}, rank {rank}: max abs error {error:.2e} (max {scale:.1f})"
            )
            assert out[variant].shape == want.shape
            # fp32: Ulysses reorders no sum (exact up to SDPA's blocking); Ring merges blocks by log-sum-exp.
            assert error < 1e-4 * scale, (variant, error)


@dataclass(frozen=True)
class Family:
    one_device: Callable[[], object]
    #: The forward on a rank, inside the parallel scope.
    on_rank: Callable[[], object]
    check: Callable[[list, object, str], None]


FAMILIES = {
    "hunyuan-video": Family(hunyuan_video_forward_all, hunyuan_video_forward_all, variants_check),
    "cogvideox": Family(cogvideox_forward_all, cogvideox_forward_all, variants_check),
    "mochi": Family(mochi_forward_all, mochi_on_rank, mochi_check),
    "sana-video": Family(sana_video_forward_all, sana_video_forward_all, variants_check),
}


def forward_on_rank(rank: int, world_size: int, ulysses: int, ring: int) -> dict[str, CaseResult]:
    """The split forwards of every family on this rank."""
    config = ParallelConfig(num_gpus=world_size, ulysses_degree=ulysses, ring_degree=ring)
    state: ParallelState = build_parallel_state(
        config, local_rank=rank, control_timeout=timedelta(seconds=60)
    )

    def run(family: str) -> object:
        with parallel_scope(state):
            return FAMILIES[family].on_rank()

    return case_results(run, FAMILIES)


expected = one_device_outputs_fixture(FAMILIES)


@pytest.fixture(scope="module")
def split_outputs() -> MeshRuns:
    """A family's outputs by rank on a mesh: one `run_distributed` per mesh, for every family."""

    def start(mesh: str) -> list[dict[str, CaseResult]]:
        world_size, ulysses, ring = MESHES[mesh]
        return run_distributed(forward_on_rank, world_size, ulysses, ring, timeout_s=240)

    return MeshRuns(start)


CASES = [(name, mesh) for name in FAMILIES for mesh in MESHES]


@pytest.mark.parametrize(("family", "mesh"), CASES, ids=[f"{name}-{mesh}" for name, mesh in CASES])
def test_split_forward_equals_one_device(expected, split_outputs, family: str, mesh: str) -> None:
    FAMILIES[family].check(split_outputs(family, mesh), expected(family), mesh)


def test_inputs_exercise_masks_and_rows(expected) -> None:
    """What the parity tests rely on: the prompts reach the video (the CFG rows differ) and the text
    masks matter (Mochi's masked and unmasked batches differ in the row with padding)."""
    for family in FAMILIES:
        for variant, out in expected(family).items():
            # 10x the parity tolerance at least: a split that lost the text keys would fail the parity test.
            assert (out[0] - out[1]).abs().max() > 1e-3 * out.abs().max(), (family, variant)
    mochi = expected("mochi")
    assert (mochi["masked"][1] - mochi["unmasked"][1]).abs().max() > 1e-3 * mochi["masked"].abs().max()


# ------------------------------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    with one_torch_thread():  # the rank workers take the parent's thread count
        yield


def frames_of(output) -> np.ndarray:
    return np.stack([np.asarray(frame, dtype=np.int16) for frame in output.frames])


def tiny_folder(family: str, root: Path) -> Path:
    """The family's tiny checkpoint (its own builder; imported here: they import transformers)."""
    if family == "hunyuan-video":
        from diffserve.families.hunyuan_video.tiny import build_tiny_hunyuan_video

        return build_tiny_hunyuan_video(root)
    from diffserve.families.mochi.tiny import build_tiny_mochi

    return build_tiny_mochi(root)


#: A request with 3 latent frames on a 3 x 3 post-patch grid (27 video tokens, odd) and CFG with prompts
#: of different lengths. Two families only, to keep this file under 30 s (about 6 s each; CogVideoX's
#: took 5 s and SANA-Video's 17 s, both within 1 level too when this was written).
E2E_COMMON = dict(
    prompt="A red Fox running in the snow", negative_prompt="blurry", height=48, width=48, seed=3
)
E2E_REQUESTS = {
    "hunyuan-video": dict(num_frames=9, num_inference_steps=2, true_cfg_scale=4.0, guidance_scale=3.5),
    "mochi": dict(num_frames=13, num_inference_steps=2, guidance_scale=4.5),
}


@pytest.mark.parametrize("family", list(E2E_REQUESTS))
def test_two_ulysses_ranks_match_one_rank(tmp_path_factory, one_thread, family: str) -> None:
    root = tiny_folder(family, tmp_path_factory.mktemp(f"tiny-{family}"))
    request = {**E2E_COMMON, **E2E_REQUESTS[family]}
    with DiffGenerator.from_pretrained(root, show_progress=False) as gen:
        want = frames_of(gen.generate(**request))
    with DiffGenerator.from_pretrained(root, show_progress=False, num_gpus=2, ulysses_degree=2) as gen:
        assert gen.ranks is not None and gen.ranks.state is not None
        assert gen.ranks.state.ulysses_degree == 2
        got = frames_of(gen.generate(**request))
    print(f"{family} Ulysses-2: max |frame difference| {np.abs(got - want).max()} (uint8 levels)")
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1
