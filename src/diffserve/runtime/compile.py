"""`--compile`: regional `torch.compile` of the DiT's repeated blocks, and the start-up warm-up.

What is compiled
    Every DiT of the pipeline (the components named `transformer*`: FLUX, SD3, Qwen-Image, Z-Image,
    Wan T2V/I2V) is searched for its block lists: the `nn.ModuleList`s held directly by the model whose
    items are all instances of one (non-`torch.nn`) class, e.g. FLUX's `transformer_blocks` and
    `single_transformer_blocks`, Z-Image's `noise_refiner`, `context_refiner` and `layers`, Wan's
    `blocks`. Each block gets `block.compile(backend="inductor", dynamic=True)`, in place (names,
    attributes and state dict unchanged). Dynamo keys its cache on the code object and, with
    nn-module inlining (always on in torch >= 2.5), treats a block's parameters as graph inputs, so
    all 38 single-stream blocks of FLUX.1 share one compiled graph: compile time is per block
    *class*, not per block. Everything between the blocks (embedders, RoPE tables, the step cache's
    row selection, the output head) stays eager: a few percent of a step, and keeping it out of the
    graph keeps the per-request Python logic (and its graph breaks) out too.

What it gains (fp32 CPU, 2 threads, 36M-parameter FLUX at 256x256, one DiT forward, wall time on a
shared machine, so +-5%): the compiled blocks are 1.05-1.10x faster than eager diffserve, about as
fast as diffusers' whole-model `torch.compile`, 1.10-1.15x faster than eager diffusers. Inductor fuses
the elementwise work (norms, modulation, gating, GELU); the matmuls (~60% of a compiled step, at
MKL's rate) and SDPA (~22%) stay the same kernels, which bounds any compile gain on CPU
(`benchmarks/bench_speed.py` measures it per checkpoint and size).

Dynamic shapes: `dynamic=True` (the choice)
    A DiT batch changes shape all the time in serving: its rows are requests x CFG branches x outputs
    (the step scheduler batches several requests, an approximate-quality request runs the blocks for
    a sub-batch of rows only), its tokens follow the resolution, and Qwen-Image / Z-Image text lengths
    follow the prompt. The options, with what `TORCH_LOGS=recompiles` shows for them:

    - `dynamic=False`: one graph per distinct (rows, tokens) shape. Every new batch size or prompt
      length recompiles mid-serving (tens of seconds on CPU), and past `recompile_limit` graphs
      dynamo runs that block eager from then on (with one warning).
    - `dynamic=None` (automatic): the first shape compiles static; the first call at another shape
      recompiles with the changed dimensions symbolic. That second compile lands in whichever request
      first brings a new shape (the "second call slower than eager" seen before), and each newly
      varying dimension costs one more compile later.
    - `dynamic=True`: sizes are symbolic from the first compile. Dynamo still specializes sizes 0 and
      1, so a block class gets one graph for a one-row batch and one for every larger batch, at any
      resolution, frame count and text length: measured on all six families' tiny checkpoints, no
      recompile after the warm-up for new sizes, batch sizes, CFG on/off or prompt lengths. The
      symbolic-size kernels ran as fast as static ones (36M FLUX above; the hidden width, which the
      vectorized loops run over, comes from the weights and stays static). RoPE rotates in real
      arithmetic under compile (`RotaryEmbedding.forward`): inductor cannot generate complex ops, and
      with the head width static the real form fuses into the QK-norm kernel, vectorized (measured
      as fast as the eager complex kernel it replaces, same values).

    So: `dynamic=True`, and the warm-up runs each `WARMUP_KINDS` batch (one row; two rows with texts
    of equal length; two rows with texts of different lengths, which masked-attention families such
    as Z-Image compile separately), building every graph before the first request (`warmup_plan`).
    Since the graphs do not depend on the size, `--compile` without `--warmup-resolutions` warms up
    at a small size (`COMPILE_WARMUP_PIXELS`): the generator is compiled for every size once constructed.
    After the warm-up, inductor's compile-worker processes are shut down (`stop_compile_workers`).
    `recompile_limit` is raised to `RECOMPILE_LIMIT` (never lowered): a block class called with
    different argument kinds (Z-Image's refiners with and without modulation, Wan I2V with or
    without image tokens) has a graph per kind, and a graph break doubles them.

Not used (measured):
    - inductor `freezing`: constant weights give MKL-packed matmuls on CPU (the step ~5% faster), but
      dynamo then guards on each block's parameters by identity, so every block instance compiles its
      own graph (57 compiles for FLUX.1, past the recompile limit), and the packed copies double the
      blocks' weight memory. (Packing the weights once in eager code would get the same ~9% on the
      matmuls without compiling: a layer change, not a compile option.)
    - `mode="max-autotune-no-cudagraphs"` on CPU: its GEMM template lost to MKL on every DiT shape
      (autotune picked MKL) for minutes more compile time.
    - compiling the whole DiT: one graph per model instead of per block class, so compile time grows
      with depth, the per-request logic around the blocks breaks the graph anyway, and what it could
      fuse across block boundaries is one pass over the activations per block.
    - an inductor post-grad pass splitting `addmm(bias, x, w)` into `mm` + a bias add folded into the
      consuming pointwise kernel (inductor does this on GPUs only; ATen's CPU addmm first copies the
      broadcast bias into the output, ~6% of a compiled step in the profiler): 0-1% in one process,
      within noise.
    - `guard_filter_fn=skip_guard_on_all_nn_modules_unsafe` (cheaper dynamo guards per block call):
      no measurable change, and unsafe for block classes whose graph depends on a module attribute
      (Z-Image's `modulation`).

Compilation happens in the warm-up: each warm-up generation is timed and logged with the number of
graphs dynamo built during it, then a warning per graph break (a graph break splits a block into several graphs
and leaves the op that caused it eager: it points at model code to fix).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from diffserve.configs.sampling_params import SamplingParams
from diffserve.errors import InvalidRequestError, UserError
from diffserve.runtime.contract import PipelineFacts

logger = logging.getLogger("diffserve.compile")

BACKEND = "inductor"
#: Graphs dynamo may build per compiled code object (per block class) before it gives up on it.
RECOMPILE_LIMIT = 64
#: Denoising steps of one warm-up generation: two, so a step after the first runs compiled too.
WARMUP_STEPS = 2
#: `--compile` without `--warmup-resolutions` warms up at about this many pixels wide (rounded up to the
#: model's granularity): the compiled graphs do not depend on the size, so a small one builds them.
COMPILE_WARMUP_PIXELS = 64
#: Prefix of the component names that hold a DiT (`transformer`, and Wan 2.2's `transformer_2`).
DIT_COMPONENT_PREFIX = "transformer"


@dataclass(frozen=True)
class CompiledRegion:
    """One block list that was compiled: where it is, what class its blocks are, how many."""

    path: str  # e.g. "transformer.single_transformer_blocks"
    block_class: str
    blocks: int


@dataclass(frozen=True)
class WarmupRun:
    """One warm-up generation: its size, its kind (`WARMUP_KINDS`, or "default": the family's default
    sampling) and its wall time (compilation included)."""

    height: int
    width: int
    kind: str
    seconds: float


def find_block_lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """The model's own block lists: direct `nn.ModuleList` children whose items share one class.

    Only direct children: nested lists inside a block (a feed-forward's `net`, an attention's
    `to_out`) are compiled as part of their block. Lists of plain `torch.nn` layers are not blocks.
    """
    found = []
    for name, child in model.named_children():
        if not isinstance(child, nn.ModuleList) or len(child) == 0:
            continue
        classes = {type(block) for block in child}
        if len(classes) == 1 and not next(iter(classes)).__module__.startswith("torch.nn"):
            found.append((name, child))
    return found


def raise_recompile_limit(limit: int = RECOMPILE_LIMIT) -> None:
    """Let dynamo keep up to `limit` graphs per code object (never lowers a larger setting)."""
    config = torch._dynamo.config
    # `recompile_limit` is the torch >= 2.6 name of `cache_size_limit` (still accepted as an alias).
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), limit))


def compile_block_lists(model: nn.Module, prefix: str = "", *, dynamic: bool = True) -> list[CompiledRegion]:
    """`block.compile(backend="inductor", dynamic=dynamic)` for every block of every block list.

    In place: the blocks stay where they are (state-dict names, attribute access, hooks unchanged);
    calling one now goes through its compiled `_call_impl`.
    """
    regions = []
    for name, blocks in find_block_lists(model):
        for block in blocks:
            block.compile(backend=BACKEND, dynamic=dynamic)
        path = f"{prefix}.{name}" if prefix else name
        regions.append(CompiledRegion(path, type(blocks[0]).__name__, len(blocks)))
    return regions


def dit_components(components: dict[str, Any]) -> dict[str, nn.Module]:
    """The pipeline's DiTs by component name (values are `LoadedComponent`s or the modules themselves)."""
    dits = {}
    for name, component in components.items():
        module = getattr(component, "value", component)
        if name.startswith(DIT_COMPONENT_PREFIX) and isinstance(module, nn.Module):
            dits[name] = module
    return dits


