"""`--compile`: regional `torch.compile` of the DiT's repeated blocks (in place; compile time is per block
class, the logic between blocks stays eager), and the start-up warm-up. `dynamic=True`, as batch shapes
keep changing: sizes stay symbolic except 0 and 1, so a block class needs one graph for one-row batches
and one for larger ones, per attention-mask kind, all built by the warm-up (`WARMUP_KINDS`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from diffserve.configs.cache_settings import NoCache
from diffserve.configs.sampling_params import SamplingParams
from diffserve.errors import InvalidRequestError, UserError
from diffserve.runtime.contract import PipelineFacts

logger = logging.getLogger("diffserve.compile")

BACKEND = "inductor"
RECOMPILE_LIMIT = 64  # graphs per block class before dynamo runs it eager
WARMUP_STEPS = 2  # so a step after the first runs compiled too
COMPILE_WARMUP_PIXELS = 64  # warm-up size without --warmup-resolutions (the graphs do not depend on it)
DIT_COMPONENT_PREFIX = "transformer"  # and Wan 2.2's `transformer_2`


@dataclass(frozen=True)
class CompiledRegion:
    path: str  # e.g. "transformer.single_transformer_blocks"
    block_class: str
    blocks: int


@dataclass(frozen=True)
class WarmupRun:
    height: int
    width: int
    kind: str
    seconds: float


def find_block_lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """The model's own block lists: direct `nn.ModuleList` children whose items share one class, not a
    plain `torch.nn` one (nested lists, like a feed-forward's `net`, compile as part of their block)."""
    found = []
    for name, child in model.named_children():
        if not isinstance(child, nn.ModuleList) or len(child) == 0:
            continue
        classes = {type(block) for block in child}
        if len(classes) == 1 and not next(iter(classes)).__module__.startswith("torch.nn"):
            found.append((name, child))
    return found


def compile_pipeline(components: Mapping[str, object]) -> list[CompiledRegion]:
    """Compile every block of every DiT's (`transformer*` components') block lists in place; UserError when
    there is nothing to compile."""
    dits = {
        name: module
        for name, module in components.items()
        if name.startswith(DIT_COMPONENT_PREFIX) and isinstance(module, nn.Module)
    }
    if not dits:
        raise UserError("--compile: this pipeline has no DiT component ('transformer*') to compile")
    config = torch._dynamo.config  # `recompile_limit` is torch >= 2.6's name of `cache_size_limit`
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, limit, max(getattr(config, limit), RECOMPILE_LIMIT))  # never lowered
    regions: list[CompiledRegion] = []
    for name, model in dits.items():
        found = find_block_lists(model)
        if not found:
            raise UserError(
                f"--compile: {name} ({type(model).__name__}) has no repeated block list to compile"
            )
        for list_name, blocks in found:
            for block in blocks:
                block.compile(backend=BACKEND, dynamic=True)
            regions.append(CompiledRegion(f"{name}.{list_name}", type(blocks[0]).__name__, len(blocks)))
    for r in regions:
        logger.info(
            "torch.compile (%s, dynamic shapes, regional): %s, %d x %s", BACKEND, r.path, r.blocks, r.block_class
        )  # fmt: skip
    logger.info("Blocks compile on first use (one graph per block class and batch kind): in the warm-up")
    return regions


def compiled_graph_count() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def log_graph_breaks() -> None:
    """Warn about each graph break dynamo has recorded (it leaves an op eager: model code to fix)."""
    from torch._dynamo.utils import counters

    for reason, count in dict(counters["graph_break"]).items():
        first_line = reason.strip().splitlines()[0] if reason.strip() else reason
        logger.warning("torch.compile graph break (%d x): %s", count, first_line)


# Warm-up generations at the first size, each building its own graphs: one DiT row; two rows with texts
# of equal length (unmasked attention); two rows with texts of different lengths (masked, e.g. Z-Image).
WARMUP_KINDS = ("no-cfg", "cfg", "cfg-uneven-text")
# The long negative prompt stays longer than the prompt after any padding to a multiple (Z-Image: 32: about
# 45 tokens to the prompt's few) and fits CLIP's 77 tokens, so no tokenizer truncates (and warns about) a
# prompt the user never wrote.
WARMUP_PROMPT = "warm-up"
WARMUP_SHORT_NEGATIVE_PROMPT = "blurry"
WARMUP_NEGATIVE_PROMPTS = {
    "cfg": WARMUP_SHORT_NEGATIVE_PROMPT,
    "cfg-uneven-text": " ".join(["blurry, low quality, distorted, oversaturated, watermark"] * 4),
}


