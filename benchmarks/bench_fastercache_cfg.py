"""FasterCache on a request with classifier-free guidance: diffusers' own hook against diffserve, side by side.

diffusers' `FasterCacheConfig` hook (`is_guidance_distilled` False, its defaults) skips the negative-prompt
branch on some steps and approximates it from the prompt branch; it needs both branches in one transformer
call, which `StableDiffusion3Pipeline` makes (FluxPipeline does not: `bench_cache_vs_cachedit.py` gives
the hook `is_guidance_distilled` there). diffserve runs `cache={"method": "fastercache"}` with the same
defaults on the same checkpoint, prompt and seed. The reference is given SD3's attention module names and
its `pooled_projections` as a branch input (`tests/e2e/test_fastercache_cfg.py` checks that the two then
skip the same steps, run the same attention calls and give the same pixels).

Four engines in one process, each loaded once and warmed up once (untimed), then timed in rotating rounds
(`--rounds`): diffusers exact, diffusers + hook, diffserve exact, diffserve fastercache. Reported: end-to-end
seconds (median over rounds), the speed-up over the same implementation's exact run (median of the per-round
ratios), the steps that skipped the negative branch and the attention calls that ran (counted on both sides
from the blocks' `to_q`), PSNR against its own exact output, and the hook's time over diffserve's (per round).

Checkpoint: a random-weight SD3 architecture (`diffserve.families.sd3.tiny`) with `--layers` joint blocks of
`--heads` x 64, tiny text encoders (T5 width 48, `max_sequence_length` 32) and VAE, at `--resolution`
(default 256: 256 image + 109 text tokens), 28 steps, guidance 5.

    .venv/bin/python benchmarks/bench_fastercache_cfg.py --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import diffserve  # noqa: F401  (before torch: OpenMP's passive wait policy is read when torch loads)
from diffserve import DiffGenerator
from diffserve.families.sd3.tiny import TinySD3Spec, build_tiny_sd3
from diffserve.testing.faster_cache_reference import (
    apply_sd3_faster_cache,
    attention_rows,
    reset_faster_cache,
)
from diffserve.testing.image_metrics import psnr_uint8

PROMPT = "a lighthouse on a cliff at dusk, oil painting"
SEED = 11

import torch  # noqa: E402  (after diffserve, see above)


@dataclass
class Engine:
    """One engine: its generation (-> uint8 image) and the batch rows of each attention call it made."""

    generate: Callable[[], np.ndarray]
    rows: list[int]
    seconds: list[float] = field(default_factory=list)
    image: np.ndarray | None = None
    skipped: int = 0


def diffusers_engine(root: Path, kwargs: dict, hooked: bool) -> Engine:
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(root, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    rows = attention_rows(pipe.transformer)
    one_row: list[int] = []  # transformer calls on one row: the hook skipped the negative branch
    pipe.transformer.pos_embed.register_forward_hook(
        lambda m, a, out: one_row.append(1) if out.shape[0] == 1 else None
    )
    if hooked:
        apply_sd3_faster_cache(pipe.transformer)

    engine = Engine(lambda: np.zeros(0), rows)

    def generate() -> np.ndarray:
        rows.clear()
        one_row.clear()
        if hooked:  # the pipeline does not reset the hook after a call (`testing/faster_cache_reference.py`)
            reset_faster_cache(pipe.transformer)
        generator = torch.Generator("cpu").manual_seed(SEED)
        image = pipe(PROMPT, generator=generator, output_type="np", **kwargs).images[0]
        engine.skipped = len(one_row)
        return (image * 255).round().astype(np.uint8)

    engine.generate = generate
    return engine


def diffserve_engine(root: Path, kwargs: dict, cache: dict | None) -> Engine:
    gen = DiffGenerator.from_pretrained(root, device="cpu", show_progress=False)
    rows = attention_rows(gen.pipeline.context.get("transformer"))
    engine = Engine(lambda: np.zeros(0), rows)

    def generate() -> np.ndarray:
        rows.clear()
        out = gen.generate(PROMPT, seed=SEED, cache=cache, **kwargs)
        engine.skipped = 0 if out.cache is None else out.cache.get("unconditional_skipped", 0)
        return np.asarray(out.images[0].convert("RGB"))

    engine.generate = generate
    return engine


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    spec = TinySD3Spec(
        num_layers=args.layers,
        num_attention_heads=args.heads,
        attention_head_dim=64,
        sample_size=args.resolution // 8,
        pos_embed_max_size=max(16, args.resolution // 16),
        seed=5,
    )
    kwargs = {
        "height": args.resolution,
        "width": args.resolution,
        "num_inference_steps": args.steps,
        "guidance_scale": 5.0,
        "max_sequence_length": 32,
    }
    with tempfile.TemporaryDirectory() as tmp:
        root = build_tiny_sd3(Path(tmp) / "sd3", spec)
        engines = {
            "diffusers exact": diffusers_engine(root, kwargs, hooked=False),
            "diffusers + hook": diffusers_engine(root, kwargs, hooked=True),
            "diffserve exact": diffserve_engine(root, kwargs, None),
            "diffserve fastercache": diffserve_engine(root, kwargs, {"method": "fastercache"}),
        }
        load = os.getloadavg()[0]
        for name, engine in engines.items():
            print(f"warming up {name} ...", file=sys.stderr, flush=True)
            engine.generate()
        for round_ in range(args.rounds):
            names = list(engines)
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                engine = engines[name]
                start = time.perf_counter()
                engine.image = engine.generate()
                engine.seconds.append(time.perf_counter() - start)
            print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        print(render(engines, args, load, os.getloadavg()[0]))
    return 0


def apart(a: np.ndarray, b: np.ndarray) -> str:
    """How two uint8 images differ: identical, or their PSNR and largest difference in levels."""
    if np.array_equal(a, b):
        return "identical"
    return f"{psnr_uint8(a, b):.1f} dB apart, max {np.abs(a.astype(int) - b.astype(int)).max()} level"


def ratios(a: Engine, b: Engine) -> str:
    values = [x / y for x, y in zip(a.seconds, b.seconds, strict=True)]
    return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"


def render(
    engines: dict[str, Engine], args: argparse.Namespace, load_before: float, load_after: float
) -> str:
    d_exact, d_hook = engines["diffusers exact"], engines["diffusers + hook"]
    s_exact, s_cache = engines["diffserve exact"], engines["diffserve fastercache"]
    lines = [
        f"SD3 architecture, {args.layers} blocks of {args.heads} x 64, {args.resolution}x{args.resolution}, "
        f"{args.steps} steps, guidance 5, {args.rounds} rounds, {args.threads} threads; 1-minute load "
        f"{load_before:.1f} before, {load_after:.1f} after",
        "",
        "| implementation | end-to-end s | speed-up vs own exact | negative branch skipped | attention calls run "
        "| PSNR vs own exact |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, exact, cached in (
        ("diffusers + FasterCache hook", d_exact, d_hook),
        ("diffserve fastercache", s_exact, s_cache),
    ):
        assert cached.image is not None and exact.image is not None
        lines.append(
            f"| {label} | {statistics.median(cached.seconds):.2f} | {ratios(exact, cached)} | "
            f"{cached.skipped} / {args.steps} | {len(cached.rows)} / {len(exact.rows)} | "
            f"{psnr_uint8(cached.image, exact.image):.1f} dB |"
        )
    assert d_hook.image is not None and s_cache.image is not None
    assert d_exact.image is not None and s_exact.image is not None
    gap, exact_gap = apart(d_hook.image, s_cache.image), apart(d_exact.image, s_exact.image)
    lines += [
        f"| **hook / diffserve time** | **{ratios(d_hook, s_cache)}** | | | | cached images {gap} |",
        f"| exact: diffusers / diffserve time | {ratios(d_exact, s_exact)} | | | | exact images {exact_gap} |",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
