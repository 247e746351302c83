"""diffserve vs diffusers per model family: SD3, Qwen-Image, Qwen-Image-Edit, Z-Image, Wan 2.1 T2V and I2V.

The method of `bench_flux_vs_diffusers.py` (shared through `harness.py`), one family after the other:
build (or reuse) a random-weight checkpoint of realistic block shape (64-dim heads, 8 of them or 12
for Wan, a few layers: a 30-44M-parameter DiT; small text encoders, which are not what is measured),
then time both engines on it, each measurement in a fresh subprocess (this script re-invoked with
`--worker ENGINE RES`), engines alternating: load (timed), one uncounted warm-up generation, `--repeats` timed
generations. The parent reports s/step, end-to-end, load time, peak RSS, the PSNR between the two
engines' images (same seed) and the DiT forward calls per denoising step of each engine (a counter
wrapped around the transformer's forward), which shows how each engine runs classifier-free guidance:
one batched forward, or one forward per branch.

CFG is on for every family: SD3 guidance 7 with a negative prompt; Qwen-Image and Qwen-Image-Edit
true_cfg_scale 4 with negative prompt " "; Z-Image guidance 4 (default empty negative prompt); Wan
guidance 5 with a negative prompt. The Wan families generate `--num-frames` frames (default 17) at size x
size (default 128, the image families 256; `--resolutions` sets both) with the UniPC scheduler the
released checkpoints ship; the PSNR covers every frame (each worker saves the video as one lossless
PNG, its frames stacked top to bottom). Wan I2V gets a size x size input image and keeps diffusers'
default 512 text tokens: its image cross-attention finds the image tokens by assuming exactly that many.

Qwen-Image-Edit gets a size x size input image; both engines resize it to `--edit-condition-area`
pixels before encoding it. The real behaviour, hard-coded in diffusers, is 1024*1024; that made one
256x256 edit generation take 86-120 s on a (busy) 2-core machine, so the default here is 512*512, applied to
both engines (diffusers' `calculate_dimensions` wrapped, diffserve's pipeline config set) and printed
in the report; `--edit-condition-area 1048576` runs the real behaviour.

    .venv/bin/python benchmarks/bench_families.py                                  # all six; 4 steps
    .venv/bin/python benchmarks/bench_families.py --family wan-t2v,wan-i2v --num-frames 17
    .venv/bin/python benchmarks/bench_families.py --family qwen-image --resolutions 256,512 --json out.json
    .venv/bin/python benchmarks/bench_families.py --model-dir /tmp/bench_families   # build once, reuse later

Ratios are diffusers / diffserve: above 1 means diffserve is faster (or, for RSS, smaller).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness

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
    #: images' worth of work, so the Wan families default to 128x128 (one generation in ~10-30 s on 2 cores).
    default_size: int = DEFAULT_SIZE


def _sd3_build(path: Path) -> None:
    from diffserve.testing.tiny_sd3 import TinySD3Spec, build_tiny_sd3

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
    from diffserve.testing.tiny_qwen_image import TinyQwenImageSpec

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
    from diffserve.testing.tiny_qwen_image import build_tiny_qwen_image

    build_tiny_qwen_image(path, _qwen_spec("t2i"))


def _qwen_edit_build(path: Path) -> None:
    from diffserve.testing.tiny_qwen_image import build_tiny_qwen_image_edit

    build_tiny_qwen_image_edit(path, _qwen_spec("edit"))


def _zimage_build(path: Path) -> None:
    from diffserve.testing.tiny_zimage import TinyZImageSpec, build_tiny_zimage

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


def _wan_build(path: Path, image_to_video: bool) -> None:
    from diffserve.testing.tiny_wan import TinyWanSpec, build_tiny_wan

    build_tiny_wan(
        path,
        TinyWanSpec(
            image_to_video=image_to_video,
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
            name="zimage",
            pipeline="ZImagePipeline",
            checkpoint=(
                "Z-Image layout, dim 512 (8x64 heads), 6 joint + 2 noise-refiner + 2 context-refiner blocks, "
                "RoPE axes (16, 24, 24), caption dim 256 (a 2-layer Qwen3 text encoder), VAE (32, 64, 128, 128)"
            ),
            cfg="guidance_scale 4, default (empty) negative prompt",
            build=_zimage_build,
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
    kwargs = dict(
        family.sampling, prompt=args.prompt, height=size, width=size, num_inference_steps=args.steps
    )
    if family.image_input:
        kwargs["image"] = edit_input_image(size)
    if family.video:
        kwargs["num_frames"] = args.num_frames
    return kwargs


def _run_diffserve(args: argparse.Namespace, family: Family, size: int):
    start = time.perf_counter()
    from diffserve.api import DiffGenerator

    imported = time.perf_counter()
    if family.name == "qwen-image-edit" and args.edit_condition_area != REAL_EDIT_CONDITION_AREA:
        from diffserve.configs.qwen_image import QwenImageEditPipelineConfig
        from diffserve.pipelines import qwen_image

        qwen_image.QwenImageEditPipeline.config = QwenImageEditPipelineConfig(
            condition_image_area=args.edit_condition_area
        )
    generator = DiffGenerator.from_pretrained(
        args.model_dir / family.name, device="cpu", dtype="float32", show_progress=False
    )
    load = {"import_s": imported - start, "from_pretrained_s": time.perf_counter() - imported}
    counter = harness.ForwardCounter(generator.pipeline.context.get("transformer"))
    kwargs = _generation_kwargs(args, family, size)

    def generate():
        out = generator.generate(seed=args.seed, **kwargs)
        image = video_strip(out.frames[0]) if family.video else out.images[0]
        return image, list(out.step_times)

    return load, generate, counter


def _run_diffusers(args: argparse.Namespace, family: Family, size: int):
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

        from diffserve.testing.tiny_qwen_image import load_qwen_vl_processor

        # diffusers cannot build the processor's video half without torchvision: hand it the image-only one.
        extra["processor"] = load_qwen_vl_processor(folder / "processor")
        if args.edit_condition_area != REAL_EDIT_CONDITION_AREA:
            full_area = diffusers_edit.calculate_dimensions
            area = args.edit_condition_area
            diffusers_edit.calculate_dimensions = lambda target_area, ratio: full_area(area, ratio)
    pipe = pipeline_class.from_pretrained(folder, torch_dtype=torch.float32, **extra)
    pipe.to("cpu")
    load = {"import_s": imported - start, "from_pretrained_s": time.perf_counter() - imported}
    pipe.set_progress_bar_config(disable=True)  # diffserve runs with its progress bar off too
    counter = harness.ForwardCounter(pipe.transformer)
    timer = harness.DiffusersStepTimer(pipe.transformer)
    kwargs = _generation_kwargs(args, family, size)

    def generate():
        timer.reset()
        output = pipe(
            generator=torch.Generator("cpu").manual_seed(args.seed),
            output_type="np" if family.video else "pil",
            callback_on_step_end=timer.on_step_end,
            **kwargs,
        )
        if family.video:  # floats in [0, 1], (batch, frames, height, width, 3)
            image = video_strip((output.frames[0] * 255).round().astype("uint8"))
        else:
            image = output.images[0]
        return image, timer.step_times(args.steps)

    return load, generate, counter


def worker(args: argparse.Namespace, family: Family, engine: str, size: int) -> None:
    # Shared dependencies are imported before the clock starts; each engine's own imports (and the
    # libraries only it pulls in) count towards its load time: a cold start, as a user sees it.
    import numpy  # noqa: F401
    import PIL.Image  # noqa: F401
    import torch  # noqa: F401

    runner = {"diffserve": _run_diffserve, "diffusers": _run_diffusers}[engine]
    load, generate, counter = runner(args, family, size)
    harness.run_timed_generations(
        engine, size, load, generate, args.repeats, args.image_out, dit_counter=counter
    )


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
        "--image-out", str(image_out),
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
        f"- checkpoint: DiT {dit_params:,} parameters; {family.checkpoint}",
        f"- CFG: {family.cfg}",
    ]
    if family.video:
        out.append(
            f"- video: {args.num_frames} frames per generation (resolution below is per frame); PSNR over "
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
    out += [
        "",
        *table,
        *harness.contention_lines(sizes, rows, info["torch_threads"]),
        "",
        "Raw timings:",
        *notes,
        "",
    ]
    return "\n".join(out)


def render_summary(args: argparse.Namespace, results: dict[str, dict]) -> str:
    out = [
        "## Summary (diffusers / diffserve)",
        "",
        "| family | resolution | s/step | end-to-end | load | peak RSS | DiT calls/step (diffserve vs diffusers) "
        "| PSNR dB |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, res in results.items():
        frames = f" x {args.num_frames} frames" if FAMILIES[name].video else ""
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--family",
        default="all",
        help=f"comma-separated families out of {', '.join(FAMILIES)}, or 'all' (default: all, in that order)",
    )
    harness.add_run_args(
        p,
        f"{DEFAULT_SIZE}; the Wan families 128",
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
        "--num-frames",
        type=int,
        default=DEFAULT_NUM_FRAMES,
        help=f"frames per video of the Wan families, 4k+1 (default: {DEFAULT_NUM_FRAMES})",
    )
    harness.add_output_args(p)
    p.set_defaults(resolutions=None)  # absent: each family's own default size (`Family.default_size`)
    args = p.parse_args(argv)
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


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        engine, size = harness.parse_worker(args)
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

        print(render_summary(args, results))
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
                        "num_frames": args.num_frames if FAMILIES[name].video else None,
                        "results": {str(s): res["rows"][s] for s in family_sizes(args, FAMILIES[name])},
                        "psnr_db": {str(s): res["parity"][s] for s in family_sizes(args, FAMILIES[name])},
                    }
                    for name, res in results.items()
                },
            }
            harness.write_json(args.json, payload)


if __name__ == "__main__":
    main()
