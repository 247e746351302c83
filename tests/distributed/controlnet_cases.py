"""Tiny ControlNet cases for multi-rank engine tests (tests/distributed/test_controlnet_parallel*.py): per
family (FLUX.1, Qwen-Image, SD3) a tiny folder, a tiny random ControlNet for it, and a request with CFG and
a negative prompt in that family's keywords (so the two CFG branches differ), generated at one size.

The size, 48x80, gives FLUX.1 and Qwen-Image a 3x5 packed grid and SD3 a 3x5 patch grid: 15 image tokens,
which 2 sequence-parallel ranks cannot split evenly (their shards are padded).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from PIL import Image

from diffserve.api import DiffGenerator
from diffserve.families.flux.tiny import TinyFluxSpec, build_tiny_flux
from diffserve.families.flux.tiny_controlnet import TinyFluxControlNetSpec, build_tiny_flux_controlnet
from diffserve.families.qwen_image.tiny import TinyQwenImageSpec, build_tiny_qwen_image
from diffserve.families.qwen_image.tiny_controlnet import (
    TinyQwenImageControlNetSpec,
    build_tiny_qwen_image_controlnet,
    sharpen_vae_posterior,
)
from diffserve.families.sd3.tiny import TinySD3Spec, build_tiny_sd3
from diffserve.families.sd3.tiny_controlnet import TinySD3ControlNetSpec, build_tiny_sd3_controlnet
from diffserve.testing.parity import smooth_random_image

HEIGHT, WIDTH = 48, 80
#: The control image of the parity runs, and another one for the control runs.
EDGES = smooth_random_image(WIDTH, HEIGHT, seed=11)
OTHER = smooth_random_image(WIDTH, HEIGHT, seed=13)
#: The ControlNet's name in the engines the cases start.
NAME = "canny"


@dataclass(frozen=True)
class ControlNetCase:
    """A family's tiny folder, its ControlNet and the CFG keywords of its requests."""

    folder: Path
    controlnet: Path
    request: dict[str, object] = field(default_factory=dict)
    #: An inpainting ControlNet's mask (white = repaint), sent with each control image; else None.
    mask: Image.Image | None = None

    def generator(self, **options: object) -> DiffGenerator:
        """An engine on the CPU with the ControlNet loaded as `NAME` (`options`: the parallel flags)."""
        return DiffGenerator.from_pretrained(
            self.folder, device="cpu", show_progress=False, controlnets={NAME: self.controlnet}, **options
        )

    def generate(self, gen: DiffGenerator, image: Image.Image) -> np.ndarray:
        """The request's image (uint8 values as int16), the ControlNet applied with `image`, seed 5."""
        entry = {"name": NAME, "image": image, "scale": 1.0}
        if self.mask is not None:
            entry["mask"] = self.mask
        result = gen.generate(
            prompt="a fox in the snow", height=HEIGHT, width=WIDTH, num_inference_steps=2, seed=5,
            controlnets=[entry], **self.request,
        )  # fmt: skip
        return np.asarray(result.images[0], dtype=np.int16)


def flux_case(root: Path) -> ControlNetCase:
    """FLUX.1 with true CFG (and its guidance embedding)."""
    flux = TinyFluxSpec(seed=0)
    folder = build_tiny_flux(root / "flux", flux)
    canny = build_tiny_flux_controlnet(root / "flux-canny", TinyFluxControlNetSpec(flux, seed=1))
    cfg = dict(true_cfg_scale=2.0, negative_prompt="blurry", guidance_scale=3.5, max_sequence_length=16)
    return ControlNetCase(folder, canny, cfg)


def qwen_image_case(root: Path) -> ControlNetCase:
    """Qwen-Image with true CFG; its VAE's posterior sharpened so that the control image matters."""
    qwen = TinyQwenImageSpec(seed=0)
    folder = build_tiny_qwen_image(root / "qwen", qwen)
    sharpen_vae_posterior(folder)
    canny = build_tiny_qwen_image_controlnet(root / "qwen-canny", TinyQwenImageControlNetSpec(qwen, seed=1))
    return ControlNetCase(
        folder, canny, dict(true_cfg_scale=2.5, negative_prompt="blurry", max_sequence_length=64)
    )


def sd3_case(root: Path) -> ControlNetCase:
    """SD3 with CFG (its ControlNet runs on each branch's own text)."""
    sd3 = TinySD3Spec(seed=0)
    folder = build_tiny_sd3(root / "sd3", sd3)
    canny = build_tiny_sd3_controlnet(root / "sd3-canny", TinySD3ControlNetSpec(sd3, seed=1))
    return ControlNetCase(folder, canny, dict(guidance_scale=3.0, negative_prompt="blurry"))


