"""diffserve vs diffusers per model family: SD3, Qwen-Image, Qwen-Image-Edit, Z-Image, Wan 2.1 T2V and I2V, Wan 2.2 A14B and TI2V-5B, HunyuanVideo 1.5, LTX-2,
FLUX.2-dev, FLUX.2 [klein], FLUX.1 Kontext, SANA, CogVideoX 1.5, Mochi 1, SkyReels-V2 T2V, HunyuanVideo 1.0 T2V,
HiDream-I1, Qwen-Image 2.1, HunyuanImage 2.1, Chroma, LongCat-Image and -Edit, Qwen-Image-Layered and SANA-Video.

The method of `bench_flux_vs_diffusers.py` (shared through `harness.py`), one family after the other:
build (or reuse) a random-weight checkpoint of realistic block shape (64-dim heads, 8 of them or 12
for Wan; FLUX.2's 128-dim heads, 4 of them; SANA's 32-dim linear-attention heads, 24 of them; a few
layers: a 30-44M-parameter DiT; small text encoders, which are not what is measured),
then time both engines on it, each measurement in a fresh subprocess (this script re-invoked with
`--worker ENGINE RES`), engines alternating: load (timed), one uncounted warm-up generation, `--repeats` timed
generations. The parent reports s/step, end-to-end, load time, peak RSS, the PSNR between the two
engines' images (same seed) and the DiT forward calls per denoising step of each engine (a counter
wrapped around the transformer's forward), which shows how each engine runs classifier-free guidance:
one batched forward, or one forward per branch.

Guidance as each pipeline is used by default. CFG is on for SD3 (guidance 7 with a negative prompt),
Qwen-Image and Qwen-Image-Edit (true_cfg_scale 4 with negative prompt " "), Z-Image (guidance 4, default
empty negative prompt), Wan (guidance 5 with a negative prompt), FLUX.2 [klein] (guidance 4 against the
empty prompt; the checkpoint is a klein base, `is_distilled` false) and SANA (guidance 4.5, default empty
negative prompt and complex human instruction). FLUX.2-dev (guidance 4) and FLUX.1 Kontext (guidance 3.5)
are guidance-distilled: the scale is embedded in the DiT and no negative branch runs. The Wan families generate `--num-frames` frames (default 17) at size x
size (default 128, the image families 256; `--resolutions` sets both) with the UniPC scheduler the
released checkpoints ship; the PSNR covers every frame (each worker saves the video as one lossless
PNG, its frames stacked top to bottom). Wan I2V gets a size x size input image and keeps diffusers'
default 512 text tokens: its image cross-attention finds the image tokens by assuming exactly that many.

Qwen-Image-Edit gets a size x size input image; both engines resize it to `--edit-condition-area`
pixels before encoding it. The real behaviour, hard-coded in diffusers, is 1024*1024; that made one
256x256 edit generation take 86-120 s on a (busy) 2-core machine, so the default here is 512*512, applied to
both engines (diffusers' `calculate_dimensions` wrapped, diffserve's pipeline config set) and printed
in the report; `--edit-condition-area 1048576` runs the real behaviour.

FLUX.1 Kontext gets a size x size input image. Its real behaviour resizes that image to the nearest ~1 MP
training resolution (1024x1024 for a square one: 4096 condition tokens next to 256 noisy ones at
256x256, as costly as the edit case above), so by default both engines keep it at size x size (diffusers
`_auto_resize=False`, diffserve's pipeline config `auto_resize=False`); `--kontext-auto-resize` runs the
real behaviour. diffusers' Kontext pipeline also rescales a given output size to `max_area` (1024*1024),
where diffserve keeps it: it is called with `max_area=size*size`. FLUX.2-dev's diffusers pipeline is built
from its components (`from_pretrained` would construct the PixtralProcessor, which needs torchvision),
with the folder's tokenizer in the processor's place, as tests/e2e/test_flux2_pipeline_parity.py does.
SANA's resolution binning (on by default in both engines) generates every square request at 512x512
(the checkpoint's `sample_size` 16 picks the 512 px bins) and resizes it back, so SANA runs at 512x512
by default: 16x16 latents, 256 tokens, the other image families' count at 256x256. Its linear attention
runs as plain matmuls, counted by the FLOP counter as linear work; only its cross-attention is SDPA.

The later families (each builder's tiny checkpoint widened to 8x64 heads, or Wan's 12x64 for SkyReels-V2;
VAE layouts the builders hard-code are widened during the build where they are narrower than the released
ones' proportions allow): CogVideoX 1.5 (guidance 6, static), Mochi 1 (guidance 4.5; its 6x temporal VAE
takes 6k+1 frames, so `--num-frames` is rounded down: 17 -> 13), SkyReels-V2 T2V (guidance 6 with Wan's
negative prompt), HunyuanVideo 1.0 (guidance 6 embedded in the DiT: guidance-distilled, no negative
branch), HiDream-I1 (Full: guidance 5, UniPC), Qwen-Image 2.1 (no CFG: true_cfg_scale 1, the model's
default) and HunyuanImage 2.1 (the folder's APG/CFG guiders, scale 3.5). The video ones default to 128x128.
HiDream's pipelines (both) rescale every request to their default area, 128x128 with the builder's scale-1
VAE, so it is measured at 128x128 (any `--resolutions` is generated at 128x128 by both); HunyuanImage 2.1's
32x VAE runs at 512x512 by default (16x16 latents, 256 tokens). Qwen-Image 2.1's diffusers pipeline gets
the Qwen3-VL processor diffserve loads (transformers builds one only with torchvision).

Issues 35/36's last five (8x64 heads, width 512): Chroma (guidance 5, real CFG against the empty prompt),
LongCat-Image (guidance 4.5 with CFG renormalisation; diffusers' default prompt rewriting, a text generation
diffserve refuses, off), LongCat-Image-Edit and Qwen-Image-Layered (both size their output from the input
image at about 1 MP, or Layered's 640 bucket: both engines get the area size x size instead, diffusers'
`calculate_dimensions` wrapped and diffserve's config set, as Qwen-Image-Edit's condition area; Layered
decomposes an opaque RGBA size x size picture into 2 RGBA layers with true_cfg_scale 4, compared as one
strip of every layer's RGB and alpha) and SANA-Video (guidance 6, resolution binning off on both: its 480p
bins would generate 624x624; diffusers' `frames` is the other engines' `num_frames`), 128x128 x 17 frames.

`--compile` adds two engines, so four per family and size: `diffserve`, `diffserve-compiled`
(`DiffGenerator.from_pretrained(path, compile=True)`: regional inductor compile of the DiT's block lists,
compiled and warmed up inside from_pretrained, so in "load s"), `diffusers`, `diffusers-compiled`
(`pipe.transformer.compile_repeated_blocks()` where diffusers' DiT class declares `_repeated_blocks`,
Qwen-Image, Z-Image, Wan, FLUX.2 and FLUX.1 Kontext; else `pipe.transformer = torch.compile(pipe.transformer)`,
SD3 and SANA; torch.compile
defaults, compiling in the worker's first generation, reported as "first call s") and
`diffusers-compiled-full` (`pipe.transformer = torch.compile(pipe.transformer)` for every family: the
whole transformer in one graph wherever diffusers' DiT has no graph break, which the worker prints; the
same as `diffusers-compiled` for SD3 and SANA), the order rotating per round. A compiled engine whose worker fails is reported as FAILED with its error instead of
ending the run. Per size, a `flop-count` worker first runs one step of eager diffusers with its DiT
under torch's FLOP counter (linear layers) and an SDPA recorder (attention, counted as 4 x batch x
heads x q_len x kv_len x head_dim per call), and the parent samples the fp32 `torch.mm` rate on the
DiT's shapes before and after each round (roofline.py's method): each engine gets "% of matmul rate".
The table's ratios are diffusers eager / diffserve eager, diffusers eager / diffserve compiled,
diffusers compiled / diffserve compiled and diffusers compiled whole / diffserve compiled.

`--quick` (with or without `--compile`): 2 steps, 1 timed run, 1 round, and
unless `--family` says otherwise the three families of issue 37's bar (qwen-image, wan-t2v,
flux-kontext): a smoke run of every engine in some minutes, not a measurement.

    .venv/bin/python benchmarks/bench_families.py                                  # all twenty-six; 4 steps
    .venv/bin/python benchmarks/bench_families.py --family flux2,flux2-klein,flux-kontext,sana
    .venv/bin/python benchmarks/bench_families.py --family wan-t2v,wan-i2v --num-frames 17
    .venv/bin/python benchmarks/bench_families.py --family wan22-a14b,wan22-ti2v --num-frames 17
    .venv/bin/python benchmarks/bench_families.py --family hunyuan-video15,ltx2 --num-frames 17
    .venv/bin/python benchmarks/bench_families.py --family cogvideox,mochi,skyreels-v2,hunyuan-video
    .venv/bin/python benchmarks/bench_families.py --family hidream,qwen-image21,hunyuan-image
    .venv/bin/python benchmarks/bench_families.py --family chroma,longcat-image,longcat-image-edit,qwen-image-layered,sana-video
    .venv/bin/python benchmarks/bench_families.py --family qwen-image --resolutions 256,512 --json out.json
    .venv/bin/python benchmarks/bench_families.py --model-dir /tmp/bench_families   # build once, reuse later
    .venv/bin/python benchmarks/bench_families.py --compile --model-dir /tmp/bench_families --json compiled.json
    .venv/bin/python benchmarks/bench_families.py --family z-image --compile --steps 1 --repeats 1 --resolutions 64
    .venv/bin/python benchmarks/bench_families.py --compile --quick --model-dir /tmp/bench_families

Ratios are diffusers / diffserve: above 1 means diffserve is faster (or, for RSS, smaller).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import harness
import roofline

#: The condition area diffusers' QwenImageEditPipeline hard-codes (and diffserve's config defaults to).
REAL_EDIT_CONDITION_AREA = 1024 * 1024
#: The benchmark's default instead: at the real area (4096 condition tokens next to 256 image tokens at
#: 256x256) one edit generation took 86-120 s on a (busy) 2-core machine, too long for a routine run. Both
#: engines get the same reduced area; `--edit-condition-area 1048576` restores the real behaviour.
DEFAULT_EDIT_CONDITION_AREA = 512 * 512
#: Output size of the image families when `--resolutions` is not given (see `Family.default_size`).
DEFAULT_SIZE = 256
SD3_NEGATIVE_PROMPT = "blurry, low quality, deformed"
WAN_NEGATIVE_PROMPT = "static, blurry, low quality, distorted"
#: Frames per Wan video: 4k+1 (the VAE compresses time 4x after the first frame); 17 -> 5 latent frames.
DEFAULT_NUM_FRAMES = 17
#: `--compile` adds each project's compiled engine next to the eager two (`harness.ENGINES`).
COMPILE_ENGINES = (
    "diffserve",
    "diffserve-compiled",
    "diffusers",
    "diffusers-compiled",
    "diffusers-compiled-full",
)
COMPILED_ENGINES = ("diffserve-compiled", "diffusers-compiled", "diffusers-compiled-full")
#: `--quick`'s families when `--family` is not given: the ones issue 37's compiled bar names.
QUICK_FAMILIES = ("qwen-image", "wan-t2v", "flux-kontext")
#: The `--compile` worker that counts one denoising step's DiT FLOPs on diffusers' pipeline (not timed).
FLOP_COUNT = "flop-count"
#: (label, diffusers engine, diffserve engine) of the `--compile` ratios: diffusers time / diffserve time.
RATIOS = (
    ("diffusers eager / diffserve eager", "diffusers", "diffserve"),
    ("diffusers eager / diffserve compiled", "diffusers", "diffserve-compiled"),
    ("diffusers compiled / diffserve compiled", "diffusers-compiled", "diffserve-compiled"),
    ("diffusers compiled whole / diffserve compiled", "diffusers-compiled-full", "diffserve-compiled"),
)


@dataclass(frozen=True)
class Family:
    """One benchmarked model family: its checkpoint and the generation settings both engines get."""

    name: str  # --family value and sub-folder name
    pipeline: str  # the diffusers pipeline class (and model_index.json `_class_name`)
    checkpoint: str  # the checkpoint's shape, for the report
    cfg: str  # how CFG is configured, for the report
    build: Callable[[Path], Any]
    #: Keyword arguments both `DiffGenerator.generate` and the diffusers pipeline accept unchanged.
    sampling: dict[str, Any]
    #: Takes a size x size input image (`edit_input_image`), passed to both engines as `image=`.
    image_input: bool = False
    #: Generates `--num-frames` frames; the worker compares all of them (see `video_strip`).
    video: bool = False
    #: Frame size when `--resolutions` is not given: a video of 17 frames at 256x256 costs about ten
    #: images' worth of work, so the Wan families default to 128x128 (one generation in ~10-30 s on 2 cores);
    #: SANA to 512x512, the size its resolution binning generates (`SANA_SIZE`).
    default_size: int = DEFAULT_SIZE
    #: Frames a video takes are k * frame_step + 1 (the VAE's temporal compression): `--num-frames` is
    #: rounded down to that (Mochi's 6x VAE: 17 -> 13; see `family_frames`).
    frame_step: int = 4
    #: The fewest denoising steps the pipelines take (Mochi's linear-quadratic schedule needs 2); the
    #: `flop-count` worker runs this many and divides by it.
    min_steps: int = 1
    #: The same setting spelled per engine where the two spell it differently (LTX-2's STG blocks: a
    #: diffusers keyword, diffserve's `extra`).
    diffserve_only: dict[str, Any] = field(default_factory=dict)
    diffusers_only: dict[str, Any] = field(default_factory=dict)
    #: The pipelines size the output from the input image (diffusers' takes no height/width): neither engine
    #: gets height/width; both resize the input image to size * size pixels instead (`_size_rule_area`).
    sized_by_input: bool = False
    #: The output is this many RGBA layers per generation (Qwen-Image-Layered), compared as one strip
    #: (`layer_strip`); 0: one image or video.
    layers: int = 0
    #: The input image's PIL mode (Qwen-Image-Layered decomposes an RGBA picture).
    image_mode: str = "RGB"


def _sd3_build(path: Path) -> None:
    from diffserve.families.sd3.tiny import TinySD3Spec, build_tiny_sd3

    build_tiny_sd3(
        path,
        TinySD3Spec(
            num_layers=3,
            num_attention_heads=8,
            attention_head_dim=64,
            qk_norm="rms_norm",
            dual_attention_layers=(0,),
            clip_hidden_size=64,  # CLIP-L 64, CLIP-G 72: pooled projection 136
            t5_hidden_size=256,  # = joint_attention_dim
            sample_size=64,
            pos_embed_max_size=64,  # up to 1024x1024
            vae_block_out_channels=(32, 64, 128, 128),
            vae_norm_num_groups=32,
            seed=0,
        ),
    )


def _qwen_spec(variant: str):
    from diffserve.families.qwen_image.tiny import TinyQwenImageSpec

    return TinyQwenImageSpec(
        variant=variant,
        num_layers=4,
        num_attention_heads=8,
        attention_head_dim=64,
        axes_dims_rope=(8, 28, 28),  # the released (16, 56, 56) at half the head dim
        vae_base_dim=32,
        vae_dim_mult=(1, 2, 4, 4),
        text_hidden_size=256,  # = joint_attention_dim
        text_layers=2,
        text_heads=4,
        text_kv_heads=2,
        vision_hidden_size=32,
        vision_depth=2,
        seed=0,
    )


def _qwen_build(path: Path) -> None:
    from diffserve.families.qwen_image.tiny import build_tiny_qwen_image

    build_tiny_qwen_image(path, _qwen_spec("t2i"))


def _qwen_edit_build(path: Path) -> None:
    from diffserve.families.qwen_image.tiny import build_tiny_qwen_image_edit

    build_tiny_qwen_image_edit(path, _qwen_spec("edit"))


def _z_image_build(path: Path) -> None:
    from diffserve.families.z_image.tiny import TinyZImageSpec, build_tiny_zimage

    build_tiny_zimage(
        path,
        TinyZImageSpec(
            dim=512,
            n_layers=6,
            n_refiner_layers=2,
            n_heads=8,
            axes_dims=(16, 24, 24),  # the released (32, 48, 48) at half the head dim
            vae_block_out_channels=(32, 64, 128, 128),
            vae_norm_num_groups=32,
            text_hidden_size=256,  # = cap_feat_dim
            text_layers=2,
            text_heads=4,
            text_kv_heads=2,
            seed=0,
        ),
    )


def _hunyuan_video15_build(path: Path) -> None:
    from diffserve.families.hunyuan_video15.tiny import TinyHunyuanVideo15Spec, build_tiny_hunyuan_video15

    build_tiny_hunyuan_video15(
        path,
        TinyHunyuanVideo15Spec(
            num_layers=3,
            num_refiner_layers=1,
            num_attention_heads=8,
            attention_head_dim=64,  # width 512 (the 8.3B model: 16 x 128, 54 blocks)
            rope_axes_dim=(16, 24, 24),
            latent_channels=32,  # as the released VAE
            vae_block_out_channels=(32, 64, 128, 128, 128),
            text_hidden_size=256,
            dit_weight_noise=0.2,
            seed=0,
        ),
    )


def _ltx2_build(path: Path) -> None:
    from diffserve.families.ltx2.tiny import TinyLTX2Spec, build_tiny_ltx2

    build_tiny_ltx2(
        path,
        TinyLTX2Spec(
            num_layers=3,
            num_attention_heads=8,
            attention_head_dim=64,  # video width 512 (LTX-2: 32 x 128, 48 blocks)
            audio_num_attention_heads=4,
            audio_attention_head_dim=32,  # audio width 128 (LTX-2: 32 x 64)
            latent_channels=128,  # as the released video VAE
            vae_channels=32,
            text_hidden_size=256,
            seed=0,
        ),
    )


def _wan_build(path: Path, image_to_video: bool, variant: str = "2.1") -> None:
    from diffserve.families.wan.tiny import TinyWanSpec, build_tiny_wan

    build_tiny_wan(
        path,
        TinyWanSpec(
            image_to_video=image_to_video,
            variant=variant,
            num_layers=3,
            num_attention_heads=12,  # Wan2.1-1.3B's head count at half its head dim (12 x 128)
            attention_head_dim=64,  # RoPE split 24/20/20 over frames/rows/cols
            ffn_dim=4480,  # the released 8960 / 1536 ratio at width 768
            freq_dim=256,
            text_dim=256,
            text_layers=2,
            vae_base_dim=32,
            clip_hidden_size=64,
            clip_image_size=224,  # with patch 14: 257 image tokens, as the released ViT-H/14
            clip_patch_size=14,
            scheduler="unipc",
            dit_weight_noise=WAN_DIT_WEIGHT_NOISE,
            seed=0,
        ),
    )


#: N(0, 0.05) added to every DiT weight on top of the default init, so the random DiT reacts to its
#: text and CFG visibly changes the video (measured at 64x64, 5 frames, 2 steps: guidance 5 vs 1 gives
#: 31 dB, another prompt 39 dB; at 0.02, 40 and 48 dB), while the frames stay unsaturated.
WAN_DIT_WEIGHT_NOISE = 0.05


def _flux2_build(path: Path, variant: str) -> None:
    from diffserve.families.flux2.tiny import TinyFlux2Spec, build_tiny_flux2

    build_tiny_flux2(
        path,
        TinyFlux2Spec(
            variant=variant,
            num_layers=2,
            num_single_layers=FLUX2_SINGLE_LAYERS[variant],
            num_attention_heads=4,  # FLUX.2's 128-dim heads (dev 48 x 128, klein 4B 24 x 128): width 512
            attention_head_dim=128,
            axes_dims_rope=(32, 32, 32, 32),  # the released 4-axis split of a 128-dim head
            timestep_guidance_channels=256,
            latent_channels=32,  # the released VAE's (128 channels per 2x2-patched token)
            vae_block_out_channels=(32, 64, 128, 128),
            vae_norm_num_groups=32,
            text_hidden_size=128,  # joint attention dim 3 x 128 (three encoder layers concatenated)
            is_distilled=False,  # klein base: CFG on (a step-distilled klein runs without it)
            dit_weight_noise=FLUX2_DIT_WEIGHT_NOISE,
            seed=0,
        ),
    )


#: Single-stream blocks next to the 2 double-stream ones (released: dev 8 + 48, klein 4B 5 + 20).
FLUX2_SINGLE_LAYERS = {"dev": 6, "klein": 6}
#: N(0, 0.02) on every DiT weight (the builder's default 0.3 is for 16-wide test models), so the random DiT
#: reacts to its text while the 512-wide stack keeps its images unsaturated.
FLUX2_DIT_WEIGHT_NOISE = 0.02


def _flux_kontext_build(path: Path) -> None:
    from bench_flux_vs_diffusers import checkpoint_spec
    from diffserve.families.flux.tiny_kontext import build_tiny_flux_kontext

    build_tiny_flux_kontext(path, checkpoint_spec())


def _sana_build(path: Path) -> None:
    from diffserve.families.sana.tiny import TinySanaSpec, build_tiny_sana

    build_tiny_sana(
        path,
        TinySanaSpec(
            num_layers=4,
            num_attention_heads=24,  # SANA's 32-dim linear-attention heads (600M: 36 x 32): width 768
            attention_head_dim=32,
            num_cross_attention_heads=12,
            cross_attention_head_dim=64,
            sample_size=SANA_SAMPLE_SIZE,
            latent_channels=32,  # the released DC-AE f32c32's
            vae_block_out_channels=(16, 32, 64, 128, 128, 128),
            vae_attention_head_dim=32,
            text_hidden_size=256,  # = caption_channels
            text_layers=2,
            text_heads=4,
            text_kv_heads=2,
            seed=0,
        ),
    )


#: The DiT's `sample_size` 16 picks the 512 px aspect-ratio bins (Sana_600M/1600M_512px): resolution binning
#: generates every square request at 512x512 (16x16 latents: 256 tokens, as the other families at 256x256)
#: and resizes it back, so SANA is measured at 512x512, the size its binning keeps.
SANA_SAMPLE_SIZE = 16
SANA_SIZE = 512


def _cogvideox_build(path: Path) -> None:
    from unittest import mock

    from diffserve.families.cogvideox import tiny
    from diffserve.families.cogvideox.tiny import TinyCogVideoXSpec

    def vae_config(spec):  # the builder's VAE is (8, 8, 16, 16): widen it to the released layout's shape
        return {
            **original_vae_config(spec),
            "block_out_channels": list(COGVIDEOX_VAE_CHANNELS),
            "norm_num_groups": 32,
        }

    original_vae_config = tiny._vae_config
    with mock.patch.object(tiny, "_vae_config", vae_config):
        tiny.build_tiny_cogvideox(
            path,
            TinyCogVideoXSpec(
                variant="1.5",
                num_layers=3,
                num_attention_heads=8,
                attention_head_dim=64,  # width 512 (CogVideoX1.5-5B: 48 x 64, 42 blocks)
                time_embed_dim=512,
                text_dim=256,
                text_layers=2,
                latent_channels=16,  # as the released VAE
                sample_height=COGVIDEOX_SAMPLE_SIZE,
                sample_width=COGVIDEOX_SAMPLE_SIZE,
                sample_frames=DEFAULT_NUM_FRAMES,
                dit_weight_noise=VIDEO_DIT_WEIGHT_NOISE,
                seed=0,
            ),
        )


#: CogVideoX 1.5's RoPE is sliced out of a `sample_size`-wide grid: 32 latents covers frames up to 256x256.
COGVIDEOX_SAMPLE_SIZE = 32
#: The released CogVideoX VAE's (128, 256, 256, 512) at a quarter of the width.
COGVIDEOX_VAE_CHANNELS = (32, 64, 64, 128)
#: N(0, 0.05) on every DiT weight for the 512-wide video DiTs (the builders' 0.2 is for 32-wide test models).
VIDEO_DIT_WEIGHT_NOISE = 0.05


def _mochi_build(path: Path) -> None:
    from unittest import mock

    from diffserve.families.mochi import tiny
    from diffserve.families.mochi.tiny import TinyMochiSpec

    def vae_config(spec):  # the builder's decoder is (32, 32, 32, 64): widen it towards the released one
        return {**original_vae_config(spec), "decoder_block_out_channels": MOCHI_DECODER_CHANNELS}

    original_vae_config = tiny._vae_config
    with mock.patch.object(tiny, "_vae_config", vae_config):
        tiny.build_tiny_mochi(
            path,
            TinyMochiSpec(
                num_layers=3,
                num_attention_heads=8,
                attention_head_dim=64,  # width 512 (Mochi 1: 24 x 128, 48 blocks)
                pooled_projection_dim=256,  # the text stream's width (released 1536 next to 3072)
                time_embed_dim=256,
                text_dim=256,
                text_layers=2,
                dit_weight_noise=VIDEO_DIT_WEIGHT_NOISE,
                seed=0,
            ),
        )


#: The released Mochi decoder's (128, 256, 512, 768) at a quarter of the width.
MOCHI_DECODER_CHANNELS = (32, 64, 128, 192)


def _skyreels_v2_build(path: Path) -> None:
    from functools import partial as bind
    from unittest import mock

    from diffserve.families.wan import skyreels_v2_tiny
    from diffserve.families.wan.tiny import TinyWanSpec

    # The builder always uses the tiny Wan shapes (`TinyWanSpec(image_to_video, seed)`): give it wan-t2v's.
    wan_spec = bind(
        TinyWanSpec,
        num_layers=3,
        num_attention_heads=12,
        attention_head_dim=64,
        ffn_dim=4480,
        freq_dim=256,
        text_dim=256,
        text_layers=2,
        vae_base_dim=32,
        dit_weight_noise=WAN_DIT_WEIGHT_NOISE,
    )
    with mock.patch.object(skyreels_v2_tiny, "TinyWanSpec", wan_spec):
        skyreels_v2_tiny.build_tiny_skyreels_v2(path, skyreels_v2_tiny.TinySkyReelsV2Spec(seed=0))


def _hunyuan_video_build(path: Path) -> None:
    from unittest import mock

    from diffserve.families.hunyuan_video import tiny
    from diffserve.families.hunyuan_video.tiny import TinyHunyuanVideoSpec

    spec = TinyHunyuanVideoSpec(
        num_layers=2,
        num_single_layers=2,
        num_attention_heads=8,
        attention_head_dim=64,  # width 512 (HunyuanVideo: 24 x 128, 20 double + 40 single blocks)
        text_dim=256,
        text_layers=3,  # the pipeline reads the states two layers below the last
        pooled_dim=64,
        latent_channels=16,  # as the released VAE
        guidance_embeds=True,
        dit_weight_noise=VIDEO_DIT_WEIGHT_NOISE,
        seed=0,
    )
    dit_config = {**tiny.tiny_dit_config(spec), "rope_axes_dim": (16, 24, 24)}  # the builder's is (4, 6, 6)

    def vae_config(spec):  # the builder's VAE is (8, 16, 16, 16): widen it to the released layout's shape
        return {
            **original_vae_config(spec),
            "block_out_channels": HUNYUAN_VIDEO_VAE_CHANNELS,
            "norm_num_groups": 32,
        }

    original_vae_config = tiny.tiny_vae_config
    root = tiny.tiny_folder(path, spec.seed)
    tokenizer = tiny.llama_template_tokenizer()
    tiny.save_text_encoder(root, tiny._llama(tokenizer, spec), tokenizer)
    with mock.patch.object(tiny, "tiny_vae_config", vae_config):
        tiny.write_clip_dit_vae_scheduler(root, spec, dit_config)
    tiny.finish_tiny_folder(root, tiny.hunyuan_video_model_index(), spec)


#: The released HunyuanVideo VAE's (128, 256, 512, 512) at a quarter of the width.
HUNYUAN_VIDEO_VAE_CHANNELS = (32, 64, 128, 128)


def _hidream_build(path: Path) -> None:
    from diffserve.families.hidream.tiny import TinyHiDreamSpec, build_tiny_hidream

    build_tiny_hidream(
        path,
        TinyHiDreamSpec(
            num_layers=2,
            num_single_layers=2,
            num_attention_heads=8,
            attention_head_dim=64,  # width 512 (HiDream-I1: 20 x 128, 16 double + 32 single blocks)
            axes_dims_rope=(32, 16, 16),  # the released (64, 32, 32) at half the head dim
            patch_size=8,  # the builder's: with its scale-1 VAE, 128x128 latents in 256 tokens
            latent_channels=16,
            clip_hidden_size=64,
            t5_hidden_size=256,
            llama_hidden_size=256,
            llama_layers=3,
            dit_weight_noise=0.02,
            scheduler="unipc",  # HiDream-I1-Full's (the CFG model; Dev and Fast are distilled)
            seed=0,
        ),
    )


#: HiDream's pipelines (both) rescale every request to the default area, (128 x VAE factor)^2: the
#: builder's VAE has factor 1, so every image is 128x128 pixels (128x128 latents, 256 tokens of 8x8).
HIDREAM_SIZE = 128


def _qwen_image21_build(path: Path) -> None:
    from diffserve.families.qwen_image21.tiny import TinyQwenImage21Spec, build_tiny_qwen_image21

    build_tiny_qwen_image21(
        path,
        TinyQwenImage21Spec(
            num_layers=8,  # single-stream blocks: 8 make a DiT of the others' size (~30M parameters)
            num_attention_heads=8,
            attention_head_dim=64,
            axes_dims_rope=(8, 28, 28),
            latent_channels=64,  # as the released 16x VAE
            text_hidden_size=256,
            text_layers=2,
            vae_base_dim=32,
            vae_dim_mult=(1, 2, 4, 4, 4),
            dit_weight_noise=0.02,
            seed=0,
        ),
    )


def _hunyuan_image_build(path: Path) -> None:
    from diffserve.families.hunyuan_image.tiny import TinyHunyuanImageSpec, build_tiny_hunyuan_image

    build_tiny_hunyuan_image(
        path,
        TinyHunyuanImageSpec(
            num_layers=2,
            num_single_layers=2,
            num_refiner_layers=1,
            num_attention_heads=8,
            attention_head_dim=64,  # width 512 (HunyuanImage 2.1: 28 x 128, 20 double + 40 single)
            rope_axes_dim=(32, 32),
            latent_channels=64,  # as the released 32x VAE
            vae_block_out_channels=(32, 64, 128, 128, 256, 256),
            text_hidden_size=256,
            text_layers=3,
            text_heads=4,
            text_kv_heads=2,
            vision_hidden_size=32,
            vision_depth=1,
            glyph_hidden_size=64,
            dit_weight_noise=0.05,
            dit_output_scale=1.0,
            seed=0,
        ),
    )


#: HunyuanImage 2.1's 32x VAE: 512x512 is 16x16 latents, 256 tokens, the other image families' count at 256.
HUNYUAN_IMAGE_SIZE = 512


def _chroma_build(path: Path) -> None:
    from diffserve.families.chroma.tiny import TinyChromaSpec, build_tiny_chroma

    build_tiny_chroma(
        path,
        TinyChromaSpec(
            num_layers=2,
            num_single_layers=4,
            num_attention_heads=8,
            attention_head_dim=64,  # width 512 (Chroma1-HD: 24 x 128, 19 double + 38 single blocks)
            axes_dims_rope=(16, 24, 24),  # FLUX.1's (16, 56, 56) at half the head dim
            approximator_num_channels=64,  # as released
            approximator_hidden_dim=512,  # released 5120
            approximator_layers=5,  # as released
            latent_channels=16,
            vae_block_out_channels=(32, 64, 128, 128),
            vae_norm_num_groups=32,
            text_hidden_size=256,  # = joint_attention_dim (a 2-layer T5)
            text_layers=2,
            t5_max_length=512,
            seed=0,
        ),
    )


def _longcat_image_build(path: Path, variant: str) -> None:
    from diffserve.families.longcat_image.tiny import TinyLongCatImageSpec, build_tiny_longcat_image

    build_tiny_longcat_image(
        path,
        TinyLongCatImageSpec(
            variant=variant,
            num_layers=2,
            num_single_layers=4,
            num_attention_heads=8,
            attention_head_dim=64,  # width 512 (LongCat-Image: 24 x 128, 10 double + 20 single blocks)
            axes_dims_rope=(16, 24, 24),  # the released (16, 56, 56) at half the head dim
            latent_channels=16,
            vae_block_out_channels=(32, 64, 128, 128),
            vae_norm_num_groups=32,
            text_hidden_size=256,  # = joint_attention_dim
            text_layers=2,
            text_heads=4,
            text_kv_heads=2,
            vision_hidden_size=32,
            vision_depth=1,
            seed=0,
        ),
    )


def _qwen_layered_build(path: Path) -> None:
    from diffserve.families.qwen_image.tiny import build_tiny_qwen_image_layered

    build_tiny_qwen_image_layered(path, _qwen_spec("layered"))


#: Qwen-Image-Layered decomposes its input into this many RGBA layers (the pipelines' default is 4): with the
#: composite and the input image the DiT sees 4 images' tokens, 1024 at 256x256, per branch.
QWEN_LAYERED_LAYERS = 2


def _sana_video_build(path: Path) -> None:
    from diffserve.families.sana_video.tiny import TinySanaVideoSpec, build_tiny_sana_video

    build_tiny_sana_video(
        path,
        TinySanaVideoSpec(
            num_layers=4,
            num_attention_heads=8,
            attention_head_dim=64,  # width 512 (SANA-Video 2B: 20 x 112, 20 blocks); Wan's RoPE split
            cross_attention_head_dim=64,  # 8 cross-attention heads
            vae_base_dim=32,  # Wan 2.1's VAE at a third of the width (released 96)
            text_hidden_size=256,  # = caption_channels (a 2-layer Gemma-2)
            text_layers=2,
            text_heads=4,
            text_kv_heads=2,
            dit_weight_noise=VIDEO_DIT_WEIGHT_NOISE,
            seed=0,
        ),
    )


_WAN_CHECKPOINT = (
    "Wan 2.1 layout, 3 blocks, 12x64 heads (width 768; 1.3B: 12x128, 30 blocks), ffn 4480, freq dim 256, "
    "text dim 256 (a 2-layer UMT5 encoder, 512 tokens), causal-3D VAE base dim 32, mults (1, 2, 4, 4), "
    "UniPC (flow_shift 3)"
)

_QWEN_CHECKPOINT = (
    "Qwen-Image layout, 4 dual-stream blocks, 8x64 heads, RoPE axes (8, 28, 28), joint attention dim 256 "
    "(a 2-layer Qwen2.5-VL text encoder of width 256), causal-3D VAE base dim 32, mults (1, 2, 4, 4)"
)

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            name="sd3",
            pipeline="StableDiffusion3Pipeline",
            checkpoint=(
                "SD3.5-Medium layout (qk RMSNorm, dual attention in block 0), 3 joint blocks, 8x64 heads, "
                "T5 width 256 padded to 256 tokens + 77 CLIP tokens, pos-embed grid 64, VAE (32, 64, 128, 128)"
            ),
            cfg=f"guidance_scale 7, negative prompt {SD3_NEGATIVE_PROMPT!r}",
            build=_sd3_build,
            sampling={
                "guidance_scale": 7.0,
                "negative_prompt": SD3_NEGATIVE_PROMPT,
                "max_sequence_length": 256,
            },
        ),
        Family(
            name="qwen-image",
            pipeline="QwenImagePipeline",
            checkpoint=_QWEN_CHECKPOINT,
            cfg="true_cfg_scale 4, negative prompt ' '",
            build=_qwen_build,
            sampling={"true_cfg_scale": 4.0, "negative_prompt": " ", "max_sequence_length": 512},
        ),
        Family(
            name="qwen-image-edit",
            pipeline="QwenImageEditPipeline",
            checkpoint=_QWEN_CHECKPOINT + ", Qwen2-VL processor (vision input capped at 12,544 pixels)",
            cfg="true_cfg_scale 4, negative prompt ' '; input image size x size (a synthetic picture)",
            build=_qwen_edit_build,
            sampling={"true_cfg_scale": 4.0, "negative_prompt": " ", "max_sequence_length": 512},
            image_input=True,
        ),
        Family(
            name="z-image",
            pipeline="ZImagePipeline",
            checkpoint=(
                "Z-Image layout, dim 512 (8x64 heads), 6 joint + 2 noise-refiner + 2 context-refiner blocks, "
                "RoPE axes (16, 24, 24), caption dim 256 (a 2-layer Qwen3 text encoder), VAE (32, 64, 128, 128)"
            ),
            cfg="guidance_scale 4, default (empty) negative prompt",
            build=_z_image_build,
            sampling={"guidance_scale": 4.0, "max_sequence_length": 512},
        ),
        Family(
            name="wan-t2v",
            pipeline="WanPipeline",
            checkpoint=_WAN_CHECKPOINT,
            cfg=f"guidance_scale 5, negative prompt {WAN_NEGATIVE_PROMPT!r}",
            build=lambda path: _wan_build(path, image_to_video=False),
            sampling={
                "guidance_scale": 5.0,
                "negative_prompt": WAN_NEGATIVE_PROMPT,
                "max_sequence_length": 512,
            },
            video=True,
            default_size=128,
        ),
        Family(
            name="wan-i2v",
            pipeline="WanImageToVideoPipeline",
            checkpoint=_WAN_CHECKPOINT
            + "; image branch: 2-layer CLIP vision encoder, width 64, 224 px, patch 14 (257 image tokens)",
            cfg=(
                f"guidance_scale 5, negative prompt {WAN_NEGATIVE_PROMPT!r}; input image size x size "
                "(a synthetic picture); text padded to 512 tokens (diffusers' I2V assumes it)"
            ),
            build=lambda path: _wan_build(path, image_to_video=True),
            sampling={
                "guidance_scale": 5.0,
                "negative_prompt": WAN_NEGATIVE_PROMPT,
                "max_sequence_length": 512,
            },
            image_input=True,
            video=True,
            default_size=128,
        ),
        Family(
            name="wan22-a14b",
            pipeline="WanPipeline",
            checkpoint=_WAN_CHECKPOINT.replace(
                "Wan 2.1 layout", "Wan 2.2 A14B layout (two experts, boundary 0.875)"
            ),
            cfg=f"guidance_scale 4 (high-noise expert), guidance_scale_2 3 (low-noise), negative prompt {WAN_NEGATIVE_PROMPT!r}",
            build=lambda path: _wan_build(path, image_to_video=False, variant="2.2-a14b"),
            sampling={
                "guidance_scale": 4.0,
                "guidance_scale_2": 3.0,
                "negative_prompt": WAN_NEGATIVE_PROMPT,
                "max_sequence_length": 512,
            },
            video=True,
            default_size=128,
        ),
        Family(
            name="wan22-ti2v",
            pipeline="WanPipeline",
            checkpoint=_WAN_CHECKPOINT.replace(
                "Wan 2.1 layout", "Wan 2.2 TI2V-5B layout (per-token timesteps)"
            )
            + "; Wan 2.2 VAE (z_dim 48, 16x spatial)",
            cfg=f"guidance_scale 5, negative prompt {WAN_NEGATIVE_PROMPT!r}",
            build=lambda path: _wan_build(path, image_to_video=False, variant="2.2-ti2v"),
            sampling={
                "guidance_scale": 5.0,
                "negative_prompt": WAN_NEGATIVE_PROMPT,
                "max_sequence_length": 512,
            },
            video=True,
            default_size=128,
        ),
        Family(
            name="hunyuan-video15",
            pipeline="HunyuanVideo15Pipeline",
            checkpoint=(
                "HunyuanVideo 1.5 layout, 3 blocks + 1 token-refiner block, 8x64 heads (width 512), RoPE "
                "(16, 24, 24), a 3-layer Qwen2.5-VL text model of width 256 and the ByT5 glyph encoder, "
                "VAE (32, 64, 128, 128, 128) with 32 latent channels (16x spatial, 4x temporal)"
            ),
            cfg="the folder's guider (ClassifierFreeGuidance, scale 6), negative prompt "
            f"{WAN_NEGATIVE_PROMPT!r}",
            build=_hunyuan_video15_build,
            sampling={"negative_prompt": WAN_NEGATIVE_PROMPT},
            video=True,
            default_size=128,
        ),
        Family(
            name="ltx2",
            pipeline="LTX2Pipeline",
            checkpoint=(
                "LTX-2 layout, 3 audio-video blocks, video 8x64 heads (width 512), audio 4x32 (width 128), "
                "a 2-layer Gemma-3 text model of width 256 with the text connectors, video VAE with 128 "
                "latent channels (32x spatial, 8x temporal), audio VAE and vocoder (24 kHz)"
            ),
            cfg="guidance_scale 3 with STG (scale 1, block 1) and modality guidance (3), rescale 0.7; "
            "audio guidance 7; negative prompt " + repr(WAN_NEGATIVE_PROMPT),
            build=_ltx2_build,
            sampling={"guidance_scale": 3.0, "negative_prompt": WAN_NEGATIVE_PROMPT},
            video=True,
            default_size=128,
            # diffusers' default STG block (28) is beyond this DiT's 3: both engines perturb block 1.
            diffserve_only={"extra": {"spatio_temporal_guidance_blocks": [1]}},
            diffusers_only={"spatio_temporal_guidance_blocks": [1]},
        ),
        Family(
            name="flux2",
            pipeline="Flux2Pipeline",
            checkpoint=(
                "FLUX.2-dev layout (shared modulation, SwiGLU, 4-axis RoPE (32, 32, 32, 32)), 2 double + "
                f"{FLUX2_SINGLE_LAYERS['dev']} single blocks, 4x128 heads (width 512), joint attention dim 384 "
                "(layers 10, 20, 30 of a 31-layer Mistral3 text stack of width 128, in BFL's system-message "
                f"chat, 512 tokens), weight noise {FLUX2_DIT_WEIGHT_NOISE}, FLUX.2 VAE (32, 64, 128, 128), "
                "32 latent channels"
            ),
            cfg="guidance_scale 4, embedded in the DiT (guidance-distilled: no negative branch)",
            build=lambda path: _flux2_build(path, "dev"),
            sampling={"guidance_scale": 4.0, "max_sequence_length": 512},
        ),
        Family(
            name="flux2-klein",
            pipeline="Flux2KleinPipeline",
            checkpoint=(
                f"FLUX.2 [klein] base layout, 2 double + {FLUX2_SINGLE_LAYERS['klein']} single blocks, 4x128 "
                "heads (width 512), no guidance embedding, joint attention dim 384 (layers 9, 18, 27 of a "
                f"28-layer Qwen3 of width 128, 512 tokens), weight noise {FLUX2_DIT_WEIGHT_NOISE}, FLUX.2 VAE "
                "(32, 64, 128, 128), 32 latent channels; is_distilled false"
            ),
            cfg="guidance_scale 4, CFG against the empty prompt (klein base; a step-distilled klein runs without)",
            build=lambda path: _flux2_build(path, "klein"),
            sampling={"guidance_scale": 4.0, "max_sequence_length": 512},
        ),
        Family(
            name="flux-kontext",
            pipeline="FluxKontextPipeline",
            checkpoint=(
                "FLUX.1 layout (bench_flux_vs_diffusers.py's checkpoint), 2 double + 4 single blocks, 8x64 "
                "heads, RoPE axes (16, 24, 24), guidance embedding, joint attention dim 256 (T5 width 256, 512 "
                "tokens), VAE (32, 64, 128, 128)"
            ),
            cfg=(
                "guidance_scale 3.5, embedded in the DiT (no negative branch); input image size x size (a "
                "synthetic picture)"
            ),
            build=_flux_kontext_build,
            sampling={"guidance_scale": 3.5, "max_sequence_length": 512},
            image_input=True,
        ),
        Family(
            name="sana",
            pipeline="SanaPipeline",
            checkpoint=(
                "SANA layout, 4 blocks of linear attention with 24x32 heads (width 768) and cross-attention "
                f"12x64, GLUMBConv mlp ratio 2.5, sample_size {SANA_SAMPLE_SIZE} (the 512 px bins), caption "
                "channels 256 (a 2-layer Gemma-2 of width 256, 300 tokens after the complex human "
                "instruction), DC-AE f32c32 (16, 32, 64, 128, 128, 128), flow DPM-Solver++ (flow_shift 3)"
            ),
            cfg=(
                "guidance_scale 4.5, default (empty) negative prompt, default complex human instruction; "
                "resolution binning on (default)"
            ),
            build=_sana_build,
            sampling={"guidance_scale": 4.5, "max_sequence_length": 300},
            default_size=SANA_SIZE,
        ),
        Family(
            name="cogvideox",
            pipeline="CogVideoXPipeline",
            checkpoint=(
                "CogVideoX 1.5 layout (RoPE over 2-frame temporal patches, no patch bias), 3 blocks, 8x64 heads "
                "(width 512), time embedding 512, text dim 256 (a 2-layer T5 encoder, 226 tokens), sample "
                f"size {COGVIDEOX_SAMPLE_SIZE}x{COGVIDEOX_SAMPLE_SIZE} latents (the RoPE grid), weight noise "
                f"{VIDEO_DIT_WEIGHT_NOISE}, CogVideoX VAE {COGVIDEOX_VAE_CHANNELS} with 16 latent channels "
                "(8x spatial, 4x temporal, invert_scale_latents), CogVideoX DPM (v-prediction)"
            ),
            cfg="guidance_scale 6 (static: use_dynamic_cfg off, the pipeline default), default (empty) "
            "negative prompt",
            build=_cogvideox_build,
            sampling={"guidance_scale": 6.0},
            video=True,
            default_size=128,
        ),
        Family(
            name="mochi",
            pipeline="MochiPipeline",
            checkpoint=(
                "Mochi 1 layout (asymmetric text stream, qk RMSNorm, SwiGLU), 3 blocks, 8x64 heads (width 512), "
                "text stream width 256, time embedding 256, text dim 256 (a 2-layer T5 encoder, 256 tokens), "
                f"weight noise {VIDEO_DIT_WEIGHT_NOISE}, Mochi VAE decoder {MOCHI_DECODER_CHANNELS} with 12 "
                "latent channels (8x spatial, 6x temporal), linear-quadratic flow-matching schedule"
            ),
            cfg="guidance_scale 4.5, default (empty) negative prompt; frames rounded down to 6k+1 "
            "(Mochi's 6x temporal VAE: 17 -> 13, 3 latent frames); 2 steps at least (its schedule)",
            build=_mochi_build,
            sampling={"guidance_scale": 4.5, "max_sequence_length": 256},
            video=True,
            default_size=128,
            frame_step=6,
            min_steps=2,
        ),
        Family(
            name="skyreels-v2",
            pipeline="SkyReelsV2Pipeline",
            checkpoint=_WAN_CHECKPOINT.replace(
                "Wan 2.1 layout", "SkyReels-V2 T2V layout (the Wan 2.1 DiT)"
            ).replace("UniPC (flow_shift 3)", "UniPC (flow_shift 8, the released T2V's)"),
            cfg=f"guidance_scale 6, negative prompt {WAN_NEGATIVE_PROMPT!r}",
            build=_skyreels_v2_build,
            sampling={
                "guidance_scale": 6.0,
                "negative_prompt": WAN_NEGATIVE_PROMPT,
                "max_sequence_length": 512,
            },
            video=True,
            default_size=128,
        ),
        Family(
            name="hunyuan-video",
            pipeline="HunyuanVideoPipeline",
            checkpoint=(
                "HunyuanVideo 1.0 T2V layout, 2 double + 2 single blocks + 1 token-refiner block, 8x64 heads "
                "(width 512), RoPE (16, 24, 24), guidance embedding, a 3-layer Llama of width 256 (the prompt "
                f"template's states) and a CLIP text model of width 64 (pooled), weight noise "
                f"{VIDEO_DIT_WEIGHT_NOISE}, VAE {HUNYUAN_VIDEO_VAE_CHANNELS} with 16 latent channels (8x "
                "spatial, 4x temporal)"
            ),
            cfg="guidance_scale 6, embedded in the DiT (guidance-distilled: true_cfg_scale 1, no negative "
            "branch), as both pipelines default",
            build=_hunyuan_video_build,
            sampling={"guidance_scale": 6.0},
            video=True,
            default_size=128,
        ),
        Family(
            name="hidream",
            pipeline="HiDreamImagePipeline",
            checkpoint=(
                "HiDream-I1 layout (MoE feed-forward: 4 routed experts, 2 active, and a shared one), 2 double + "
                "2 single blocks, 8x64 heads (width 512), RoPE axes (32, 16, 16), 8x8 patches, text from two "
                "CLIPs (width 64, 72), a T5 of width 256 and a 3-layer Llama of width 256 (its layers fed per "
                "block), weight noise 0.02, the builder's one-level VAE (16 latent channels, scale factor 1), "
                "HiDream-I1-Full's UniPC"
            ),
            cfg=(
                "guidance_scale 5, default (empty) negative prompt (HiDream-I1-Full). Both pipelines rescale "
                f"every request to the default area, {HIDREAM_SIZE}x{HIDREAM_SIZE} with this VAE (128x128 "
                "latents, 256 tokens), so it runs at that size and any --resolutions is generated as "
                f"{HIDREAM_SIZE}x{HIDREAM_SIZE} by both"
            ),
            build=_hidream_build,
            sampling={"guidance_scale": 5.0, "max_sequence_length": 128},
            default_size=HIDREAM_SIZE,
        ),
        Family(
            name="qwen-image21",
            pipeline="QwenImage21Pipeline",
            checkpoint=(
                "Qwen-Image 2.1 layout (causal condition, mlp ratio 3, 1x1 patches), 8 blocks, 8x64 heads "
                "(width 512), RoPE axes (8, 28, 28), context dim 256 (a 2-layer Qwen3-VL text model of width "
                "256), weight noise 0.02, 16x VAE base dim 32, mults (1, 2, 4, 4, 4), 64 latent channels"
            ),
            cfg="none: true_cfg_scale 1, the pipelines' default (the model is meant to run without CFG)",
            build=_qwen_image21_build,
            sampling={},
        ),
        Family(
            name="hunyuan-image",
            pipeline="HunyuanImagePipeline",
            checkpoint=(
                "HunyuanImage 2.1 layout, 2 double + 2 single blocks + 1 token-refiner block, 8x64 heads "
                "(width 512), RoPE (32, 32), 1x1 patches, a 3-layer Qwen2.5-VL text model of width 256 and a "
                "ByT5 glyph encoder of width 64, weight noise 0.05, 32x VAE (32, 64, 128, 128, 256, 256) with "
                f"64 latent channels; runs at {HUNYUAN_IMAGE_SIZE}x{HUNYUAN_IMAGE_SIZE} (16x16 latents, 256 "
                "tokens)"
            ),
            cfg="the folder's guiders (AdaptiveProjectedMixGuidance: CFG scale 3.5, APG from step 0; the OCR "
            "guider, scale 5, for quoted text), default (empty) negative prompt",
            build=_hunyuan_image_build,
            sampling={},
            default_size=HUNYUAN_IMAGE_SIZE,
        ),
        Family(
            name="chroma",
            pipeline="ChromaPipeline",
            checkpoint=(
                "Chroma layout (FLUX.1 without guidance or pooled text, the distilled-guidance approximator "
                "of 5 layers, 64 channels, width 512), 2 double + 4 single blocks, 8x64 heads (width 512), "
                "RoPE axes (16, 24, 24), joint attention dim 256 (a 2-layer T5 of width 256, 512 tokens "
                "with the attention mask), VAE (32, 64, 128, 128)"
            ),
            cfg="guidance_scale 5 (real CFG: two branches), default (empty) negative prompt, as both "
            "pipelines default",
            build=_chroma_build,
            sampling={"guidance_scale": 5.0, "max_sequence_length": 512},
        ),
        Family(
            name="longcat-image",
            pipeline="LongCatImagePipeline",
            checkpoint=(
                "LongCat-Image layout (FLUX.1-style, no guidance embedding), 2 double + 4 single blocks, 8x64 "
                "heads (width 512), RoPE axes (16, 24, 24), joint attention dim 256 (a 2-layer Qwen2.5-VL text "
                "encoder of width 256, 512 tokens), VAE (32, 64, 128, 128)"
            ),
            cfg="guidance_scale 4.5 with CFG renormalisation (cfg_renorm_min 0), default (empty) negative "
            "prompt, as both pipelines default; prompt rewriting off (diffusers' default is on, a generation by "
            "the text model; diffserve refuses it)",
            build=lambda path: _longcat_image_build(path, "t2i"),
            sampling={"guidance_scale": 4.5},
            diffusers_only={"enable_prompt_rewrite": False},
        ),
        Family(
            name="longcat-image-edit",
            pipeline="LongCatImageEditPipeline",
            checkpoint="the longcat-image checkpoint's shapes in the LongCatImageEditPipeline folder",
            cfg=(
                "guidance_scale 4.5, default (empty) negative prompt; input image size x size (a synthetic "
                "picture); both pipelines size the output (and the VAE's condition image) at about 1 MP from "
                "the input's aspect ratio: here at size x size pixels on both (diffusers' "
                "`calculate_dimensions` wrapped, diffserve's config `output_area`), the output's token count"
            ),
            build=lambda path: _longcat_image_build(path, "edit"),
            sampling={"guidance_scale": 4.5},
            image_input=True,
            sized_by_input=True,
        ),
        Family(
            name="qwen-image-layered",
            pipeline="QwenImageLayeredPipeline",
            checkpoint=_QWEN_CHECKPOINT.replace(
                "Qwen-Image layout",
                "Qwen-Image-Layered layout (layer-3D RoPE, additional timestep condition)",
            ).replace("causal-3D VAE", "RGBA causal-3D VAE")
            + ", Qwen2-VL processor",
            cfg=(
                f"true_cfg_scale 4, negative prompt ' '; {QWEN_LAYERED_LAYERS} layers (pipeline default 4); "
                "input image size x size RGBA (a synthetic opaque picture); the 640 bucket's area (its "
                "default) set to size x size on both (diffusers' `calculate_dimensions` wrapped, diffserve's "
                "config `resolution_areas`): the composite, the layers and the condition image each at "
                "size x size"
            ),
            build=_qwen_layered_build,
            sampling={"true_cfg_scale": 4.0, "negative_prompt": " ", "max_sequence_length": 512},
            image_input=True,
            sized_by_input=True,
            layers=QWEN_LAYERED_LAYERS,
            image_mode="RGBA",
            diffserve_only={"extra": {"layers": QWEN_LAYERED_LAYERS}},
            diffusers_only={"layers": QWEN_LAYERED_LAYERS},
        ),
        Family(
            name="sana-video",
            pipeline="SanaVideoPipeline",
            checkpoint=(
                "SANA-Video layout (linear attention with Wan's 3-axis RoPE, cross-attention, GLUMBConv mlp "
                "ratio 2.5), 4 blocks, 8x64 heads (width 512), cross-attention 8x64, caption channels 256 (a "
                "2-layer Gemma-2 of width 256, 300 tokens after the complex human instruction), weight noise "
                f"{VIDEO_DIT_WEIGHT_NOISE}, Wan 2.1 VAE base dim 32 (8x spatial, 4x temporal), flow "
                "DPM-Solver++ (flow_shift 8)"
            ),
            cfg=(
                "guidance_scale 6, default (empty) negative prompt, default complex human instruction, as both "
                "pipelines default; resolution binning off on both (the 480p bins would generate 624x624)"
            ),
            build=_sana_video_build,
            sampling={"guidance_scale": 6.0, "max_sequence_length": 300},
            video=True,
            default_size=128,
            diffserve_only={"extra": {"use_resolution_binning": False}},
            diffusers_only={"use_resolution_binning": False},
        ),
    )
}


# --------------------------------------------------------------------------------------------- worker


def edit_input_image(size: int):
    """A deterministic picture with structure (gradients plus 8-pixel blocks), so the VAE sees more than noise."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:size, 0:size]
    base = np.stack([x / size, y / size, (x + y) / (2 * size)], axis=-1) * 200
    blocks = rng.integers(0, 55, (size // 8 + 1, size // 8 + 1, 3)).repeat(8, 0).repeat(8, 1)[:size, :size]
    return Image.fromarray((base + blocks).astype(np.uint8))


def video_strip(frames):
    """One video, (frames, height, width, 3) uint8, as one PIL image: the frames stacked top to bottom.

    The harness saves and compares one lossless image per worker; the strip carries every pixel of every
    frame and nothing else, so its PSNR is the PSNR over the whole video.
    """
    import numpy as np
    from PIL import Image

    frames = np.asarray(frames)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"expected (frames, height, width, 3) uint8, got {frames.dtype} {frames.shape}")
    return Image.fromarray(frames.reshape(-1, *frames.shape[2:]))


def _generation_kwargs(args: argparse.Namespace, family: Family, size: int) -> dict:
    kwargs = dict(family.sampling, prompt=args.prompt, num_inference_steps=args.steps)
    if not family.sized_by_input:
        kwargs.update(height=size, width=size)
    if family.image_input:
        kwargs["image"] = edit_input_image(size).convert(family.image_mode)
    if family.video:
        kwargs["num_frames"] = family_frames(args, family)
    return kwargs


def family_frames(args: argparse.Namespace, family: Family) -> int:
    """`--num-frames` rounded down to the family's k * frame_step + 1 (the same for the 4x-temporal VAEs)."""
    return (args.num_frames - 1) // family.frame_step * family.frame_step + 1


def layer_strip(layers):
    """One decomposition, `layers` RGBA PIL images, as one RGB PIL image: per layer its RGB, then its alpha
    as grey, stacked top to bottom (the harness compares RGB images: this keeps every channel in the PSNR)."""
    import numpy as np
    from PIL import Image

    rows = []
    for layer in layers:
        rgba = np.asarray(layer.convert("RGBA"))
        rows += [rgba[..., :3], np.repeat(rgba[..., 3:], 3, axis=-1)]
    return Image.fromarray(np.concatenate(rows, axis=0))


def _size_rule_area(family: Family, size: int) -> int:
    """The pixel area a `sized_by_input` family's size rule resizes the input image to, on both engines:
    size * size (the real rules' ~1 MP areas would make each generation 16x the tokens at 256)."""
    if not family.sized_by_input:
        raise ValueError(f"{family.name}: the pipelines take height and width; no size rule to set")
    return size * size


def _diffserve_kwargs(args: argparse.Namespace, family: Family, size: int) -> dict:
    return {**_generation_kwargs(args, family, size), **family.diffserve_only}


def _run_diffserve(args: argparse.Namespace, family: Family, size: int, compiled: bool = False):
    start = time.perf_counter()
    from diffserve.api import DiffGenerator

    imported = time.perf_counter()
    if family.name == "qwen-image-edit" and args.edit_condition_area != REAL_EDIT_CONDITION_AREA:
        from diffserve.families.qwen_image import pipeline as qwen_image
        from diffserve.families.qwen_image.config import QwenImageEditPipelineConfig

        qwen_image.QwenImageEditPipeline.config = QwenImageEditPipelineConfig(
            condition_image_area=args.edit_condition_area
        )
    if family.name == "flux-kontext" and not args.kontext_auto_resize:
        from diffserve.families.flux import kontext_pipeline as flux_kontext
        from diffserve.families.flux.config import FluxKontextPipelineConfig

        flux_kontext.FluxKontextPipeline.config = FluxKontextPipelineConfig(auto_resize=False)
    if family.name == "longcat-image-edit":
        from dataclasses import replace

        from diffserve.families.longcat_image import pipeline as longcat_image

        edit = longcat_image.LongCatImageEditPipeline
        edit.config = replace(edit.config, output_area=_size_rule_area(family, size))
    if family.name == "qwen-image-layered":
        from diffserve.families.qwen_image import layered

        area = _size_rule_area(family, size)
        layered.QwenImageLayeredPipeline.config = layered.QwenImageLayeredPipelineConfig(
            resolution_areas=((640, area), (1024, area))
        )
    # compile=True compiles the DiT's blocks and warms up (two short generations) in here: timed as load.
    generator = DiffGenerator.from_pretrained(
        args.model_dir / family.name, device="cpu", dtype="float32", show_progress=False, compile=compiled
    )
    load = {"import_s": imported - start, "from_pretrained_s": time.perf_counter() - imported}
    counter = harness.ForwardCounter(generator.pipeline.context.get("transformer"))
    kwargs = _diffserve_kwargs(args, family, size)

    def generate():
        out = generator.generate(seed=args.seed, **kwargs)
        if family.video:
            image = video_strip(out.frames[0])
        elif family.layers:  # a flat list: `layers` images per output
            image = layer_strip(out.images[: family.layers])
        else:
            image = out.images[0]
        return image, list(out.step_times)

    return load, generate, counter


def diffusers_compile_form(folder: Path) -> tuple[str, tuple[str, ...]]:
    """How `diffusers-compiled` compiles this checkpoint's DiT: ("regional", its block classes) when the
    diffusers class declares `_repeated_blocks` (then `compile_repeated_blocks()`, diffusers' own
    recommendation), else ("full", ()) for `torch.compile(transformer)`. Read from the folder's
    config, so the parent can name the form even when the worker fails."""
    import diffusers

    class_name = json.loads((folder / "transformer" / "config.json").read_text())["_class_name"]
    blocks = tuple(getattr(getattr(diffusers, class_name), "_repeated_blocks", None) or ())
    return ("regional", blocks) if blocks else ("full", ())


def _load_diffusers(args: argparse.Namespace, family: Family, size: int, compiled: str | None = None):
    """diffusers' pipeline for the family, and its load times (imports, from_pretrained, compile setup).

    `compiled` "default" applies `diffusers_compile_form`, "full" `torch.compile(pipe.transformer)` (the
    whole transformer), both with torch.compile's defaults; compilation itself happens lazily, in the
    first generation.
    """
    import torch

    start = time.perf_counter()
    import diffusers
    from diffusers.utils import logging as diffusers_logging

    pipeline_class = getattr(diffusers, family.pipeline)
    imported = time.perf_counter()
    diffusers_logging.set_verbosity_error()
    folder = args.model_dir / family.name
    extra = {}
    if family.name == "qwen-image-edit":
        import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit as diffusers_edit

        from diffserve.families.qwen_image.tiny import load_qwen_vl_processor

        # diffusers cannot build the processor's video half without torchvision: hand it the image-only one.
        extra["processor"] = load_qwen_vl_processor(folder / "processor")
        if args.edit_condition_area != REAL_EDIT_CONDITION_AREA:
            full_area = diffusers_edit.calculate_dimensions
            area = args.edit_condition_area
            diffusers_edit.calculate_dimensions = lambda target_area, ratio: full_area(area, ratio)
    if family.name in ("longcat-image", "longcat-image-edit"):
        from diffserve.testing.qwen_processors import load_qwen_vl_processor

        # As tests/e2e/test_longcat_image_pipeline_parity.py: the image-only processor (transformers builds
        # the video half only with torchvision).
        extra["text_processor"] = load_qwen_vl_processor(folder / "text_processor")
    if family.name == "longcat-image-edit":
        import diffusers.pipelines.longcat_image.pipeline_longcat_image_edit as diffusers_longcat_edit

        _wrap_size_rule(diffusers_longcat_edit, _size_rule_area(family, size))
    if family.name == "qwen-image-layered":
        import diffusers.pipelines.qwenimage.pipeline_qwenimage_layered as diffusers_layered

        from diffserve.families.qwen_image.tiny import load_qwen_vl_processor

        extra["processor"] = load_qwen_vl_processor(folder / "processor")
        _wrap_size_rule(diffusers_layered, _size_rule_area(family, size))
    if family.name == "qwen-image21":
        from diffserve.loader.processors import load_image_text_processor

        # transformers builds a Qwen3-VL processor only with torchvision: hand diffusers the one diffserve
        # loads, with the folder's chat template (as tests/e2e/test_qwen_image21_pipeline_parity.py does).
        processor = load_image_text_processor("Qwen3VLProcessor", folder / "processor")
        processor.chat_template = (folder / "processor" / "chat_template.jinja").read_text()
        extra["processor"] = processor
    if family.name == "flux2":
        pipe = _diffusers_flux2_dev(folder)
    else:
        pipe = pipeline_class.from_pretrained(folder, torch_dtype=torch.float32, **extra)
    pipe.to("cpu")
    if compiled:
        form = "full" if compiled == "full" else diffusers_compile_form(folder)[0]
        if form == "regional":
            pipe.transformer.compile_repeated_blocks()
        else:
            # The step timer's and the counter's hooks go on the OptimizedModule: they run eagerly around it.
            pipe.transformer = torch.compile(pipe.transformer)
    load = {"import_s": imported - start, "from_pretrained_s": time.perf_counter() - imported}
    pipe.set_progress_bar_config(disable=True)  # diffserve runs with its progress bar off too
    return pipe, load


def _wrap_size_rule(module, area: int) -> None:
    """Make a diffusers pipeline module's `calculate_dimensions(target_area, ratio)` use `area` whatever
    area the pipeline asks for (its aspect rule and rounding unchanged), as diffserve's config is set."""
    full_area = module.calculate_dimensions
    module.calculate_dimensions = lambda target_area, ratio: full_area(area, ratio)


def _diffusers_flux2_dev(folder: Path):
    """diffusers' Flux2Pipeline built from its components, as tests/e2e/test_flux2_pipeline_parity.py does:
    `from_pretrained` would construct the folder's PixtralProcessor, which needs torchvision. The pipeline
    only calls the processor's `apply_chat_template`, which the folder's tokenizer (loaded as diffserve
    loads it) carries; the components load in fp32, as `torch_dtype=torch.float32` gives the others."""
    import torch
    from diffusers import (
        AutoencoderKLFlux2,
        FlowMatchEulerDiscreteScheduler,
        Flux2Pipeline,
        Flux2Transformer2DModel,
    )
    from transformers import Mistral3ForConditionalGeneration

    from diffserve.loader.processors import load_processor_tokenizer

    return Flux2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(folder, subfolder="scheduler"),
        vae=AutoencoderKLFlux2.from_pretrained(folder, subfolder="vae", torch_dtype=torch.float32),
        text_encoder=Mistral3ForConditionalGeneration.from_pretrained(
            folder / "text_encoder", dtype=torch.float32
        ),
        tokenizer=load_processor_tokenizer(folder / "tokenizer"),
        transformer=Flux2Transformer2DModel.from_pretrained(
            folder, subfolder="transformer", torch_dtype=torch.float32
        ),
    )