def cfg_overrides(cfg_mode: str) -> dict[bool, dict[str, Any]]:
    """Sampling parameters that turn the CFG branch off (False: one DiT row) and on (True: two rows)."""
    if cfg_mode == "true_cfg":  # FLUX, Qwen-Image: a negative prompt and true_cfg_scale > 1
        return {
            False: {"true_cfg_scale": 1.0},
            True: {"true_cfg_scale": 2.0, "negative_prompt": WARMUP_SHORT_NEGATIVE_PROMPT},
        }
    if cfg_mode == "classic":  # SD3, Wan: guidance_scale > 1
        return {False: {"guidance_scale": 1.0}, True: {"guidance_scale": 2.0}}
    if cfg_mode == "positive_gap":  # Z-Image: guidance_scale > 0
        return {False: {"guidance_scale": 0.0}, True: {"guidance_scale": 2.0}}
    if cfg_mode == "none":  # guidance-distilled: the family's defaults are the only way it runs
        return {False: {}, True: {}}
    raise ValueError(f"unknown cfg_mode {cfg_mode!r}")


def compile_warmup_size(pixel_multiple: int) -> tuple[int, int]:
    """(height, width) of the warm-up `--compile` runs when no size is configured."""
    side = -(-COMPILE_WARMUP_PIXELS // pixel_multiple) * pixel_multiple
    return side, side


def warmup_plan(
    resolutions: Sequence[tuple[int, int]], cfg_mode: str = "true_cfg"
) -> list[tuple[int, int, str]]:
    """(height, width, kind) per warm-up generation: every `WARMUP_KINDS` at the first size (only "no-cfg"
    for a family that never runs CFG), "default" (the family's default sampling, proving the size runs)
    at the others."""
    kinds = ("no-cfg",) if cfg_mode == "none" else WARMUP_KINDS
    plan: list[tuple[int, int, str]] = []
    for i, (height, width) in enumerate(resolutions):
        plan += [(height, width, kind) for kind in kinds] if i == 0 else [(height, width, "default")]
    return plan


def warmup_params(height: int, width: int, kind: str, cfg_mode: str, video: bool) -> SamplingParams:
    """A short generation of one warm-up `kind` at one size (a one-frame clip for a video family)."""
    overrides: dict[str, Any] = {}
    if kind != "default":
        overrides = dict(cfg_overrides(cfg_mode)[kind != "no-cfg"])
    if kind in WARMUP_NEGATIVE_PROMPTS:
        overrides["negative_prompt"] = WARMUP_NEGATIVE_PROMPTS[kind]
    return SamplingParams(
        prompt=WARMUP_PROMPT, height=height, width=width, num_inference_steps=WARMUP_STEPS,
        num_frames=1 if video else None, cache=NoCache(), **overrides,
    )  # fmt: skip


def warm_up(
    generate: Callable[[SamplingParams], object], facts: PipelineFacts, resolutions: Sequence[tuple[int, int]]
) -> list[WarmupRun]:
    """Run `warmup_plan(resolutions)` through `generate`, one request each; a size the model refuses is a
    UserError naming `--warmup-resolutions`."""

    runs = []
    for height, width, kind in warmup_plan(resolutions, facts.cfg_mode):
        params = warmup_params(height, width, kind, facts.cfg_mode, facts.makes_video)
        params.input_images = facts.probe_images(width, height)
        graphs_before, start = compiled_graph_count(), time.perf_counter()
        try:
            generate(params)
        except InvalidRequestError as exc:
            raise UserError(f"--warmup-resolutions {width}x{height}: {exc}") from exc
        run = WarmupRun(height, width, kind, time.perf_counter() - start)
        logger.info(
            "Warm-up %dx%d (WxH), %s, %d steps: %.2f s, %d graphs compiled",
            width, height, kind, WARMUP_STEPS, run.seconds, compiled_graph_count() - graphs_before,
        )  # fmt: skip
        runs.append(run)
    log_graph_breaks()
    stop_compile_workers()
    return runs


def stop_compile_workers() -> None:
    """Shut down the compile-worker pool torch.compile leaves running (one still starting up takes the CPU
    from the first requests); a later compile starts a new one."""
    from torch._inductor.async_compile import shutdown_compile_workers

    shutdown_compile_workers()
    logger.info("Compile warm-up done: inductor's compile workers shut down")
