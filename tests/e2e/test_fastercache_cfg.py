"""FasterCache on requests with classifier-free guidance (issue 33): the negative-prompt branch skipped on
some steps and approximated from the prompt branch's prediction, against diffusers' own hook
(`FasterCacheConfig`, `is_guidance_distilled` False) on pipelines that batch both branches in one
transformer call, as the hook needs: SD3 (its output a latent image, `tensor_format` "BCHW") and
CogVideoX (a latent video, "BFCHW"). diffserve's latents are the families' own layout; the spectrum is
taken over the spatial dimensions either way.

diffusers' hook splits the transformer's keyword inputs named in
`_unconditional_conditional_input_kwargs_identifiers`: SD3 passes `pooled_projections` too, so the
reference lists it; its attention modules are `transformer_blocks.N.attn` (the default identifiers
select `attn1`), so the reference is given that pattern. The hook reads the pipeline's current timestep:
CogVideoX's pipeline keeps it, SD3's does not (read from the transformer's `timestep` input here).

Tiny random checkpoints, 20 steps, seed 7; PSNRs measured on CPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import CogVideoXPipeline, StableDiffusion3Pipeline
from diffusers.hooks import FasterCacheConfig, apply_faster_cache

from diffserve import DiffGenerator
from diffserve.errors import InvalidRequestError
from diffserve.families.cogvideox.tiny import TinyCogVideoXSpec, build_tiny_cogvideox
from diffserve.families.sd3.tiny import TinySD3Spec, build_tiny_sd3
from diffserve.testing.cache_parity import first_output_pixels as pixels
from diffserve.testing.faster_cache_reference import apply_sd3_faster_cache, attention_rows
from diffserve.testing.image_metrics import psnr_uint8 as psnr
from diffserve.testing.parity import to_uint8

STEPS = 20
PROMPT = "a red fox in the snow"
SD3_KWARGS = {"height": 64, "width": 64, "num_inference_steps": STEPS, "guidance_scale": 5.0}
COG_KWARGS = {"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": STEPS, "guidance_scale": 6.0}


@pytest.fixture(scope="module")
def sd3(tmp_path_factory):
    root = build_tiny_sd3(tmp_path_factory.mktemp("sd3"), TinySD3Spec(num_layers=4, seed=3))
    ours = DiffGenerator.from_pretrained(root, device="cpu", show_progress=False)
    return root, ours, pixels(ours.generate(PROMPT, seed=7, **SD3_KWARGS))


def sd3_reference(root, distilled: bool) -> tuple[np.ndarray, list[int]]:
    """diffusers' SD3 output with its FasterCache hook, and its attention calls' rows."""
    pipe = StableDiffusion3Pipeline.from_pretrained(root, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    rows = attention_rows(pipe.transformer, "attn")
    apply_sd3_faster_cache(pipe.transformer, distilled)
    generator = torch.Generator("cpu").manual_seed(7)
    image = pipe(PROMPT, generator=generator, output_type="np", **SD3_KWARGS).images[0]
    return (image * 255).round().astype(np.uint8), rows


#: SD3: (diffserve's cache, PSNR floor against the exact output). Measured: 43.3 dB (7 negative branches
#: skipped, 12 of 80 attention calls reused); with `is_guidance_distilled` 58.8 dB (16 reused, no branch
#: skipped). Floors about 4 dB below.
SD3_CASES = {
    "negative branch approximated": ({"method": "fastercache"}, 39.0),
    "distilled": ({"method": "fastercache", "is_guidance_distilled": True}, 54.0),
}


@pytest.mark.parametrize("case", list(SD3_CASES))
def test_sd3_decides_and_outputs_as_diffusers_hook(sd3, case) -> None:
    """Same steps without the negative branch, same attention calls run (rows and all), same pixels
    (measured: identical; the bar allows one uint8 level, a batch of one may round the other way)."""
    root, ours, exact = sd3
    cache, floor = SD3_CASES[case]
    distilled = bool(cache.get("is_guidance_distilled"))
    out = ours.generate(PROMPT, seed=7, cache=cache, **SD3_KWARGS)
    got = pixels(out)
    theirs, rows = sd3_reference(root, distilled)
    report = out.cache
    skipped = report.get("unconditional_skipped", 0)
    print(f"SD3 {case}: {psnr(got, exact):.1f} dB to exact, {psnr(got, theirs):.1f} dB to the hook, {report}")
    assert report["attention_computed"] == len(rows)  # the hook's calls that ran
    one_row_calls = 0 if distilled else 4 * skipped - report["attention_reused"]  # run on skipped steps
    assert sum(rows) == 2 * len(rows) - one_row_calls
    assert (skipped > 0) != distilled and report["attention_reused"] > 0
    assert np.abs(got.astype(int) - theirs.astype(int)).max() <= 1
    assert psnr(got, exact) >= floor


def test_cogvideox_video_decides_and_outputs_as_diffusers_hook(tmp_path) -> None:
    """A latent video (diffusers' frames-first layout, diffserve's channels-first): the same steps skip
    the negative branch and the same frames come out."""
    root = build_tiny_cogvideox(tmp_path, TinyCogVideoXSpec(variant="1.0-rope", num_layers=4))
    ours = DiffGenerator.from_pretrained(root, device="cpu", show_progress=False)
    exact = pixels(ours.generate(PROMPT, seed=7, **COG_KWARGS))
    out = ours.generate(PROMPT, seed=7, cache={"method": "fastercache"}, **COG_KWARGS)
    got = pixels(out)
    pipe = CogVideoXPipeline.from_pretrained(root, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    rows = attention_rows(pipe.transformer, "attn1")
    config = FasterCacheConfig(current_timestep_callback=lambda: pipe.current_timestep, tensor_format="BFCHW")
    apply_faster_cache(pipe.transformer, config)
    generator = torch.Generator("cpu").manual_seed(7)
    theirs = to_uint8(pipe(PROMPT, generator=generator, output_type="np", **COG_KWARGS).frames)[0]
    report = out.cache
    print(f"CogVideoX: {psnr(got, exact):.1f} dB to exact, {psnr(got, theirs):.1f} dB to the hook, {report}")
    assert report["unconditional_skipped"] > 0 and report["attention_reused"] > 0
    assert report["attention_computed"] == len(rows)
    one_row_calls = 4 * report["unconditional_skipped"] - report["attention_reused"]
    assert sum(rows) == 2 * len(rows) - one_row_calls
    assert np.abs(got.astype(int) - theirs.astype(int)).max() <= 1
    assert psnr(got, exact) >= 18.0  # measured 22.8 dB (10 of 20 negative branches skipped, 20 reused)


def test_requests_that_cannot_take_the_approximation_are_refused(sd3) -> None:
    """`is_guidance_distilled` false without CFG: no negative branch to approximate; skip-layer guidance
    reads the prompt branch's prediction on the same steps: both 400s naming `cache`."""
    _, ours, _ = sd3
    no_cfg = {**SD3_KWARGS, "guidance_scale": 1.0}
    with pytest.raises(InvalidRequestError, match="is_guidance_distilled false approximates") as exc:
        ours.generate(PROMPT, cache={"method": "fastercache", "is_guidance_distilled": False}, **no_cfg)
    assert exc.value.param == "cache"
    with pytest.raises(InvalidRequestError, match="skip-layer guidance reads both branches") as exc:
        ours.generate(PROMPT, cache={"method": "fastercache"}, skip_guidance_layers=[1], **SD3_KWARGS)
    assert exc.value.param == "cache"
    # distilled: attention reuse on both branches, no approximation: accepted with skip-layer guidance too
    out = ours.generate(
        PROMPT,
        cache={"method": "fastercache", "is_guidance_distilled": True},
        skip_guidance_layers=[1],
        num_inference_steps=4,
        **{k: v for k, v in SD3_KWARGS.items() if k != "num_inference_steps"},
    )
    assert "unconditional_skipped" not in out.cache