def _diffusers_kwargs(args: argparse.Namespace, family: Family, size: int) -> dict:
    """`_generation_kwargs` plus what only diffusers' Kontext pipeline needs to do what diffserve does:
    it rescales a given output size to `max_area` (1024 * 1024 by default; diffserve keeps a given size),
    so it gets `max_area=size * size`; and `_auto_resize` as diffserve's config (see `--kontext-auto-resize`)."""
    kwargs = {**_generation_kwargs(args, family, size), **family.diffusers_only}
    if family.name == "flux-kontext":
        kwargs.update(max_area=size * size, _auto_resize=args.kontext_auto_resize)
    if family.name == "sana-video":  # diffusers' SanaVideoPipeline calls the frame count `frames`
        kwargs["frames"] = kwargs.pop("num_frames")
    return kwargs


def _run_diffusers(args: argparse.Namespace, family: Family, size: int, compiled: str | None = None):
    import torch

    pipe, load = _load_diffusers(args, family, size, compiled)
    counter = harness.ForwardCounter(pipe.transformer)
    second = getattr(pipe, "transformer_2", None)  # Wan 2.2 A14B's low-noise expert
    timer = harness.DiffusersStepTimer(pipe.transformer, *([second] if second is not None else []))
    kwargs = _diffusers_kwargs(args, family, size)
    if "callback_on_step_end" in inspect.signature(pipe.__call__).parameters:
        kwargs["callback_on_step_end"] = timer.on_step_end
    else:  # HunyuanVideo 1.5 has no step callback: a step ends with its scheduler step
        scheduler_step = pipe.scheduler.step

        def timed_step(*step_args, **step_kwargs):
            out = scheduler_step(*step_args, **step_kwargs)
            timer.on_step_end(pipe, 0, None, {})
            return out

        pipe.scheduler.step = timed_step

    first_call = [compiled is not None]

    def generate():
        timer.reset()
        breaks_before = _graph_breaks()
        output = pipe(
            generator=torch.Generator("cpu").manual_seed(args.seed),
            output_type="np" if family.video else "pil",
            **kwargs,
        )
        if first_call[0]:  # where diffusers compiles: say whether its graph stayed whole
            first_call[0] = False
            print(
                f"  diffusers {compiled} compile: {_graph_breaks() - breaks_before} graph break(s) in its first call",
                file=sys.stderr,
            )
        if family.video:  # floats in [0, 1], (batch, frames, height, width, 3)
            image = video_strip((output.frames[0] * 255).round().astype("uint8"))
        elif family.layers:  # one list of RGBA layers per image
            image = layer_strip(output.images[0])
        else:
            image = output.images[0]
        return image, timer.step_times(args.steps)

    return load, generate, counter