def compile_pipeline(components: dict[str, Any]) -> list[CompiledRegion]:
    """Compile the block lists of every DiT among `components`; log what was compiled.

    Raises UserError when a DiT has no block list (nothing would be compiled: `--compile` would
    silently do nothing).
    """
    dits = dit_components(components)
    if not dits:
        raise UserError("--compile: this pipeline has no DiT component ('transformer*') to compile")
    raise_recompile_limit()
    regions: list[CompiledRegion] = []
    for name, model in dits.items():
        found = compile_block_lists(model, prefix=name)
        if not found:
            raise UserError(
                f"--compile: {name} ({type(model).__name__}) has no repeated block list to compile"
            )
        regions += found
    for region in regions:
        logger.info(
            "torch.compile (%s, dynamic shapes, regional): %s, %d x %s",
            BACKEND,
            region.path,
            region.blocks,
            region.block_class,
        )
    logger.info("Blocks compile on first use (one graph per block class and batch kind): in the warm-up")
    return regions


def compiled_graph_count() -> int:
    """Graphs dynamo has built in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def log_graph_breaks() -> dict[str, int]:
    """Warn about graph breaks dynamo has recorded so far (each splits a compiled block); returns them."""
    from torch._dynamo.utils import counters

    breaks = dict(counters["graph_break"])
    for reason, count in breaks.items():
        first_line = reason.strip().splitlines()[0] if reason.strip() else reason
        logger.warning("torch.compile graph break (%d x): %s", count, first_line)
    return breaks


# ------------------------------------------------------------------------------------------ warm-up


#: The warm-up generations at the first size, each selecting graphs the others do not:
#: - "no-cfg": one DiT row, the graphs specialized to a one-row batch;
#: - "cfg": two rows whose texts have the same length, the graphs of every larger batch (several
#:   outputs, batched requests, step-cache sub-batches) with unmasked attention;
#: - "cfg-uneven-text": two rows whose texts differ in length, the same with masked attention (families
#:   that keep each row's own text length, such as Z-Image, mask the padding of the shorter one).
WARMUP_KINDS = ("no-cfg", "cfg", "cfg-uneven-text")
#: The warm-up prompt, and the negative prompts of the "cfg" and "cfg-uneven-text" runs: the long one
#: stays longer than the prompt after any family pads texts to a multiple (Z-Image: 32 tokens).
WARMUP_PROMPT = "warm-up"
WARMUP_SHORT_NEGATIVE_PROMPT = "blurry"
WARMUP_NEGATIVE_PROMPTS = {
    "cfg": WARMUP_SHORT_NEGATIVE_PROMPT,
    "cfg-uneven-text": " ".join(["blurry, low quality, distorted, oversaturated, watermark"] * 12),
}


def cfg_overrides(cfg_mode: str) -> dict[bool, dict[str, Any]]:
    """Sampling parameters that turn the negative (CFG) branch off (False) and on (True), per
    `InputValidationStage.cfg_mode`: without it a request is one DiT row, with it two."""
    if cfg_mode == "true_cfg":  # FLUX, Qwen-Image: a negative prompt and true_cfg_scale > 1
        return {
            False: {"true_cfg_scale": 1.0},
            True: {"true_cfg_scale": 2.0, "negative_prompt": WARMUP_SHORT_NEGATIVE_PROMPT},
        }
    if cfg_mode == "classic":  # SD3, Wan: guidance_scale > 1
        return {False: {"guidance_scale": 1.0}, True: {"guidance_scale": 2.0}}
    if cfg_mode == "positive_gap":  # Z-Image: guidance_scale > 0
        return {False: {"guidance_scale": 0.0}, True: {"guidance_scale": 2.0}}
    raise ValueError(f"unknown cfg_mode {cfg_mode!r}")


def compile_warmup_size(pixel_multiple: int) -> tuple[int, int]:
    """(height, width) of the warm-up `--compile` runs when no size is configured."""
    side = -(-COMPILE_WARMUP_PIXELS // pixel_multiple) * pixel_multiple
    return side, side


def warmup_plan(resolutions: Sequence[tuple[int, int]]) -> list[tuple[int, int, str]]:
    """(height, width, kind) per warm-up generation: every `WARMUP_KINDS` at the first size, and one
    with the family's default sampling ("default") at every other size.

    Sizes are symbolic in every graph, so later sizes need no new graphs: their generation warms the
    allocator and proves the size runs.
    """
    plan: list[tuple[int, int, str]] = []
    for i, (height, width) in enumerate(resolutions):
        plan += [(height, width, kind) for kind in WARMUP_KINDS] if i == 0 else [(height, width, "default")]
    return plan


def warmup_params(height: int, width: int, kind: str, cfg_mode: str, video: bool) -> SamplingParams:
    """A short generation of one warm-up `kind` at one size. A video family gets a one-frame clip: the
    size sets its tokens per frame, and the graphs are shape-generic along the frame axis as along
    any other."""
    overrides: dict[str, Any] = {}
    if kind != "default":
        overrides = dict(cfg_overrides(cfg_mode)[kind != "no-cfg"])
    if kind in WARMUP_NEGATIVE_PROMPTS:
        overrides["negative_prompt"] = WARMUP_NEGATIVE_PROMPTS[kind]
    return SamplingParams(
        prompt=WARMUP_PROMPT, height=height, width=width, num_inference_steps=WARMUP_STEPS,
        num_frames=1 if video else None, **overrides,
    )  # fmt: skip


def with_probe_image(params: SamplingParams, facts: PipelineFacts) -> SamplingParams:
    """`params`, plus plain input images of the output size when the family requires them (edit and
    image-to-video models)."""
    from PIL import Image

    if facts.min_input_images > 0:
        size = (int(params.width or facts.pixel_multiple), int(params.height or facts.pixel_multiple))
        params.input_images = [Image.new("RGB", size, (128, 128, 128)) for _ in range(facts.min_input_images)]
    return params


def warm_up(
    generate: Callable[[SamplingParams], object],
    facts: PipelineFacts,
    resolutions: Sequence[tuple[int, int]],
) -> list[WarmupRun]:
    """Run `warmup_plan(resolutions)` through `generate` (one request each); log and return each run.

    A size the model refuses is a UserError naming `--warmup-resolutions` (found at start-up, not at
    the first request).
    """
    runs = []
    for height, width, kind in warmup_plan(resolutions):
        params = with_probe_image(
            warmup_params(height, width, kind, facts.cfg_mode, facts.makes_video), facts
        )
        graphs_before, start = compiled_graph_count(), time.perf_counter()
        try:
            generate(params)
        except InvalidRequestError as exc:
            raise UserError(f"--warmup-resolutions {width}x{height}: {exc}") from exc
        run = WarmupRun(height, width, kind, time.perf_counter() - start)
        logger.info(
            "Warm-up %dx%d (WxH), %s, %d steps: %.2f s, %d graphs compiled",
            width,
            height,
            kind,
            WARMUP_STEPS,
            run.seconds,
            compiled_graph_count() - graphs_before,
        )
        runs.append(run)
    log_graph_breaks()
    stop_compile_workers()
    return runs


def stop_compile_workers() -> None:
    """Shut down inductor's pool of compile-worker processes once the warm-up has compiled everything.

    torch.compile starts the pool on its first compile and leaves it running. When the compile is
    quick (inductor's on-disk cache hits), the pool is still starting up when requests arrive: each
    worker imports torch, and on a small CPU machine that took the CPU from the first requests'
    denoising steps for up to ~25 s (a compiled step measured over 10x slower meanwhile). A later
    compile, if any, starts a new pool.
    """
    from torch._inductor.async_compile import shutdown_compile_workers

    shutdown_compile_workers()
    logger.info("Compile warm-up done: inductor's compile workers shut down")
