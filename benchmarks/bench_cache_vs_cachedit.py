"""Cache accelerators side by side: diffusers + cache-dit (and diffusers' own cache hooks) against diffserve's
per-request `cache=`, same method, same settings, same checkpoint, prompts and seeds, in one process.

Issue 33's benchmark. For every row (a method at one setting) both implementations generate the same
prompts with the same seed, alternating (reference first on even (repeat, prompt) pairs, diffserve first
on odd ones), after an untimed warm-up (each prompt once on each engine, exact); torch's thread count is
fixed (`--threads`); the machine's 1-minute load average before and after is in the table's header. Next
to every cached run, each implementation also runs exact (diffusers on a second pipeline without hooks),
so the speed-up against exact is paired per run too (`--no-row-baseline`: against the exact row only).
Reported per implementation: end-to-end seconds (per prompt the median of `--repeats`, then the mean over
prompts), the speed-up against its own exact output, the steps reused and the share of DiT blocks run,
PSNR against its own exact output (diffusers' exact for cache-dit and the hooks, diffserve's exact for
diffserve) and against diffusers' exact output. Per setting a ratio row gives the reference's time over
diffserve's (paired per run, median and range; > 1: diffserve faster) and the PSNR gap (diffserve's PSNR to
its exact minus the reference's to its exact); DBCache rows are checked against issue 33's bar (within 1 dB
or better and >= 1.2x).

Methods (`--methods`, default all):

    dbcache             cache-dit `DBCacheConfig(Fn_compute_blocks=1, Bn_compute_blocks=0,
                        residual_diff_threshold=t)` at each `--thresholds` t
    dbcache-taylorseer  the same + `TaylorSeerCalibratorConfig(taylorseer_order=1)`
    dbcache-scm         the same at the middle threshold with cache-dit's "medium" steps computation mask
    fbcache             diffusers' `FirstBlockCacheConfig(threshold=t)` (middle threshold)
                        <-> diffserve dbcache Fn=1, Bn=0, no warm-up
    taylorseer          diffusers' `TaylorSeerCacheConfig` (interval 5, 3 warm-up steps, order 1, fp32 factors)
    magcache            diffusers' `MagCacheConfig` with ratios measured on this checkpoint first
                        (`calibrate=True`, untimed); diffserve gets the same ratios
    seacache            diffusers' `SeaCacheConfig` (defaults; FluxPipeline given its latents' grid and the
                        step and sigma, `testing/sea_cache_reference`) <-> diffserve seacache, same settings
                        (same decisions: tests/e2e/test_cache_methods_seacache.py)
    fastercache, pab    diffusers' `FasterCacheConfig` (`is_guidance_distilled`, attention reuse only),
                        `PyramidAttentionBroadcastConfig` (attention-level reuse; FLUX's attention module
                        names given as identifiers) <-> diffserve fastercache, pab, same settings (same
                        decisions on a guidance-distilled FLUX: tests/e2e/test_cache_methods_attention.py;
                        on the true-CFG demo model diffusers' hooks count the negative-prompt call as another
                        iteration of the same cache while diffserve keeps each branch's outputs; diffserve's
                        fastercache is given `is_guidance_distilled` too: its negative-branch approximation,
                        which the hook cannot run on FluxPipeline, is measured against the hook on SD3 and
                        CogVideoX by tests/e2e/test_fastercache_cfg.py)
    teacache            diffserve only (neither diffusers 0.42 nor cache-dit 1.5.3 ships TeaCache):
                        `rel_l1_thresh` at each `--teacache-thresholds`

On the diffserve side a method this build does not run (an error from `generate`) is reported in the
table as "not supported by this build (<error>)", and a reference method diffserve does not have as
"diffserve has no <method> method"; the reference side still runs.

Checkpoints (`--checkpoints`, default both):

    demo   the shipped, trained demo model (FLUX.1 architecture, 2.3M DiT, 64x64, true CFG 3.0; cache-dit
           and diffserve with `enable_separate_cfg=True`, the CFG branch cached apart as FluxPipeline runs it
           apart) on held-out prompts (attribute combinations it never saw; not the calibration prompts)
    flux   a random-weight FLUX.1-architecture checkpoint (`--model-dir`, built when missing): 2 double +
           6 single blocks of 8 heads x 64 (`--flux-*`), T5 length 512, guidance-distilled, at
           `--resolution` 512 (1,024 image + 512 text tokens)

    .venv/bin/python benchmarks/bench_cache_vs_cachedit.py                                 # both, 28 steps
    .venv/bin/python benchmarks/bench_cache_vs_cachedit.py --checkpoints demo --repeats 5 --json out.json
    .venv/bin/python benchmarks/bench_cache_vs_cachedit.py --checkpoints flux --methods dbcache,dbcache-taylorseer \
        --thresholds 0.45,0.5,0.55 --prompts 1 --repeats 2
    .venv/bin/python benchmarks/bench_cache_vs_cachedit.py --quick        # smoke: 12 steps, tiny FLUX, 1 run

Random weights make a poor judge of an approximation (their images barely depend on the DiT's
prediction): read the FLUX-shaped checkpoint's rows for speed, the demo model's for PSNR. On the random
FLUX-shaped DiT the first block's residual changes by 0.4-0.6 (relative L1) from step to step, so DBCache
reuses no step at 0.08-0.2 there; 0.45-0.55 reuses 7-17 of 28.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import math
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import diffserve  # noqa: F401  (before torch: OpenMP's passive wait policy is read when torch loads)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from diffserve.testing.image_metrics import psnr_uint8  # noqa: E402

METHODS = (
    "dbcache", "dbcache-taylorseer", "dbcache-scm", "fbcache", "taylorseer", "magcache", "seacache",
    "fastercache", "pab", "teacache",
)  # fmt: skip
#: Issue 33's bar for DBCache (with and without TaylorSeer): diffserve's PSNR to its exact output within
#: 1 dB of cache-dit's or better, and its end-to-end time at least 1.2x faster.
PSNR_GAP_DB = 1.0
SPEEDUP_BAR = 1.2
FLUX_PROMPTS = (
    "a red fox in the snow, golden hour, highly detailed",
    "a cup of coffee on a wooden table next to an open book",
    "an astronaut riding a horse on the moon, cinematic lighting",
    "a mountain lake at dawn with mist over the water",
)


# --------------------------------------------------------------------------------------------- checkpoints


@dataclasses.dataclass
class Checkpoint:
    name: str
    path: Path
    description: str
    prompts: list[str]
    #: FluxPipeline's and DiffGenerator.generate's shared keywords (besides prompt and seed).
    request: dict[str, Any]
    #: FluxPipeline runs the CFG branch as a second transformer call each step.
    true_cfg: bool


def demo_prompts(count: int) -> list[str]:
    """`count` held-out prompts of the demo model, spread over its 60 held-out attribute sets (combinations
    it never saw in training), none of them a calibration prompt (`bench_quality.DEMO_PROMPTS`)."""
    from bench_quality import DEMO_PROMPTS
    from diffserve.demo import shapes_data

    captions = [shapes_data.caption(a) for a in shapes_data.held_out_attributes()]
    captions = [c for c in captions if c not in DEMO_PROMPTS]
    stride = max(1, len(captions) // count)
    return captions[::stride][:count]


def demo_checkpoint(args: argparse.Namespace) -> Checkpoint:
    from diffserve.configs.demo_model import demo_model_path

    return Checkpoint(
        name="demo",
        path=demo_model_path(),
        description="shipped demo model (trained, FLUX.1 architecture, 2 double + 4 single blocks of 4 heads x 32, "
        "64x64, true CFG 3.0, held-out prompts)",
        prompts=demo_prompts(args.prompts),
        # The folder's recommended defaults (its diffserve.json), passed to both explicitly.
        request={
            "height": 64,
            "width": 64,
            "num_inference_steps": args.steps,
            "max_sequence_length": 16,
            "true_cfg_scale": 3.0,
            "negative_prompt": "",
            "guidance_scale": None,
        },  # fmt: skip
        true_cfg=True,
    )


def flux_spec(args: argparse.Namespace):
    from diffserve.families.flux.tiny import TinyFluxSpec

    if args.quick:  # tiny shapes: the smoke run
        return TinyFluxSpec(num_layers=2, num_single_layers=6, t5_max_length=64, seed=0)
    head_dim = args.flux_head_dim
    # FLUX.1's RoPE split of the head dim (16/56/56 of 128), scaled to this head width.
    axes = (head_dim // 8, head_dim * 7 // 16, head_dim * 7 // 16)
    return TinyFluxSpec(
        num_layers=args.flux_double,
        num_single_layers=args.flux_single,
        num_attention_heads=args.flux_heads,
        attention_head_dim=head_dim,
        axes_dims_rope=axes,
        guidance_embeds=True,
        latent_channels=16,
        vae_block_out_channels=(32, 64, 128, 128),
        vae_norm_num_groups=32,
        text_hidden_size=256,
        text_layers=2,
        t5_max_length=512,
        seed=0,
    )


def flux_checkpoint(args: argparse.Namespace) -> Checkpoint:
    spec = flux_spec(args)
    model_dir = args.model_dir
    if args.quick and model_dir == DEFAULT_MODEL_DIR:
        model_dir = model_dir.with_name("flux-tiny-8blocks")
    if (model_dir / "model_index.json").exists():
        config = json.loads((model_dir / "transformer" / "config.json").read_text())
        wanted = (spec.num_layers, spec.num_single_layers, spec.num_attention_heads, spec.attention_head_dim)
        found = (
            config["num_layers"], config["num_single_layers"], config["num_attention_heads"],
            config["attention_head_dim"],
        )  # fmt: skip
        if found != wanted:
            raise SystemExit(
                f"{model_dir} holds a DiT of {found} (double, single, heads, head dim), not {wanted}"
            )
        log(f"reusing the FLUX-shaped checkpoint at {model_dir}")
    else:
        from diffserve.families.flux.tiny import build_tiny_flux

        log(f"building the FLUX-shaped checkpoint at {model_dir} ...")
        build_tiny_flux(model_dir, spec)
    size = 64 if args.quick else args.resolution
    width = spec.num_attention_heads * spec.attention_head_dim
    return Checkpoint(
        name="flux",
        path=model_dir,
        description=f"random-weight FLUX.1-architecture checkpoint ({spec.num_layers} double + "
        f"{spec.num_single_layers} single blocks, {spec.num_attention_heads} heads x {spec.attention_head_dim} = "
        f"{width} wide, guidance-distilled, T5 length {spec.t5_max_length}), {size}x{size}",
        prompts=list(FLUX_PROMPTS[: args.prompts]),
        request={
            "height": size,
            "width": size,
            "num_inference_steps": args.steps,
            "max_sequence_length": spec.t5_max_length,
            "guidance_scale": 3.5,
        },  # fmt: skip
        true_cfg=False,
    )


# --------------------------------------------------------------------------------------------- the rows


@dataclasses.dataclass
class Row:
    """One method at one setting, on both sides."""

    method: str  # the table's group: "DBCache", "DBCache + TaylorSeer", "diffusers hook: mag_cache", ...
    setting: str  # the settings, in words
    reference: str | None  # "diffusers", "cache-dit", "diffusers hook" or None (diffserve only)
    #: Applies the reference's cache to the diffusers pipeline (None: the exact pipeline, or no reference).
    enable: Callable[[Any], None] | None
    disable: Callable[[Any], None] | None
    #: diffserve's `cache=` (None: exact).
    cache: dict[str, Any] | None
    #: A DBCache row checked against issue 33's bar.
    barred: bool = False


def build_rows(args: argparse.Namespace, ck: Checkpoint, ctx: dict[str, Any]) -> list[Row]:
    """The rows for `args.methods` on checkpoint `ck` (diffusers hooks first, cache-dit after: cache-dit
    patches the transformer's forward for good when first enabled, even after `disable_cache`)."""
    import cache_dit
    import torch
    from diffusers.hooks import (
        FasterCacheConfig,
        FirstBlockCacheConfig,
        MagCacheConfig,
        PyramidAttentionBroadcastConfig,
        SeaCacheConfig,
        TaylorSeerCacheConfig,
    )

    steps = args.steps
    thresholds = args.threshold_list
    middle = thresholds[len(thresholds) // 2]
    rows = [Row("exact", "no cache", "diffusers", None, None, None)]

    def hook(config_factory: Callable[[Any], Any]) -> tuple[Callable, Callable]:
        return (
            lambda pipe: pipe.transformer.enable_cache(config_factory(pipe)),
            lambda pipe: pipe.transformer.disable_cache(),
        )

    wanted = set(args.method_list)
    if "fbcache" in wanted:
        on, off = hook(lambda pipe: FirstBlockCacheConfig(threshold=middle))
        rows.append(
            Row(
                "diffusers hook: first_block_cache", f"threshold {middle:g} (diffserve: dbcache F1B0, no warm-up)",
                "diffusers hook", on, off,
                {"method": "dbcache", "Fn_compute_blocks": 1, "Bn_compute_blocks": 0,
                 "residual_diff_threshold": middle, "max_warmup_steps": 0},
            )
        )  # fmt: skip
    if "taylorseer" in wanted:
        interval, before, order = 5, 3, 1
        on, off = hook(
            lambda pipe: TaylorSeerCacheConfig(
                cache_interval=interval, disable_cache_before_step=before, max_order=order,
                taylor_factors_dtype=torch.float32,
            )
        )  # fmt: skip
        rows.append(
            Row(
                "diffusers hook: taylorseer_cache",
                f"cache_interval {interval}, disable_cache_before_step {before}, order {order}",
                "diffusers hook", on, off,
                {"method": "taylorseer", "taylorseer_order": order, "cache_interval": interval,
                 "disable_cache_before_step": before},
            )
        )  # fmt: skip
    if "magcache" in wanted:
        thresh, k, retention = 0.06, 3, 0.2
        ratios = ctx["mag_ratios"]
        on, off = hook(
            lambda pipe: MagCacheConfig(
                threshold=thresh, max_skip_steps=k, retention_ratio=retention, num_inference_steps=steps,
                mag_ratios=ratios,
            )
        )  # fmt: skip
        rows.append(
            Row(
                "diffusers hook: mag_cache",
                f"magcache_thresh {thresh:g}, magcache_K {k}, retention_ratio {retention:g}, ratios measured",
                "diffusers hook", on, off,
                {"method": "magcache", "magcache_thresh": thresh, "magcache_K": k,
                 "retention_ratio": retention, "mag_ratios": ratios},
            )
        )  # fmt: skip
    if "seacache" in wanted:
        # diffusers' SeaCache needs FluxPipeline's latents on their grid and the loop's step and sigma, which
        # FluxPipeline does not pass (without them the hook runs every block): supplied as its tests do.
        from diffserve.testing.sea_cache_reference import disable_flux_sea_cache, enable_flux_sea_cache

        rows.append(
            Row("diffusers hook: sea_cache", "threshold 0.25, residual_order 1 (defaults)", "diffusers hook",
                lambda pipe: enable_flux_sea_cache(pipe, SeaCacheConfig(threshold=0.25)), disable_flux_sea_cache,
                {"method": "seacache", "threshold": 0.25})
        )  # fmt: skip
    if "fastercache" in wanted:
        on, off = hook(
            lambda pipe: FasterCacheConfig(
                spatial_attention_block_skip_range=2,
                spatial_attention_block_identifiers=("transformer_blocks.*attn", "single_transformer_blocks.*attn"),
                current_timestep_callback=lambda: pipe.current_timestep,
                # Its unconditional-branch reuse needs the CFG branches in one batch, which FluxPipeline
                # does not do (it calls the transformer twice): attention reuse only.
                is_guidance_distilled=True,
            )
        )  # fmt: skip
        rows.append(
            Row("diffusers hook: faster_cache", "spatial_attention_block_skip_range 2, attention reuse only",
                "diffusers hook", on, off,
                {"method": "fastercache", "spatial_attention_block_skip_range": 2, "is_guidance_distilled": True})
        )  # fmt: skip
    if "pab" in wanted:
        on, off = hook(
            lambda pipe: PyramidAttentionBroadcastConfig(
                spatial_attention_block_skip_range=2,
                spatial_attention_block_identifiers=("transformer_blocks.*attn", "single_transformer_blocks.*attn"),
                spatial_attention_timestep_skip_range=(100, 800),
                current_timestep_callback=lambda: pipe.current_timestep,
            )
        )  # fmt: skip
        rows.append(
            Row("diffusers hook: pyramid_attention_broadcast",
                "spatial_attention_block_skip_range 2, timesteps (100, 800)", "diffusers hook", on, off,
                {"method": "pab", "spatial_attention_block_skip_range": 2})
        )  # fmt: skip

    def cachedit(config: Any, calibrator: Any = None) -> tuple[Callable, Callable]:
        return (
            lambda pipe: cache_dit.enable_cache(pipe, cache_config=config, calibrator_config=calibrator),
            lambda pipe: cache_dit.disable_cache(pipe),
        )

    # FluxPipeline runs true CFG's branch as a second transformer call per step: cache-dit then caches
    # it apart (its own setting for such pipelines), and diffserve is given the same `enable_separate_cfg`.
    separate_cfg = True if ck.true_cfg else None
    dbcache_variants = []
    if "dbcache" in wanted:
        dbcache_variants += [("DBCache", t, False, None) for t in thresholds]
    if "dbcache-taylorseer" in wanted:
        dbcache_variants += [("DBCache + TaylorSeer", t, True, None) for t in thresholds]
    if "dbcache-scm" in wanted:
        dbcache_variants.append(("DBCache + SCM", middle, False, "medium"))
    for method, threshold, taylor, scm in dbcache_variants:
        mask = cache_dit.steps_mask(mask_policy=scm, total_steps=steps) if scm else None
        config = cache_dit.DBCacheConfig(
            Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=threshold,
            enable_separate_cfg=separate_cfg, steps_computation_mask=mask,
        )  # fmt: skip
        calibrator = cache_dit.TaylorSeerCalibratorConfig(taylorseer_order=1) if taylor else None
        on, off = cachedit(config, calibrator)
        cache = {
            "method": "dbcache", "Fn_compute_blocks": 1, "Bn_compute_blocks": 0,
            "residual_diff_threshold": threshold,
            # cache-dit's defaults, spelled out: warm-up 8 steps, no caps.
            "max_warmup_steps": config.max_warmup_steps, "max_cached_steps": config.max_cached_steps,
            "max_continuous_cached_steps": config.max_continuous_cached_steps,
        }  # fmt: skip
        if separate_cfg is not None:
            cache["enable_separate_cfg"] = separate_cfg
        setting = f"F1B0, residual_diff_threshold {threshold:g}"
        if taylor:
            # TaylorSeerCalibratorConfig's defaults: both streams' residuals extrapolated.
            cache |= {"enable_taylorseer": True, "enable_encoder_taylorseer": True, "taylorseer_order": 1}
            setting += ", taylorseer_order 1"
        if mask is not None:
            cache |= {"steps_computation_mask": mask, "steps_computation_policy": "dynamic"}
            setting += f", steps_computation_mask '{scm}' ({sum(mask)}/{steps} computed), dynamic"
        rows.append(Row(method, setting, "cache-dit", on, off, cache, barred=scm is None))
    if "teacache" in wanted:
        rows += [
            Row(
                "TeaCache",
                f"rel_l1_thresh {t:g}",
                None,
                None,
                None,
                {"method": "teacache", "rel_l1_thresh": t},
            )
            for t in args.teacache_threshold_list
        ]
    return rows


# --------------------------------------------------------------------------------------------- the engines


class BlockWork:
    """Counts, on diffusers' FluxTransformer2DModel, the transformer calls, the blocks whose attention ran
    (a forward hook on each block's `attn.to_q`: a block that is skipped or reused, or whose attention is,
    does not call it) and the calls in which the last block ran (a step computed in full). Some 40 Python
    calls per transformer call: noise next to a step. The hooks inside the blocks only add to tensors, so
    that compiled blocks (`--reference-compile`) trace them without a guard on a Python count."""

    def __init__(self, transformer: Any) -> None:
        import torch

        blocks = [*transformer.transformer_blocks, *transformer.single_transformer_blocks]
        self.num_blocks = len(blocks)
        self._blocks_run = torch.zeros((), dtype=torch.int64)
        self._last_ran = torch.zeros((), dtype=torch.int64)  # in the current transformer call
        self.reset()
        transformer.register_forward_pre_hook(self._on_call)
        for block in blocks:
            block.attn.to_q.register_forward_hook(self._on_block)
        blocks[-1].attn.to_q.register_forward_hook(self._on_last_block)

    def reset(self) -> None:
        self.calls = 0
        self.calls_in_full = 0
        self._blocks_run.zero_()
        self._last_ran.zero_()

    @property
    def blocks_run(self) -> int:
        return int(self._blocks_run)

    def _settle(self) -> None:
        """Count the last transformer call as computed in full when its last block ran."""
        self.calls_in_full += int(self._last_ran)
        self._last_ran.zero_()

    def _on_call(self, module: Any, inputs: Any) -> None:
        self._settle()
        self.calls += 1

    def _on_block(self, module: Any, inputs: Any, output: Any) -> None:
        self._blocks_run.add_(1)

    def _on_last_block(self, module: Any, inputs: Any, output: Any) -> None:
        self._last_ran.fill_(1)

    def counts(self, steps: int) -> dict[str, float]:
        self._settle()
        per_step = self.calls / steps if steps else 1
        return {
            "steps_reused": (self.calls - self.calls_in_full) / per_step if per_step else 0.0,
            "block_work": self.blocks_run / (self.num_blocks * self.calls) if self.calls else 0.0,
            "transformer_calls": self.calls,
        }


class Engines:
    """diffusers' FluxPipeline and diffserve's DiffGenerator on one checkpoint, one process."""

    def __init__(
        self,
        ck: Checkpoint,
        threads: int,
        seed: int,
        row_baseline: bool,
        compile_dit: bool = False,
        compile_reference: bool = False,
    ) -> None:
        import torch
        from diffusers import FluxPipeline
        from diffusers.utils import logging as diffusers_logging

        from diffserve.api import DiffGenerator

        diffusers_logging.set_verbosity_error()
        self.ck, self.seed = ck, seed
        self.pipe = FluxPipeline.from_pretrained(ck.path, torch_dtype=torch.float32).to("cpu")
        self.pipe.set_progress_bar_config(disable=True)
        self.work = BlockWork(self.pipe.transformer)
        # The per-row exact baseline runs on a second pipeline of its own, so that no cache is enabled and
        # disabled around every run (cache-dit's enable_cache rebuilds its adapter).
        self.exact_pipe = None
        if row_baseline:
            self.exact_pipe = FluxPipeline.from_pretrained(ck.path, torch_dtype=torch.float32).to("cpu")
            self.exact_pipe.set_progress_bar_config(disable=True)
        #: With compiled code, each row runs once untimed first (a cache's call pattern is traced once).
        self.warm_each_row = compile_dit or compile_reference
        self.reference_compiled = compile_reference
        if compile_reference:  # diffusers' regional compilation: each repeated block class compiled
            for pipe in (self.pipe, self.exact_pipe):
                if pipe is not None:
                    pipe.transformer.compile_repeated_blocks()
        self.generator = DiffGenerator.from_pretrained(
            ck.path,
            device="cpu",
            dtype="float32",
            show_progress=False,
            cpu_threads=threads,
            compile=compile_dit,
        )
        torch.set_num_threads(threads)

    def run_diffusers(
        self, prompt: str, exact_pipe: bool = False
    ) -> tuple[float, np.ndarray, dict[str, Any]]:
        import torch

        self.work.reset()
        pipe = self.exact_pipe if exact_pipe else self.pipe
        start = time.perf_counter()
        image = pipe(
            prompt=prompt, generator=torch.Generator("cpu").manual_seed(self.seed), output_type="pil",
            **self.ck.request,
        ).images[0]  # fmt: skip
        seconds = time.perf_counter() - start
        # Compiled blocks trace the counting hooks inside them once and do not count: no counts then.
        counts = (
            {"steps_reused": None, "block_work": None}
            if self.reference_compiled
            else self.work.counts(self.ck.request["num_inference_steps"])
        )
        return seconds, np.asarray(image.convert("RGB")), counts

    def run_diffserve(self, prompt: str, cache: dict | None) -> tuple[float, np.ndarray, dict[str, Any]]:
        kwargs = {} if cache is None else {"cache": cache}
        steps = self.ck.request["num_inference_steps"]
        start = time.perf_counter()
        out = self.generator.generate(prompt, seed=self.seed, **self.ck.request, **kwargs)
        seconds = time.perf_counter() - start
        report = getattr(out, "cache", None)
        if report:
            computed, reused = report.get("blocks_computed"), report.get("blocks_reused")
            steps_reused = report.get("steps_reused", steps - out.steps_computed_in_full)
            branch = report.get("cfg_branch")
            if branch is not None and computed is not None and reused is not None:
                # The CFG branch cached apart (`enable_separate_cfg`): both branches' work, per step as the
                # diffusers side counts its two transformer calls.
                computed, reused = computed + branch["blocks_computed"], reused + branch["blocks_reused"]
                steps_reused = (steps_reused + branch["steps_reused"]) / 2
            work = (
                computed / (computed + reused)
                if computed is not None and reused and computed + reused
                else 1.0
            )
            counts = {"steps_reused": steps_reused, "block_work": work, "report": report}
        else:
            counts = {"steps_reused": steps - out.steps_computed_in_full, "block_work": 1.0}
        return seconds, np.asarray(out.images[0].convert("RGB")), counts

    def close(self) -> None:
        self.generator.close()


def measure_mag_ratios(engines: Engines, prompt: str) -> list[float]:
    """diffusers' MagCache calibration (never skips) on `prompt`: the residual magnitude ratio per step of
    the conditional branch, as its hook prints them."""
    from diffusers.hooks import MagCacheConfig

    steps = engines.ck.request["num_inference_steps"]
    engines.pipe.transformer.enable_cache(MagCacheConfig(calibrate=True, num_inference_steps=steps))
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            engines.run_diffusers(prompt)
    finally:
        engines.pipe.transformer.disable_cache()
    lists = re.findall(r"Calibration Complete.*?\n\[([^\]]*)\]", printed.getvalue(), flags=re.S)
    if not lists:
        raise RuntimeError(f"MagCache calibration printed no ratios: {printed.getvalue()[-500:]!r}")
    ratios = [float(x) for x in lists[0].split(",")]
    if len(ratios) != steps:
        raise RuntimeError(f"MagCache calibration gave {len(ratios)} ratios for {steps} steps")
    return [round(r, 5) for r in ratios]


# --------------------------------------------------------------------------------------------- measuring


@dataclasses.dataclass
class Side:
    """One implementation's results on one row."""

    name: str
    seconds: list[list[float]]  # per prompt, per repeat
    #: The same implementation without a cache, timed next to each of those runs (per-row baseline).
    baseline: list[list[float]]
    images: list[np.ndarray | None]
    counts: list[dict[str, Any] | None]
    error: str | None = None


def short_error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return text if len(text) <= 240 else text[:237] + "..."


def run_row(engines: Engines, row: Row, repeats: int) -> dict[str, Side]:
    """The row's runs: per repeat and prompt, each implementation with the row's cache (alternating which
    goes first), each next to an exact run of its own when the engines keep a per-row baseline."""
    prompts = engines.ck.prompts
    sides: dict[str, Side] = {}
    baseline = engines.exact_pipe is not None and row.method != "exact"

    def new_side(name: str) -> Side:
        return Side(
            name, [[] for _ in prompts], [[] for _ in prompts], [None] * len(prompts), [None] * len(prompts)
        )

    if row.reference is not None:
        sides["reference"] = new_side(row.reference)
    sides["diffserve"] = new_side("diffserve")
    from diffserve.configs.cache_settings import METHOD_NAMES

    method = None if row.cache is None else row.cache.get("method")
    if method is not None and method not in METHOD_NAMES:  # a reference method diffserve does not have
        known = ", ".join(METHOD_NAMES)
        sides["diffserve"].error = f"diffserve has no {method} method (its methods: {known})"
    enabled = False
    if row.enable is not None:
        try:
            row.enable(engines.pipe)
            enabled = True
        except Exception as exc:  # noqa: BLE001  (a hook that does not apply to this model: in the table)
            sides["reference"].error = short_error(exc)
            log(f"    {row.reference} could not enable {row.method}: {sides['reference'].error}")
    try:
        if engines.warm_each_row:  # compiled code traces a new call pattern (a cache's) once: untimed
            for key, side in sides.items():
                if side.error is None:
                    with contextlib.suppress(Exception):  # a failure shows in the timed runs
                        if key == "reference":
                            engines.run_diffusers(prompts[0])
                        else:
                            engines.run_diffserve(prompts[0], row.cache)
        for repeat in range(repeats):
            for p, prompt in enumerate(prompts):
                order = ["reference", "diffserve"] if (repeat + p) % 2 == 0 else ["diffserve", "reference"]
                for key in order:
                    side = sides.get(key)
                    if side is None or side.error is not None:
                        continue
                    runs = [False, True] if baseline else [False]  # exact?
                    if (repeat + p) % 2:
                        runs.reverse()
                    try:
                        for exact_run in runs:
                            if key == "reference":
                                seconds, image, counts = engines.run_diffusers(prompt, exact_pipe=exact_run)
                            else:
                                seconds, image, counts = engines.run_diffserve(
                                    prompt, None if exact_run else row.cache
                                )
                            if exact_run:
                                side.baseline[p].append(seconds)
                                continue
                            side.seconds[p].append(seconds)
                            if side.images[p] is None:
                                side.images[p], side.counts[p] = image, counts
                    except Exception as exc:  # noqa: BLE001  (reported in the table)
                        side.error = short_error(exc)
                        log(f"    {side.name} failed on {row.method} ({row.setting}): {side.error}")
    finally:
        if enabled:  # also after a failed run: the next row starts from the exact pipeline
            row.disable(engines.pipe)
    return sides


def _mean_count(counts: list[dict[str, Any] | None], key: str) -> float | None:
    """The mean of one count over the prompts; None where it was not counted (a compiled reference)."""
    values = [c[key] for c in counts if c is not None]
    return None if not values or None in values else statistics.fmean(values)


def summarize(side: Side, exact: Side | None, diffusers_exact: Side | None) -> dict[str, Any]:
    """Per implementation and row: seconds, speed-up against its exact run, counts, PSNRs."""
    if side.error is not None:
        return {"implementation": side.name, "error": side.error}
    medians = [statistics.median(s) for s in side.seconds]
    out: dict[str, Any] = {
        "implementation": side.name,
        "seconds": statistics.fmean(medians),
        "seconds_per_prompt": side.seconds,
        "steps_reused": _mean_count(side.counts, "steps_reused"),
        "block_work": _mean_count(side.counts, "block_work"),
    }
    reports = [c.get("report") for c in side.counts if c.get("report")]
    if reports:
        out["diffserve_cache_report"] = reports[0]
    if any(side.baseline):  # exact runs timed next to this row's runs: paired ratios
        ratios = [
            e / c
            for es, cs in zip(side.baseline, side.seconds, strict=True)
            for e, c in zip(es, cs, strict=True)
        ]
        out["speedup_vs_own_exact"] = statistics.median(ratios)
        out["speedup_vs_own_exact_per_run"] = ratios
        out["baseline_seconds_per_prompt"] = side.baseline
    elif exact is not None and exact.error is None:  # against the exact row
        exact_medians = [statistics.median(s) for s in exact.seconds]
        out["speedup_vs_own_exact"] = statistics.fmean(
            e / m for e, m in zip(exact_medians, medians, strict=True)
        )
    if exact is not None and exact.error is None:
        psnrs = [psnr_uint8(a, b) for a, b in zip(side.images, exact.images, strict=True)]
        out["psnr_vs_own_exact"] = psnrs
    if diffusers_exact is not None and diffusers_exact.error is None:
        out["psnr_vs_diffusers_exact"] = [
            psnr_uint8(a, b) for a, b in zip(side.images, diffusers_exact.images, strict=True)
        ]
    return out


def paired_ratio(ref: Side, ours: Side) -> list[float]:
    """Reference time / diffserve time per (prompt, repeat): runs seconds apart, alternating."""
    return [
        r / d for rs, ds in zip(ref.seconds, ours.seconds, strict=True) for r, d in zip(rs, ds, strict=True)
    ]


def run_checkpoint(args: argparse.Namespace, ck: Checkpoint) -> dict[str, Any]:
    log(f"{ck.name}: loading both engines ({ck.path}) ...")
    engines = Engines(
        ck, args.threads, args.seed, args.row_baseline, args.diffserve_compile, args.reference_compile
    )
    ctx: dict[str, Any] = {}
    try:
        # Warm-up, untimed: first calls allocate; every prompt's text embeddings enter diffserve's prompt
        # cache here, so no timed diffserve run encodes a prompt (diffusers encodes each time: a few ms with
        # these text encoders).
        for prompt in ck.prompts:
            engines.run_diffusers(prompt)
            if engines.exact_pipe is not None:
                engines.run_diffusers(prompt, exact_pipe=True)
            engines.run_diffserve(prompt, None)
        if "magcache" in args.method_list:
            try:
                ctx["mag_ratios"] = measure_mag_ratios(engines, ck.prompts[0])
            except Exception as exc:  # noqa: BLE001
                log(f"  MagCache calibration failed, magcache row left out: {short_error(exc)}")
                args.method_list = [m for m in args.method_list if m != "magcache"]
        rows = build_rows(args, ck, ctx)
        results = []
        exact: dict[str, Side] = {}
        for index, row in enumerate(rows):
            start = time.perf_counter()
            sides = run_row(engines, row, args.repeats)
            if row.method == "exact":
                exact = {"diffusers": sides["reference"], "diffserve": sides["diffserve"]}
            entry: dict[str, Any] = {
                "method": row.method, "setting": row.setting, "reference": row.reference,
                "diffserve_cache": row.cache, "barred": row.barred,
            }  # fmt: skip
            d_exact = exact.get("diffusers")
            if "reference" in sides:
                entry["reference_result"] = summarize(sides["reference"], d_exact, d_exact)
            entry["diffserve_result"] = summarize(sides["diffserve"], exact.get("diffserve"), d_exact)
            if "reference" in sides and sides["reference"].error is None and sides["diffserve"].error is None:
                entry["time_ratio_reference_over_diffserve"] = paired_ratio(
                    sides["reference"], sides["diffserve"]
                )
            results.append(entry)
            log(
                f"  [{index + 1}/{len(rows)}] {row.method}, {row.setting}: {time.perf_counter() - start:.1f} s"
            )
        # Every row left its engine exact (cache-dit patches the transformer's forward for good on its
        # first enable_cache): the first prompt once more without a cache, against the exact row's image.
        still_exact = {}
        if exact:
            _, image, _ = engines.run_diffusers(ck.prompts[0])
            still_exact["diffusers"] = psnr_uint8(image, exact["diffusers"].images[0])
            _, image, _ = engines.run_diffserve(ck.prompts[0], None)
            still_exact["diffserve"] = psnr_uint8(image, exact["diffserve"].images[0])
            if not all(math.isinf(v) for v in still_exact.values()):
                log(f"  WARNING: an engine's exact output changed over the run: PSNR {still_exact}")
        return {
            "checkpoint": ck.name, "description": ck.description, "path": str(ck.path),
            "dit_parameters": harness.dit_parameter_count(ck.path), "prompts": ck.prompts,
            "request": ck.request, "mag_ratios": ctx.get("mag_ratios"), "rows": results,
            "exact_after_the_rows_psnr": still_exact,
        }  # fmt: skip
    finally:
        engines.close()


# --------------------------------------------------------------------------------------------- rendering


def db(values: list[float] | None) -> str:
    if not values:
        return "-"
    finite = [v for v in values if not math.isinf(v)]
    if not finite:
        return "identical"
    if len(finite) < len(values):
        return f"{len(values) - len(finite)}/{len(values)} identical, min {min(finite):.1f} dB"
    mean = statistics.fmean(values)
    return f"{mean:.1f} dB" if len(values) == 1 else f"{mean:.1f} dB (min {min(values):.1f})"


def side_cells(result: dict[str, Any], steps: int) -> list[str]:
    if "error" in result:
        if result["error"].startswith("diffserve has no "):
            return [result["error"], "", "", "", "", ""]
        what = "not supported by this build" if result["implementation"] == "diffserve" else "failed"
        return [f"{what} ({result['error']})", "", "", "", "", ""]
    speedup = result.get("speedup_vs_own_exact")
    return [
        f"{result['seconds']:.2f}",
        "-" if speedup is None else f"{speedup:.2f}x",
        "not counted" if result["steps_reused"] is None else f"{result['steps_reused']:.1f} / {steps}",
        "not counted" if result["block_work"] is None else f"{100 * result['block_work']:.0f}%",
        db(result.get("psnr_vs_own_exact")),
        db(result.get("psnr_vs_diffusers_exact")),
    ]


def ratio_cells(entry: dict[str, Any]) -> tuple[str, str, str]:
    """(time ratio, PSNR gap, bar verdict) of one row."""
    ratios = entry.get("time_ratio_reference_over_diffserve")
    if not ratios:
        return "-", "-", ""
    ratio = statistics.median(ratios)
    time_cell = f"**{ratio:.2f}x** ({min(ratios):.2f}-{max(ratios):.2f})"
    ours = entry["diffserve_result"].get("psnr_vs_own_exact") or []
    theirs = entry["reference_result"].get("psnr_vs_own_exact") or []
    gap = None
    if ours and theirs:
        a, b = statistics.fmean(ours), statistics.fmean(theirs)
        if math.isinf(a) and math.isinf(b):
            gap = 0.0
        elif not (math.isinf(a) or math.isinf(b)):
            gap = a - b
        else:
            gap = math.inf if math.isinf(a) else -math.inf
    gap_cell = "-" if gap is None else f"{0.0 if abs(gap) < 0.05 else gap:+.1f} dB"
    verdict = ""
    if entry["barred"] and gap is not None:
        verdict = "PASS" if gap >= -PSNR_GAP_DB and ratio >= SPEEDUP_BAR else "MISS"
    return time_cell, gap_cell, verdict


def render(result: dict[str, Any], args: argparse.Namespace) -> list[str]:
    steps = result["request"]["num_inference_steps"]
    lines = [
        f"### {result['checkpoint']}: {result['description']}",
        "",
        f"{result['dit_parameters'] / 1e6:.1f}M-parameter DiT, {steps} steps, {len(result['prompts'])} prompt(s) x "
        f"{args.repeats} repeat(s), seed {args.seed}, fp32, {args.threads} torch thread(s)"
        + (", diffserve compiled (--compile)" if args.diffserve_compile else "")
        + (", diffusers' blocks compiled (`compile_repeated_blocks`)" if args.reference_compile else ""),
        "",
        "| method | settings | implementation | end-to-end s | speed-up vs own exact | steps reused | DiT blocks run "
        "| PSNR vs own exact | PSNR vs diffusers exact |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for entry in result["rows"]:
        head = f"| {entry['method']} | {entry['setting']} |"
        if "reference_result" in entry:
            name = {"diffusers hook": "diffusers + hook", "cache-dit": "diffusers + cache-dit"}.get(
                entry["reference"], entry["reference"]
            ) + (" (compiled)" if args.reference_compile else "")
            lines.append(
                f"{head} {name} | " + " | ".join(side_cells(entry["reference_result"], steps)) + " |"
            )
            head = "| | |"
        ours = "diffserve (--compile)" if args.diffserve_compile else "diffserve"
        lines.append(f"{head} {ours} | " + " | ".join(side_cells(entry["diffserve_result"], steps)) + " |")
        if "reference_result" in entry:
            time_cell, gap_cell, verdict = ratio_cells(entry)
            if time_cell != "-":
                bar = f" {verdict}" if verdict else ""
                lines.append(
                    f"| | | **{entry['reference']} / diffserve time**{bar} | {time_cell} | | | | "
                    f"PSNR gap {gap_cell} | |"
                )
    changed = {k: v for k, v in result.get("exact_after_the_rows_psnr", {}).items() if not math.isinf(v)}
    if changed:
        lines += [
            "",
            f"**WARNING**: exact output changed over the run (PSNR to the first exact run): {changed}",
        ]
    if result.get("mag_ratios"):
        lines += [
            "",
            f"MagCache ratios (measured by diffusers' calibration on the first prompt): {result['mag_ratios']}",
        ]
    return lines


def legend(row_baseline: bool) -> str:
    speedup = (
        "`speed-up vs own exact`: the median over runs of the same implementation's exact run, timed next to "
        "each cached run, over the cached run"
        if row_baseline
        else "`speed-up vs own exact`: against the exact row's times"
    )
    return (
        f"End-to-end s: per prompt the median of the repeats, then the mean over prompts. {speedup}. "
        "`steps reused`: steps whose "
        "last DiT block did not run (diffusers side: counted by hooks on the blocks; diffserve: its cache report). "
        "`DiT blocks run`: block forwards run as a share of all (diffusers side: blocks whose attention ran, so "
        "attention-level methods, PAB, FasterCache and diffusers' TaylorSeer, count the attention only). PSNR vs own "
        "exact: against the same implementation without a cache (diffusers' for cache-dit and the hooks). The "
        "ratio row is the reference's time over diffserve's, paired per run (median and range; > 1: diffserve "
        "faster) and the PSNR gap is diffserve's PSNR to its exact output minus the reference's to its own; "
        f"DBCache rows PASS issue 33's bar at a gap >= -{PSNR_GAP_DB:g} dB and a ratio >= {SPEEDUP_BAR:g}x."
    )


# --------------------------------------------------------------------------------------------- CLI

DEFAULT_MODEL_DIR = Path("/tmp/diffserve-bench/flux-8blocks-8x64")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoints", default="demo,flux", help="demo, flux or both (default: demo,flux)")
    p.add_argument(
        "--model-dir",
        type=Path,
        default=DEFAULT_MODEL_DIR,
        help="the FLUX-shaped checkpoint (built when missing)",
    )
    p.add_argument("--resolution", type=int, default=512, help="FLUX-shaped checkpoint's size (default: 512)")
    p.add_argument("--flux-double", type=int, default=2, help="double-stream blocks (default: 2)")
    p.add_argument("--flux-single", type=int, default=6, help="single-stream blocks (default: 6)")
    p.add_argument("--flux-heads", type=int, default=8, help="attention heads (default: 8)")
    p.add_argument("--flux-head-dim", type=int, default=64, help="head width (default: 64; FLUX.1: 128)")
    p.add_argument("--steps", type=int, default=28, help="denoising steps (default: 28, FLUX.1-dev's)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per checkpoint (default: 4)")
    p.add_argument(
        "--repeats", type=int, default=3, help="timed runs per prompt and row, after a warm-up (default: 3)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--no-row-baseline", dest="row_baseline", action="store_false",
        help="time each implementation's exact output once (the exact row) instead of next to every cached run "
        "(halves the runs; the speed-up against exact then spans the whole run's load changes)",
    )  # fmt: skip
    p.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: every core this process may use)"
    )
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of: {', '.join(METHODS)}")
    p.add_argument("--thresholds", default="0.08,0.12,0.2", help="DBCache residual_diff_threshold values")
    p.add_argument("--teacache-thresholds", default="0.25,0.4,0.6", help="TeaCache rel_l1_thresh values")
    p.add_argument(
        "--quick", action="store_true",
        help="smoke run: 12 steps, 1 prompt, 1 repeat, no per-row baseline, a tiny 8-block FLUX at 64x64; "
        "no figures to quote",
    )  # fmt: skip
    p.add_argument(
        "--diffserve-compile", action="store_true",
        help="diffserve with --compile (its regional torch.compile of the DiT's blocks, compiled at start-up, "
        "untimed)",
    )  # fmt: skip
    p.add_argument(
        "--reference-compile", action="store_true",
        help="diffusers' transformer blocks compiled (`compile_repeated_blocks`, regional torch.compile; "
        "compiled by the untimed warm-up), under cache-dit and the hooks too",
    )  # fmt: skip
    p.add_argument(
        "--json", "--out", dest="json", type=Path, default=None, help="also write the results as JSON"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.prompts, args.repeats, args.row_baseline = 12, 1, 1, False
    args.threads = args.threads or default_threads()
    args.checkpoint_list = [c.strip() for c in args.checkpoints.split(",") if c.strip()]
    args.method_list = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [c for c in args.checkpoint_list if c not in ("demo", "flux")] + [
        m for m in args.method_list if m not in METHODS
    ]
    if unknown:
        p.error(f"unknown checkpoint or method: {', '.join(unknown)}")
    args.threshold_list = [float(t) for t in args.thresholds.split(",") if t.strip()]
    args.teacache_threshold_list = [float(t) for t in args.teacache_thresholds.split(",") if t.strip()]
    if args.steps < 2 or args.prompts < 1 or args.repeats < 1 or not args.threshold_list:
        p.error("--steps >= 2, --prompts >= 1, --repeats >= 1 and at least one threshold")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("CACHE_DIT_LOG_LEVEL", "error")  # its per-call info and warning lines
    import cache_dit
    import torch

    torch.set_num_threads(args.threads)
    info = harness.machine_info() | {"cache_dit": cache_dit.__version__}
    load_before = os.getloadavg()
    started = time.perf_counter()
    results = []
    for name in args.checkpoint_list:
        ck = demo_checkpoint(args) if name == "demo" else flux_checkpoint(args)
        results.append(run_checkpoint(args, ck))
    load_after = os.getloadavg()
    lines = [
        "## Cache accelerators: diffserve against diffusers + cache-dit and diffusers' hooks",
        "",
        f"- machine: {info['cpu']}, {info['cores']} cores, torch threads {args.threads}; 1-min load average "
        f"{load_before[0]:.1f} before, {load_after[0]:.1f} after ({time.perf_counter() - started:.0f} s)",
        f"- python {info['python']}, torch {info['torch']}, diffusers {info['diffusers']}, cache-dit "
        f"{info['cache_dit']}, transformers {info['transformers']}",
        "",
    ]
    for result in results:
        lines += render(result, args) + [""]
    lines.append(legend(args.row_baseline))
    print("\n".join(lines))
    if args.json:
        harness.write_json(
            args.json,
            {"machine": info, "loadavg_1m": [load_before[0], load_after[0]],
             "settings": {k: v for k, v in vars(args).items() if k != "json"}, "checkpoints": results},
        )  # fmt: skip


if __name__ == "__main__":
    main()