def _graph_breaks() -> int:
    """Graph breaks dynamo has recorded in this process so far."""
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


RUNNERS = {
    "diffserve": _run_diffserve,
    "diffserve-compiled": partial(_run_diffserve, compiled=True),
    "diffusers": _run_diffusers,
    "diffusers-compiled": partial(_run_diffusers, compiled="default"),
    "diffusers-compiled-full": partial(_run_diffusers, compiled="full"),
}


class DitFlopMeter:
    """Counts the work of every call of diffusers' DiT: torch's FLOP counter plus the SDPA calls.

    It shadows the module's `forward` (as `harness.ForwardCounter` does), so what is counted is the
    DiT calls the pipeline really makes, with the inputs it really builds (CFG as one batched forward
    or two, text lengths, Wan's 3D tokens and cross-attention, the edit model's condition tokens),
    without rebuilding every family's inputs by hand. The counter does not see attention on CPU, so
    each SDPA call's (batch, heads, q_len, kv_len, head_dim) is recorded (roofline.py's recorder).
    """

    def __init__(self, module: Any) -> None:
        self._forward = module.forward
        module.forward = self
        self._recorder_class = roofline._sdpa_recorder_class()
        self.calls = 0
        self.by_op: Counter[str] = Counter()
        self.sdpa_calls: list[tuple[int, int, int, int, int]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from torch.utils.flop_counter import FlopCounterMode

        counter, recorder = FlopCounterMode(display=False), self._recorder_class()
        with counter, recorder:
            out = self._forward(*args, **kwargs)
        for op, flops in counter.get_flop_counts().get("Global", {}).items():
            self.by_op[str(op)] += int(flops)
        self.sdpa_calls += recorder.calls
        self.calls += 1
        return out

    def summary(self, steps: int) -> dict:
        """Per denoising step: FLOPs (linear = every counted op but attention; attention from the SDPA
        calls, 4 x batch x heads x q_len x kv_len x head_dim each), the attention calls by shape, and the
        matmul shape the rate probe uses (M = the rows of one step's DiT work, K = the attention width)."""
        if not self.sdpa_calls:
            raise RuntimeError(
                "no SDPA call recorded in diffusers' DiT: its attention FLOPs cannot be counted"
            )
        linear = sum(
            n for op, n in self.by_op.items() if "attention" not in op and "scaled_dot_product" not in op
        )
        attention = sum(roofline.attention_flops(*call) for call in self.sdpa_calls)
        batch, heads, q_len, _kv_len, head_dim = max(self.sdpa_calls, key=lambda c: c[0] * c[2])
        return {
            "dit_calls_per_step": self.calls / steps,
            "linear_flops": linear // steps,
            "attention_flops": attention // steps,
            "step_flops": (linear + attention) // steps,
            "attention_calls_per_step": len(self.sdpa_calls) / steps,
            "attention_shapes": {
                "x".join(map(str, shape)): count for shape, count in Counter(self.sdpa_calls).items()
            },
            "counter_by_op": dict(self.by_op),
            # diffserve batches the CFG branches: M covers every forward of the step, as its one forward does.
            "probe_rows": batch * q_len * self.calls // steps,
            "probe_dim": heads * head_dim,
        }


def count_step_flops(args: argparse.Namespace, family: Family, size: int) -> None:
    """The `flop-count` worker: one 1-step generation (`Family.min_steps`: Mochi's 2) of eager diffusers
    under `DitFlopMeter`; prints the per-step work after `harness.RESULT_MARKER`. Every step of these
    schedulers runs the same DiT shapes, so one step is the work of each."""
    import torch

    pipe, _load = _load_diffusers(args, family, size)
    # FlopCounterMode's module tracker puts grad hooks on module inputs that require grad; SANA's DiT passes
    # its `scale_shift_table` parameter to a sub-module, which under inference_mode has no grad_fn to hook.
    pipe.transformer.requires_grad_(False)
    meter = DitFlopMeter(pipe.transformer)
    steps = family.min_steps
    kwargs = dict(_diffusers_kwargs(args, family, size), num_inference_steps=steps)
    # The meter counts the DiT's calls only, so decoding costs time but no counted work: "latent" skips it,
    # except for Qwen-Image-Layered, whose diffusers pipeline fills its output only when it decodes
    # (diffusers 0.42.1: output_type "latent" ends in an UnboundLocalError).
    output_type = "np" if family.layers else "latent"
    with torch.inference_mode():
        pipe(generator=torch.Generator("cpu").manual_seed(args.seed), output_type=output_type, **kwargs)
    result = {"engine": FLOP_COUNT, "resolution": size, **meter.summary(steps=steps)}
    print(harness.RESULT_MARKER + json.dumps(result), flush=True)


def worker(args: argparse.Namespace, family: Family, engine: str, size: int) -> None:
    # Shared dependencies are imported before the clock starts; each engine's own imports (and the
    # libraries only it pulls in) count towards its load time: a cold start, as a user sees it.
    import numpy  # noqa: F401
    import PIL.Image  # noqa: F401
    import torch  # noqa: F401

    if engine == FLOP_COUNT:
        count_step_flops(args, family, size)
        return
    load, generate, counter = RUNNERS[engine](args, family, size)
    harness.run_timed_generations(
        engine, size, load, generate, args.repeats, args.image_out, dit_counter=counter,
        after_warmup=harness.stop_compile_workers if engine in COMPILED_ENGINES else None,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------- parent


def prepare_checkpoint(family: Family, model_dir: Path) -> None:
    folder = model_dir / family.name
    if (folder / "model_index.json").exists():
        print(f"Reusing checkpoint at {folder}", file=sys.stderr)
        return
    print(f"Building {family.name} checkpoint at {folder} ...", file=sys.stderr)
    start = time.perf_counter()
    family.build(folder)
    print(f"  built in {time.perf_counter() - start:.1f} s", file=sys.stderr)


def worker_command(
    args: argparse.Namespace, family: Family, engine: str, size: int, image_out: Path
) -> list[str]:
    return [
        sys.executable, os.path.abspath(__file__), "--family", family.name, "--worker", engine, str(size),
        "--model-dir", str(args.model_dir), "--steps", str(args.steps), "--repeats", str(args.repeats),
        "--seed", str(args.seed), "--prompt", args.prompt,
        "--edit-condition-area", str(args.edit_condition_area), "--num-frames", str(args.num_frames),
        "--image-out", str(image_out), *(["--kontext-auto-resize"] if args.kontext_auto_resize else []),
    ]  # fmt: skip


def _calls(row: dict) -> str:
    return f"{row['dit_calls_per_step']:g}"


DIT_CALLS_COLUMN = harness.Column(
    title="DiT calls/step",
    cell=_calls,
    ratio_cell=lambda ours, ref: f"{_calls(ours)} vs {_calls(ref)}",
)


def family_sizes(args: argparse.Namespace, family: Family) -> list[int]:
    """The sizes a family is measured at: `--resolutions` when given, else the family's default."""
    return args.sizes if args.resolutions_given else [family.default_size]


def render_family(family: Family, info: dict, dit_params: int, args: argparse.Namespace, rows, parity) -> str:
    sizes = family_sizes(args, family)
    table, notes = harness.results_table(sizes, rows, parity, columns=(DIT_CALLS_COLUMN,))
    out = [
        f"## {family.name}: diffserve vs diffusers {family.pipeline}",
        "",
        *family_setting_lines(family, dit_params, args),
        "",
        *table,
        *harness.contention_lines(sizes, rows, info["torch_threads"]),
        "",
        "Raw timings:",
        *notes,
        "",
    ]
    return "\n".join(out)


def family_setting_lines(family: Family, dit_params: int, args: argparse.Namespace) -> list[str]:
    """The bullet list under a family's heading: checkpoint, CFG, and the video / edit settings."""
    out = [
        f"- checkpoint: DiT {dit_params:,} parameters; {family.checkpoint}",
        f"- CFG: {family.cfg}",
    ]
    if family.video:
        out.append(
            f"- video: {family_frames(args, family)} frames per generation (resolution below is per frame); PSNR over "
            "all frames, uint8 (diffusers' float frames as (x * 255).round())"
        )
    if family.name == "qwen-image-edit":
        area = args.edit_condition_area
        side = f"{area**0.5:.0f}x{area**0.5:.0f}" if int(area**0.5) ** 2 == area else f"{area:,} pixels"
        if area == REAL_EDIT_CONDITION_AREA:
            out.append(f"- edit condition area: {side} (the real behaviour, diffusers' hard-coded value)")
        else:
            out.append(
                f"- edit condition area REDUCED to {side} on both engines (real: 1024x1024, which takes over "
                "a minute per 256x256 generation on 2 cores; diffusers' calculate_dimensions wrapped, "
                "diffserve's QwenImageEditPipeline.config set; --edit-condition-area 1048576 for the real one)"
            )
    if family.name == "flux-kontext":
        if args.kontext_auto_resize:
            out.append(
                "- input image auto-resized to its nearest Kontext training resolution (the real behaviour: "
                "1024x1024 for a square input); diffusers called with max_area = size * size"
            )
        else:
            out.append(
                "- input image KEPT at size x size on both engines (real: auto-resized to 1024x1024, 4096 "
                "condition tokens; diffusers `_auto_resize=False`, diffserve's FluxKontextPipeline.config "
                "auto_resize=False; --kontext-auto-resize for the real one); diffusers called with "
                "max_area = size * size, since it rescales a given output size to max_area (1024 * 1024)"
            )
    if family.name == "sana":
        out.append(
            f"- resolution binning (both engines' default): a square request is generated at "
            f"{SANA_SIZE}x{SANA_SIZE} (the 512 px bins' 1:1 entry; {SANA_SIZE // 32}x{SANA_SIZE // 32} latents) "
            "and resized back to size x size, so sizes other than 512 cost the same and are measured as 512"
        )
    return out


def render_summary(args: argparse.Namespace, results: dict[str, dict]) -> str:
    out = [
        "## Summary (diffusers / diffserve)",
        "",
        "| family | resolution | s/step | end-to-end | load | peak RSS | DiT calls/step (diffserve vs diffusers) "
        "| PSNR dB |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, res in results.items():
        frames = f" x {family_frames(args, FAMILIES[name])} frames" if FAMILIES[name].video else ""
        for size in family_sizes(args, FAMILIES[name]):
            ours, ref = res["rows"][size]["diffserve"], res["rows"][size]["diffusers"]
            out.append(
                f"| {name} | {size}x{size}{frames} | **{ref['s_per_step'] / ours['s_per_step']:.2f}x** "
                f"| **{ref['e2e_mean_s'] / ours['e2e_mean_s']:.2f}x** | {ref['load_s'] / ours['load_s']:.2f}x "
                f"| {ref['peak_rss_mb'] / ours['peak_rss_mb']:.2f}x | {_calls(ours)} vs {_calls(ref)} "
                f"| {harness.psnr_cell(res['parity'][size])} |"
            )
    out += [
        "",
        harness.legend(),
        "DiT calls/step counts the transformer forwards of one denoising step (timed runs): 1 means the "
        "CFG branches share one batched forward, 2 that they run one after the other.",
    ]
    return "\n".join(out)


# ------------------------------------------------------------------------------------------- --compile


def measure_compiled(args: argparse.Namespace, family: Family, image_dir: Path) -> dict[int, dict]:
    """`--compile`, per size: count one step's DiT FLOPs (a `flop-count` worker), then run the four
    engines' workers (order rotating per round) with the matmul rate sampled before and after each
    round; a compiled engine that fails is reported, not fatal. `{size: {"rows", "work", "matmul_rate"}}`.
    """
    import torch

    def command(engine: str, size: int, image_out: Path) -> list[str]:
        return worker_command(args, family, engine, size, image_out)

    tag = f"{family.name} "
    measured = {}
    for size in family_sizes(args, family):
        unused_image = image_dir / f"{family.name}_{FLOP_COUNT}_{size}.png"  # the FLOP worker saves none
        work = harness.run_worker(
            command(FLOP_COUNT, size, unused_image), FLOP_COUNT, size, args.worker_timeout, tag
        )
        probe = roofline.MatmulProbe(
            roofline.dit_matmul_shapes(work["probe_rows"], work["probe_dim"]),
            torch.float32, torch.device("cpu"), args.mm_warmup,
        )  # fmt: skip
        probe.sample(args.mm_repeats)
        rows = harness.run_engines(
            size, args.rounds, command, image_dir, args.worker_timeout,
            engines=COMPILE_ENGINES, rotate=True, may_fail=COMPILED_ENGINES,
            after_round=lambda probe=probe: probe.sample(args.mm_repeats), tag=tag, image_prefix=f"{family.name}_",
        )  # fmt: skip
        rate = probe.summary()
        for row in rows.values():
            if "error" in row:
                continue
            row["pct_of_matmul_rate"] = (
                100.0 * work["step_flops"] / row["s_per_step"] / 1e9 / rate["best_gflops"]
            )
            if row["engine"] != "diffusers" and "error" not in rows["diffusers"]:
                row["psnr_vs_diffusers_db"] = harness.image_psnr(row["image"], rows["diffusers"]["image"])
        measured[size] = {"rows": rows, "work": work, "matmul_rate": rate}
    return measured


def compile_form_line(family: Family, args: argparse.Namespace) -> str:
    form, blocks = diffusers_compile_form(args.model_dir / family.name)
    if form == "regional":
        how = f"`pipe.transformer.compile_repeated_blocks()` (regional: every {', '.join(blocks)})"
    else:
        how = (
            f"`pipe.transformer = torch.compile(pipe.transformer)` (whole DiT: diffusers' "
            f"{family.pipeline} transformer declares no `_repeated_blocks`)"
        )
    return (
        f'- diffusers-compiled: {how}, torch.compile defaults; compiles in its first call ("first call s")\n'
        "- diffusers-compiled-full: `pipe.transformer = torch.compile(pipe.transformer)` (the whole "
        "transformer; its worker prints the graph breaks of the first call), torch.compile defaults"
    )


def _ratio(
    rows: dict[str, dict], numerator: str, denominator: str, value: Callable[[dict], float | None]
) -> str:
    """`value(numerator row) / value(denominator row)` as '1.23x'; '-' when either engine failed."""
    a, b = rows[numerator], rows[denominator]
    if "error" in a or "error" in b:
        return "-"
    x, y = value(a), value(b)
    return "-" if x is None or y is None else f"{x / y:.2f}x"


def _engine_row(res: str, r: dict) -> str:
    if "error" in r:
        return f"| {res} | {r['engine']} | **FAILED** (see below) |" + " - |" * 8
    psnr = r.get("psnr_vs_diffusers_db")
    psnr_cell = (
        "reference" if r["engine"] == "diffusers" else "-" if psnr is None else harness.psnr_cell(psnr)
    )
    return (
        f"| {res} | {r['engine']} | {r['load_s']:.2f} | {harness.first_call_cell(r)} | {harness.ready_cell(r)} "
        f"| {r['s_per_step']:.3f} | {r['e2e_mean_s']:.2f} | {r['peak_rss_mb']:.0f} | {r['pct_of_matmul_rate']:.1f}% "
        f"| {_calls(r)} | {psnr_cell} |"
    )


def _ratio_row(res: str, rows: dict[str, dict], label: str, numerator: str, denominator: str) -> str:
    a, b = rows[numerator], rows[denominator]
    calls = "-" if "error" in a or "error" in b else f"{_calls(b)} vs {_calls(a)}"
    return (
        f"| {res} | **{label}** | {_ratio(rows, numerator, denominator, lambda r: r['load_s'])} | "
        f"| {_ratio(rows, numerator, denominator, harness.ready_s)} "
        f"| **{_ratio(rows, numerator, denominator, lambda r: r['s_per_step'])}** "
        f"| **{_ratio(rows, numerator, denominator, lambda r: r['e2e_mean_s'])}** "
        f"| {_ratio(rows, numerator, denominator, lambda r: r['peak_rss_mb'])} | | {calls} | |"
    )


def _work_line(res: str, size_result: dict) -> str:
    w, rate = size_result["work"], size_result["matmul_rate"]
    shapes = ", ".join(f"{count} x {shape}" for shape, count in w["attention_shapes"].items())
    return (
        f"- {res} step work (diffusers' DiT, one step): {w['step_flops'] / 1e9:.2f} GFLOP = linear "
        f"{w['linear_flops'] / 1e9:.2f} + attention {w['attention_flops'] / 1e9:.2f} over "
        f"{w['attention_calls_per_step']:g} SDPA calls in {w['dit_calls_per_step']:g} DiT forward(s) (batch x heads x "
        f"q x kv x head_dim: {shapes}); matmul rate best {rate['best_gflops']:.1f} GFLOP/s (median "
        f"{rate['median_gflops']:.1f}) on M = {w['probe_rows']}, K = {w['probe_dim']} shapes"
    )


def render_compiled_family(
    family: Family, info: dict, dit_params: int, args: argparse.Namespace, measured: dict[int, dict]
) -> str:
    sizes = family_sizes(args, family)
    out = [
        f"## {family.name}: diffserve vs diffusers {family.pipeline}, eager and compiled",
        "",
        *family_setting_lines(family, dit_params, args),
        "- diffserve-compiled: `DiffGenerator.from_pretrained(path, compile=True)` (regional inductor compile of "
        'the DiT\'s block lists, dynamic shapes), compiled and warmed up inside from_pretrained ("load s")',
        compile_form_line(family, args),
        "",
        "| resolution | engine | load s | first call s | load + first call s | s/step | end-to-end s | peak RSS MB "
        "| % of matmul rate | DiT calls/step | PSNR vs diffusers dB |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    notes = []
    for size in sizes:
        res, rows = f"{size}x{size}", measured[size]["rows"]
        out += [_engine_row(res, rows[e]) for e in COMPILE_ENGINES]
        out += [_ratio_row(res, rows, *ratio) for ratio in RATIOS]
        notes.append(_work_line(res, measured[size]))
        for r in rows.values():
            if "error" in r:
                notes.append(f"- {res} {r['engine']} FAILED: {r['error']}")
            else:
                notes += harness.raw_timing_notes(res, r)
    rows_by_size = {size: measured[size]["rows"] for size in sizes}
    out += [
        *harness.contention_lines(sizes, rows_by_size, info["torch_threads"]),
        "",
        "Raw timings:",
        *notes,
        "",
    ]
    return "\n".join(out)


def render_compiled_summary(args: argparse.Namespace, results: dict[str, dict]) -> str:
    titles = " | ".join(label for label, _n, _d in RATIOS)
    out = [
        "## Summary, eager and compiled (diffusers time / diffserve time: > 1 means diffserve is faster)",
        "",
        f"| family | resolution | diffusers compile | s/step: {titles} | end-to-end: {titles} "
        "| % of matmul rate, compiled: diffserve vs diffusers | load + first call s, compiled: diffserve vs diffusers |",
        "|---|---|---|" + "---:|" * (2 * len(RATIOS) + 2),
    ]
    for name, res in results.items():
        family = FAMILIES[name]
        frames = f" x {family_frames(args, family)} frames" if family.video else ""
        form = diffusers_compile_form(args.model_dir / name)[0]
        for size in family_sizes(args, family):
            rows = res["measured"][size]["rows"]
            steps = [_ratio(rows, n, d, lambda r: r["s_per_step"]) for _l, n, d in RATIOS]
            e2e = [_ratio(rows, n, d, lambda r: r["e2e_mean_s"]) for _l, n, d in RATIOS]
            ours, ref = rows["diffserve-compiled"], rows["diffusers-compiled"]
            pct = " vs ".join(
                "FAILED" if "error" in r else f"{r['pct_of_matmul_rate']:.1f}%" for r in (ours, ref)
            )
            ready = " vs ".join("FAILED" if "error" in r else harness.ready_cell(r) for r in (ours, ref))
            out.append(
                f"| {name} | {size}x{size}{frames} | {form} | "
                + " | ".join(f"**{c}**" for c in steps)
                + " | "
                + " | ".join(e2e)
                + f" | {pct} | {ready} |"
            )
    out += ["", compiled_legend()]
    return "\n".join(out)


def compiled_legend() -> str:
    return (
        "Engines: `diffserve` and `diffusers` eager; `diffserve-compiled` (`compile=True`: compiles and warms up "
        'inside from_pretrained, so its compile cost is in "load s"); `diffusers-compiled` (regional '
        "`compile_repeated_blocks()` where diffusers' DiT class declares `_repeated_blocks`, else "
        '`torch.compile(transformer)`; it compiles in the worker\'s first, uncounted generation, "first call s"); '
        "`diffusers-compiled-full` (`torch.compile(transformer)`, the whole transformer, for every family). "
        '"load + first call s" is the time to a first image, compilation included for every engine. Each ratio '
        "is the named diffusers engine's time over the named diffserve engine's time (load, s/step, end-to-end; "
        "RSS: memory): > 1 means diffserve is faster or smaller. % of matmul rate = one step's FLOPs / s per step / "
        "the best torch.mm GFLOP/s this machine showed on the DiT's shapes (measured around each size's "
        "workers). The step's FLOPs are counted on eager diffusers' DiT as its pipeline calls it in one "
        "step: torch's FLOP counter for the linear layers (and patch-embedding convolutions), attention "
        "from every SDPA call the DiT made (4 x batch x heads x q_len x kv_len x head_dim each; this covers "
        "joint attention, Wan's 3D self-attention and its text and image cross-attention); elementwise work "
        "(norms, RoPE, modulation, activations) costs time but no matmul FLOPs, so 100% is out of reach. "
        "The same FLOPs divide every engine's time (diffserve's batched CFG does the same work), so the "
        "percentages compare as the speeds do. PSNR compares each engine's image with eager diffusers' (same "
        f"seed, bar {harness.PSNR_BAR_DB:g} dB). DiT calls/step in a ratio row: diffserve's vs diffusers'. "
        "A compiled engine whose worker failed shows FAILED with its "
        'error under "Raw timings".'
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--family",
        default="all",
        help=f"comma-separated families out of {', '.join(FAMILIES)}, or 'all' (default: all, in that order)",
    )
    harness.add_run_args(
        p,
        f"{DEFAULT_SIZE}; the video families 128, SANA and HunyuanImage {SANA_SIZE}, HiDream {HIDREAM_SIZE}",
        "parent folder of the checkpoints, one sub-folder per family (built there if missing); "
        "default: a temporary folder",
    )
    p.add_argument(
        "--edit-condition-area",
        type=int,
        default=DEFAULT_EDIT_CONDITION_AREA,
        help="pixels qwen-image-edit resizes its input image to, on both engines (default: "
        f"{DEFAULT_EDIT_CONDITION_AREA}; diffusers hard-codes {REAL_EDIT_CONDITION_AREA}, the real behaviour)",
    )
    p.add_argument(
        "--kontext-auto-resize",
        action="store_true",
        help="flux-kontext: resize the input image to its nearest ~1 MP Kontext training resolution on both "
        "engines (the real default, 1024x1024 for a square input: 4096 condition tokens); default: keep it "
        "at size x size",
    )
    p.add_argument(
        "--num-frames",
        type=int,
        default=DEFAULT_NUM_FRAMES,
        help=f"frames per video of the video families, 4k+1 (Mochi rounds it down to 6k+1; default: {DEFAULT_NUM_FRAMES})",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="also run diffserve-compiled and diffusers-compiled, count each step's FLOPs and report "
        "%% of this machine's matmul rate (see the module docstring)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 2 steps, 1 timed run, 1 round; families "
        f"{', '.join(QUICK_FAMILIES)} unless --family is given",
    )
    p.add_argument(
        "--mm-repeats", type=int, default=10, help="--compile: timed torch.mm calls per shape per sample"
    )
    p.add_argument(
        "--mm-warmup", type=int, default=3, help="--compile: untimed torch.mm calls per shape first"
    )
    harness.add_output_args(p)
    p.set_defaults(resolutions=None)  # absent: each family's own default size (`Family.default_size`)
    family_given = any(a == "--family" or a.startswith("--family=") for a in (argv or sys.argv[1:]))
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.repeats, args.rounds = 2, 1, 1
        if not family_given:
            args.family = ",".join(QUICK_FAMILIES)
    args.resolutions_given = args.resolutions is not None
    if not args.resolutions_given:
        args.resolutions = str(DEFAULT_SIZE)
    harness.check_run_args(p, args)
    names = (
        list(FAMILIES) if args.family == "all" else [n.strip() for n in args.family.split(",") if n.strip()]
    )
    unknown = [n for n in names if n not in FAMILIES]
    if unknown or not names:
        p.error(f"unknown family {', '.join(unknown) or '(none)'}; choose from {', '.join(FAMILIES)} or all")
    if args.worker and len(names) != 1:
        p.error("a worker runs one family")
    args.families = names
    if args.edit_condition_area < 32 * 32:
        p.error("--edit-condition-area must be at least 1024 pixels")
    if args.num_frames < 1 or (args.num_frames - 1) % 4:
        p.error(f"--num-frames must be 4k+1 (1, 5, 9, 13, 17, ...), got {args.num_frames}")
    return args


def family_json(args: argparse.Namespace, name: str, res: dict) -> dict:
    """A family's measurements in the JSON output: per size the engine rows (and PSNR, or with
    `--compile` the step's counted work, the matmul rate and the diffusers compile form)."""
    sizes = family_sizes(args, FAMILIES[name])
    if not args.compile:
        return {
            "results": {str(s): res["rows"][s] for s in sizes},
            "psnr_db": {str(s): res["parity"][s] for s in sizes},
        }
    form, blocks = diffusers_compile_form(args.model_dir / name)
    return {
        "diffusers_compile": {"form": form, "repeated_blocks": list(blocks)},
        "results": {str(s): res["measured"][s]["rows"] for s in sizes},
        "step_work": {str(s): res["measured"][s]["work"] for s in sizes},
        "matmul_rate": {str(s): res["measured"][s]["matmul_rate"] for s in sizes},
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        engine, size = harness.parse_worker(args, engines=(*COMPILE_ENGINES, FLOP_COUNT))
        worker(args, FAMILIES[args.families[0]], engine, size)
        return

    with tempfile.TemporaryDirectory(prefix="diffserve-bench-") as tmp:
        args.model_dir = (args.model_dir or Path(tmp) / "checkpoints").resolve()
        image_dir = (args.image_dir or Path(tmp) / "images").resolve()
        image_dir.mkdir(parents=True, exist_ok=True)
        info = harness.machine_info()
        print(
            "\n".join(
                [
                    "# diffserve vs diffusers, per model family",
                    "",
                    *harness.machine_lines(info),
                    f"- fp32, CPU, {args.steps} steps, seed {args.seed}, prompt {args.prompt!r}, "
                    f"{args.repeats} timed runs per worker after 1 warm-up, {args.rounds} worker(s) per engine "
                    "and resolution",
                    *(
                        [f"- engines: {', '.join(COMPILE_ENGINES)} (order rotating per round)"]
                        if args.compile
                        else []
                    ),
                    "",
                ]
            ),
            flush=True,
        )
        results: dict[str, dict] = {}
        for name in args.families:
            family = FAMILIES[name]
            print(f"[{name}]", file=sys.stderr)
            if name == "qwen-image-edit" and args.edit_condition_area != REAL_EDIT_CONDITION_AREA:
                print(
                    f"  edit condition area reduced to {args.edit_condition_area:,} pixels on both engines "
                    f"(real: {REAL_EDIT_CONDITION_AREA:,})",
                    file=sys.stderr,
                )
            prepare_checkpoint(family, args.model_dir)
            dit_params = harness.dit_parameter_count(args.model_dir / name)
            print(f"  DiT parameters: {dit_params:,}", file=sys.stderr)
            if args.compile:
                measured = measure_compiled(args, family, image_dir)
                results[name] = {"dit_parameters": dit_params, "measured": measured}
                print(render_compiled_family(family, info, dit_params, args, measured), flush=True)
                continue
            rows, parity = harness.compare_engines(
                family_sizes(args, family),
                args.rounds,
                lambda engine, size, image_out, family=family: worker_command(
                    args, family, engine, size, image_out
                ),
                image_dir,
                args.worker_timeout,
                tag=f"{name} ",
                image_prefix=f"{name}_",
            )
            results[name] = {"dit_parameters": dit_params, "rows": rows, "parity": parity}
            print(render_family(family, info, dit_params, args, rows, parity), flush=True)

        print(render_compiled_summary(args, results) if args.compile else render_summary(args, results))
        if args.json:
            payload = {
                "machine": info,
                "settings": harness.settings_for_json(args),
                "families": {
                    name: {
                        "pipeline": FAMILIES[name].pipeline,
                        "checkpoint": FAMILIES[name].checkpoint,
                        "cfg": FAMILIES[name].cfg,
                        "sampling": FAMILIES[name].sampling,
                        "dit_parameters": res["dit_parameters"],
                        "resolutions": family_sizes(args, FAMILIES[name]),
                        "num_frames": family_frames(args, FAMILIES[name]) if FAMILIES[name].video else None,
                        **family_json(args, name, res),
                    }
                    for name, res in results.items()
                },
            }
            harness.write_json(args.json, payload)


if __name__ == "__main__":
    main()
