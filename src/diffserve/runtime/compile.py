"""`--compile`: regional `torch.compile` of the DiT's repeated blocks (in place; compile time is per block
class, the logic between blocks stays eager), and the start-up warm-up. `dynamic=True`, as batch shapes
keep changing: sizes stay symbolic except 0 and 1, so a block class needs one graph for one-row batches
and one for larger ones, per attention-mask kind, all built by the warm-up (`WARMUP_KINDS`).

Each compiled block is entered with the request's scope mirrored for tracing (`ScopedCompiledCall`,
`layers/trace_scope.py`): the attention backend and whether any row has LoRA are resolved when a graph
is traced and guarded, so under SDPA the graph holds SDPA itself and, without LoRA rows, plain Linears
(inductor lowers and fuses both); another backend or a LoRA batch gets its own graph. On the CPU the
graphs' fp32 matmuls run on oneDNN where a probe finds it faster than MKL (`runtime/compile_gemm.py`).

Measured and not done (issue 37, benchmarks/README.md): compiling the whole DiT (or its whole block
stack) as one graph instead of per block class ran within 1-2% of regional on the CPU, for a compile time
that grows with the depth (57 blocks for FLUX.1) against a cold start that must not grow."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from diffserve.configs.cache_settings import NoCache
from diffserve.configs.sampling_params import LoraChoice, SamplingParams
from diffserve.errors import InvalidRequestError, UserError
from diffserve.layers.attention import active_attention_backend, attention_hook_active
from diffserve.layers.attention_reuse import attention_reuse_active
from diffserve.layers.lora_rows import current_lora_rows
from diffserve.layers.trace_scope import TraceScope, resolved_for_trace
from diffserve.runtime.compile_gemm import GemmChoice, OneDnnLinearPass, choose_cpu_gemm
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
    #: Its graphs' fp32 CPU matmuls: "onednn", "mkl" (inductor's `addmm`), or "-" for a DiT that does not
    #: compute in fp32 on the CPU (inductor's own matmuls).
    cpu_gemm: str = "-"


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


def current_trace_scope() -> TraceScope:
    """The scope of the calling thread/task as compiled graphs may resolve it (`layers/trace_scope.py`)."""
    rows = current_lora_rows()
    return TraceScope(
        attention_backend=active_attention_backend().value,
        attention_hooked=attention_hook_active(),
        lora_rows=rows is not None and rows.active,
    )


class ScopedCompiledCall:
    """A block's compiled call (`torch.compile(block._call_impl)`), entered with the caller's scope
    mirrored for tracing, so that its graphs resolve the attention backend and LoRA rows at trace time
    (guarded: one graph per backend and wrapper set). During a forward in which an attention-level cache
    method may stand in for attention modules (PAB, FasterCache), the block runs eagerly (`eager`): a
    graph cannot skip a module inside it."""

    def __init__(self, compiled: Callable[..., Any], eager: Callable[..., Any]) -> None:
        self.compiled = compiled
        self.eager = eager

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if attention_reuse_active():
            return self.eager(*args, **kwargs)
        with resolved_for_trace(current_trace_scope()):
            return self.compiled(*args, **kwargs)


def _computes_fp32_on_cpu(model: nn.Module) -> bool:
    """Whether the model's floating-point weights are float32 on the CPU (where the GEMM probe applies)."""
    weights = [p for p in model.parameters() if p.is_floating_point()]
    return bool(weights) and all(p.device.type == "cpu" and p.dtype == torch.float32 for p in weights)