def sd3_large_controlnet_case(root: Path) -> ControlNetCase:
    """SD3 with CFG and an SD3.5-Large-kind ControlNet (single-stream blocks on the DiT's positions, the
    pooled projection read)."""
    sd3 = TinySD3Spec(seed=0)
    folder = build_tiny_sd3(root / "sd3-large", sd3)
    spec = TinySD3ControlNetSpec(
        sd3, num_layers=2, force_zeros_for_pooled_projection=False, single_stream=True
    )
    canny = build_tiny_sd3_controlnet(root / "sd3-large-canny", replace(spec, seed=1))
    return ControlNetCase(folder, canny, dict(guidance_scale=3.0, negative_prompt="blurry"))


def sd3_inpainting_case(root: Path) -> ControlNetCase:
    """SD3 with CFG and an inpainting ControlNet (the mask as a 17th control channel; one draw of the
    masked image's latents for both CFG branches, which CFG-parallel ranks each take their rows of)."""
    sd3 = TinySD3Spec(seed=0)
    folder = build_tiny_sd3(root / "sd3-inpainting", sd3)
    spec = TinySD3ControlNetSpec(sd3, inpainting=True, seed=1)
    inpaint = build_tiny_sd3_controlnet(root / "sd3-inpainting-net", spec)
    mask = Image.new("L", (WIDTH, HEIGHT), 0)
    mask.paste(255, (16, 8, 64, 40))  # white: the area to repaint
    return ControlNetCase(folder, inpaint, dict(guidance_scale=3.0, negative_prompt="blurry"), mask)


#: family -> the builder of its case under a root folder.
CASE_BUILDERS: dict[str, Callable[[Path], ControlNetCase]] = {
    "flux": flux_case,
    "qwen-image": qwen_image_case,
    "sd3": sd3_case,
    "sd3-large-controlnet": sd3_large_controlnet_case,
    "sd3-inpainting-controlnet": sd3_inpainting_case,
}


def one_rank_images(case: ControlNetCase) -> tuple[np.ndarray, np.ndarray]:
    """The one-rank engine's image with `EDGES`, and with `OTHER` (the control run)."""
    with case.generator() as gen:
        return case.generate(gen, EDGES), case.generate(gen, OTHER)


def max_difference_on_ranks(case: ControlNetCase, alone: np.ndarray, ranks: int, **options: object) -> int:
    """The max uint8 difference between an engine's image on `ranks` ranks (with `EDGES`, under `options`:
    e.g. `enable_cfg_parallel=True`) and `alone`, the one-rank one."""
    with case.generator(num_gpus=ranks, **options) as gen:
        if gen.ranks is None or gen.ranks.state is None:
            raise AssertionError(f"the engine with {options} did not start {ranks} ranks")
        split = case.generate(gen, EDGES)
    return int(np.abs(split - alone).max())


#: family -> (its case, its one-rank image, its image with the other control image).
OneRank = Callable[[str], tuple[ControlNetCase, np.ndarray, np.ndarray]]
#: A control image must move the image at least this far (max uint8 difference).
CONTROL_MIN_LEVELS = 20


def one_rank_cache(root: Path) -> OneRank:
    """A family's case and one-rank images, built in `root` on first use and kept."""
    cache: dict[str, tuple[ControlNetCase, np.ndarray, np.ndarray]] = {}

    def get(family: str) -> tuple[ControlNetCase, np.ndarray, np.ndarray]:
        if family not in cache:
            case = CASE_BUILDERS[family](root)
            cache[family] = (case, *one_rank_images(case))
        return cache[family]

    return get


#: The multi-rank parallel modes the cases run, by name: (ranks, their engine keywords).
PARALLEL_MODES: dict[str, tuple[int, dict[str, object]]] = {
    "cfg2": (2, dict(enable_cfg_parallel=True)),
    "ulysses2": (2, dict(ulysses_degree=2)),
    "ring2": (2, dict(ring_degree=2)),
    "tp2": (2, dict(tp_size=2)),
    "cfg2-ulysses2": (4, dict(enable_cfg_parallel=True, ulysses_degree=2)),
}


def assert_ranks_match_one_rank(one_rank: OneRank, family: str, mode: str) -> None:
    """The engine of `PARALLEL_MODES[mode]` gives the one-rank image within one uint8 level, and the other
    control image moves the one-rank image by at least `CONTROL_MIN_LEVELS`."""
    case, alone, other = one_rank(family)
    moved = int(np.abs(other - alone).max())
    ranks, options = PARALLEL_MODES[mode]
    error = max_difference_on_ranks(case, alone, ranks, **options)
    print(
        f"{family} ControlNet, {mode} vs one rank: max uint8 difference {error}; other control image: {moved}"
    )
    assert moved >= CONTROL_MIN_LEVELS
    assert error <= 1
