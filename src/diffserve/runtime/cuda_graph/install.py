"""`--enable-cuda-graph` in the engine: the flags it cannot combine with, a `GraphRunner` per DiT
component at load, and the warm-up that captures.

Capture policy: with `--warmup-resolutions`, shapes are captured during the warm-up (every batch and
token bucket at least as large as the warm-up's calls) and a shape first seen later runs eager, logged
once as MISSED (as SGLang does: no capture stalls a served request). Without warm-up sizes, a shape is
captured the first time it runs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

from torch import nn

from diffserve.configs.engine_args import EngineArgs
from diffserve.errors import UserError
from diffserve.platforms.base import Platform
from diffserve.runtime.cuda_graph.backends import CaptureBackend, CudaGraphBackend
from diffserve.runtime.cuda_graph.buckets import Buckets
from diffserve.runtime.cuda_graph.padders import PromptPadder, padder_for
from diffserve.runtime.cuda_graph.runner import PREFIX, GraphRunner

logger = logging.getLogger("diffserve.cuda_graph")

DIT_COMPONENT_PREFIX = "transformer"  # and Wan 2.2's `transformer_2`


def check_cuda_graph_args(args: EngineArgs) -> None:
    """UserError naming the flag `--enable-cuda-graph` cannot be combined with (weights that move, or
    several ranks), before anything loads."""
    if not args.enable_cuda_graph:
        return
    conflicts = {
        "--dit-cpu-offload": args.dit_cpu_offload,
        "--dit-layerwise-offload": args.dit_layerwise_offload,
        "--offload auto": args.offload == "auto",
        "--max-memory": args.max_memory is not None,
        "--num-gpus > 1": args.num_gpus > 1,
    }
    named = [flag for flag, on in conflicts.items() if on]
    if named:
        raise UserError(
            f"--enable-cuda-graph cannot be combined with {', '.join(named)} (captured graphs read the DiT's "
            "weights where they were at capture, on one device); drop one"
        )


def install_cuda_graphs(
    components: Mapping[str, object],
    platform: Platform,
    padders: Mapping[str, PromptPadder],
    backend: CaptureBackend | None = None,
    buckets: Buckets | None = None,
) -> list[GraphRunner]:
    """A `GraphRunner` installed on every DiT component (`transformer*`), padding its calls with its padder
    in `padders` (by DiT class: the registry's `PROMPT_PADDERS`, from the families' records). UserError
    where the platform has no CUDA graphs (unless a `backend` is given: the dry run) or a DiT has no padder."""
    if backend is None and (platform.device_type != "cuda" or platform.dispatch_key != "cuda"):
        raise UserError(
            f"--enable-cuda-graph needs an NVIDIA GPU (CUDA graphs); this engine runs on "
            f"{platform.device_name()} ({platform.name})"
        )
    dits = {
        name: module
        for name, module in components.items()
        if name.startswith(DIT_COMPONENT_PREFIX) and isinstance(module, nn.Module)
    }
    if not dits:
        raise UserError("--enable-cuda-graph: this pipeline has no DiT component ('transformer*') to capture")
    runners = []
    for name, module in dits.items():
        padder = padder_for(module, padders)
        if padder is None:
            dit_class = getattr(module, "diffusers_class_name", type(module).__name__)
            raise UserError(
                f"--enable-cuda-graph: {dit_class} has no prompt padder yet (DiTs with one: "
                f"{', '.join(sorted(padders))})"
            )
        device_backend = backend or CudaGraphBackend(platform.device())
        runners.append(GraphRunner(module, padder, device_backend, buckets, name=name).install())
        logger.info(
            "%s %s: breakable CUDA graphs on (%s padder, batch buckets %s, token buckets %s, %s)",
            PREFIX, name, padder.contract, list(runners[-1].buckets.batch), list(runners[-1].buckets.tokens),
            device_backend.name,
        )  # fmt: skip
    return runners


@contextmanager
def warmup_capture(runners: Sequence[GraphRunner], sizes_given: bool) -> Iterator[None]:
    """Capture on during the block (the warm-up); after it, capture stays on only when no warm-up sizes
    were given (`sizes_given` False: shapes are captured on first use). Logs what was captured."""
    for runner in runners:
        runner.capture_enabled = True
    try:
        yield
    finally:
        for runner in runners:
            runner.capture_enabled = not sizes_given
            counts = runner.summary()
            policy = (
                "unseen shapes run eager (MISSED)"
                if sizes_given
                else "unseen shapes are captured on first use"
            )
            logger.info(
                "%s %s: warm-up captured %d shapes (%d failed); %s", PREFIX, runner.name, counts["captured"],
                counts["capture_failed"], policy,
            )  # fmt: skip