def compile_pipeline(components: Mapping[str, object]) -> list[CompiledRegion]:
    """Compile every block of every DiT's (`transformer*` components') block lists in place, each entered
    through a `ScopedCompiledCall`, with oneDNN matmuls when the DiT computes in fp32 on a CPU where the
    probe finds them faster; UserError when there is nothing to compile."""
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
    gemm: GemmChoice | None = None  # probed once, for the first DiT that computes in fp32 on the CPU
    for name, model in dits.items():
        found = find_block_lists(model)
        if not found:
            raise UserError(
                f"--compile: {name} ({type(model).__name__}) has no repeated block list to compile"
            )
        kernel = "-"
        if _computes_fp32_on_cpu(model):
            if gemm is None:
                gemm = choose_cpu_gemm()
                logger.info("--compile, fp32 CPU matmuls in the compiled blocks: %s", gemm.describe())
            kernel = gemm.kernel
        options = {"post_grad_custom_pre_pass": OneDnnLinearPass()} if kernel == "onednn" else None
        for list_name, blocks in found:
            for block in blocks:
                compiled = torch.compile(block._call_impl, backend=BACKEND, dynamic=True, options=options)
                # what `Module.compile` sets
                block._compiled_call_impl = ScopedCompiledCall(compiled, block._call_impl)
            regions.append(
                CompiledRegion(f"{name}.{list_name}", type(blocks[0]).__name__, len(blocks), kernel)
            )
    for r in regions:
        logger.info(
            "torch.compile (%s, dynamic shapes, regional, fp32 CPU matmuls: %s): %s, %d x %s",
            BACKEND, r.cpu_gemm, r.path, r.blocks, r.block_class,
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


def warmup_params(
    height: int, width: int, kind: str, cfg_mode: str, video: bool, frames: int = 1
) -> SamplingParams:
    """A short generation of one warm-up `kind` at one size (a clip of `frames` for a video family: its
    `PipelineFacts.probe_frames`, the fewest with a step to denoise, so the DiT's graphs are compiled)."""
    overrides: dict[str, Any] = {}
    if kind != "default":
        overrides = dict(cfg_overrides(cfg_mode)[kind != "no-cfg"])
    if kind in WARMUP_NEGATIVE_PROMPTS:
        overrides["negative_prompt"] = WARMUP_NEGATIVE_PROMPTS[kind]
    return SamplingParams(
        prompt=WARMUP_PROMPT, height=height, width=width, num_inference_steps=WARMUP_STEPS,
        num_frames=frames if video else None, cache=NoCache(), **overrides,
    )  # fmt: skip


def warmup_request(facts: PipelineFacts, height: int, width: int, kind: str) -> SamplingParams:
    """`warmup_params` completed as the family's probes are: its input images and mask, a grey clip where
    it extends a video, at least its `probe_steps` and its `probe_extra` settings."""
    params = warmup_params(height, width, kind, facts.cfg_mode, facts.makes_video, facts.probe_frames)
    params.input_images = facts.probe_images(width, height)
    params.mask_image = facts.probe_mask(width, height)  # a family whose every request carries one
    facts.with_probe_video(params, width, height)  # a family that extends a video: a grey clip
    return facts.with_probe_settings(params)


def warm_up(
    generate: Callable[[SamplingParams], object],
    facts: PipelineFacts,
    resolutions: Sequence[tuple[int, int]],
    lora: LoraChoice | None = None,
) -> list[WarmupRun]:
    """Run `warmup_plan(resolutions)` through `generate`, one request each; a size the model refuses is a
    UserError naming `--warmup-resolutions`. With `lora` (an adapter loaded at start-up), the first size's
    kinds run again applying it (kind "<kind>+lora"): batches with LoRA rows trace graphs of their own
    (`layers/trace_scope.py`), built now rather than in the first LoRA request."""

    plan = [(height, width, kind, False) for height, width, kind in warmup_plan(resolutions, facts.cfg_mode)]
    if lora is not None and resolutions:
        first = resolutions[0]
        plan += [(h, w, kind, True) for h, w, kind, _ in plan if (h, w) == first and kind != "default"]
    runs = []
    for height, width, kind, with_lora in plan:
        params = warmup_request(facts, height, width, kind)
        if with_lora:
            params.loras = [lora]
            kind = f"{kind}+lora"
        graphs_before, start = compiled_graph_count(), time.perf_counter()
        try:
            generate(params)
        except InvalidRequestError as exc:
            raise UserError(f"--warmup-resolutions {width}x{height}: {exc}") from exc
        run, steps = WarmupRun(height, width, kind, time.perf_counter() - start), params.num_inference_steps
        logger.info(
            "Warm-up %dx%d (WxH), %s, %d steps: %.2f s, %d graphs compiled",
            width, height, kind, steps, run.seconds, compiled_graph_count() - graphs_before,
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
