"""`ModelRunner`: the part of the engine that touches models, one pipeline phase at a time, inside
`model_scope()` (the attention backend, and with several ranks this rank's `ParallelState`); step times
come from `StepTimer` marks (no host sync per step). Every rank has one: rank 0's is a
`DistributedRunner` (runtime/distributed_runner.py) that also tells the other ranks what to run."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from typing import ClassVar

from PIL import Image

from diffserve.configs.sampling_params import LoraChoice
from diffserve.distributed.state import ParallelState, current_parallel_state, parallel_scope
from diffserve.errors import LoraError
from diffserve.layers.attention import AttentionBackend, attention_backend_scope
from diffserve.layers.lora_rows import LoraRows, lora_rows_scope
from diffserve.phases import WHOLE, PhaseSpan
from diffserve.platforms.base import Platform
from diffserve.platforms.step_timer import StepTimer
from diffserve.request import Req, one_branch, stepped_fields
from diffserve.runtime.contract import EnginePipeline
from diffserve.runtime.lora_registry import LoraInfo, LoraRegistry


@dataclass(eq=False)
class CfgBranchView(Req):
    """One CFG branch of `source` (0: positive, 1: negative), presented as a request without CFG: the other
    branch runs on the other cfg rank (CFG-parallel), or, with `negative_approximated`, not at all this step
    (its cache approximates the negative branch from the view's prediction: FasterCache)."""

    source: Req | None = None
    branch: int = 0  # its `cfg_scale` is the request's
    negative_approximated: bool = False


def splits_branches(req: Req, state: ParallelState | None) -> bool:
    """Whether this request's two CFG branches run on different cfg ranks (distributed/cfg_parallel.py).
    A request with skip-layer guidance keeps both on one rank: its extra forward reads the prompt branch."""
    return (
        state is not None
        and state.cfg_degree == 2
        and bool(req.do_cfg)
        and req.step_cache is None
        and not req.params.skip_guidance_layers
    )


def skips_negative_branch(req: Req) -> bool:
    """Whether this step of `req` runs its prompt branch alone, its cache approximating the negative one
    (decided now, once per step: `UnconditionalBranch.decide`)."""
    if not req.do_cfg or req.step_cache is None or req.step_cache.unconditional is None:
        return False
    timestep = req.host_timestep
    if timestep is None:
        raise RuntimeError(f"cache method {req.step_cache.method!r} needs the step's timestep")
    return req.step_cache.unconditional.decide(timestep)


def branch_view(req: Req, branch: int, negative_approximated: bool = False) -> CfgBranchView:
    """A view of `req` that carries only `branch`'s text states (0: the prompt's, 1: the negative one's).

    Which fields those are is declared, not listed here: every field with a `negative_of` role, on `Req`
    and on the request's conditioning (`request.one_branch`), so a family's own text branches (LTX-2's
    audio text, HunyuanVideo 1.5's glyph states and masks) follow without a line in the runtime. The
    view's conditioning is a copy with that branch's values; what it does not swap is shared."""
    values = {f.name: getattr(req, f.name) for f in fields(Req)}
    values.update(one_branch(req, branch))
    if req.conditioning is not None:
        values["conditioning"] = replace(req.conditioning, **one_branch(req.conditioning, branch))
    values.update(
        do_cfg=False,
        dit_context=None,  # the view embeds its own branch once, and keeps it
        on_step=None,
    )
    return CfgBranchView(**values, source=req, branch=branch, negative_approximated=negative_approximated)


def copy_step_state(source: Req, target: Req) -> None:
    """Copy what a denoising step advances (fields with a `stepped` role, on `Req` and on the
    conditioning) from `source` to `target`: into a view before its step, back to the request after."""
    for name in stepped_fields(source):
        setattr(target, name, getattr(source, name))
    if source.conditioning is not None and target.conditioning is not None:
        for name in stepped_fields(source.conditioning):
            setattr(target.conditioning, name, getattr(source.conditioning, name))


class CfgBranchViews:
    """One rank's views of the CFG requests it is running, by request id (dropped by `release`): the
    CFG-parallel ones, and the prompt-branch views of requests skipping their negative branch this step."""

    def __init__(self) -> None:
        self._views: dict[str, CfgBranchView] = {}

    def __len__(self) -> int:
        return len(self._views)

    def enter(self, reqs: list[Req]) -> list[Req]:
        """The requests as this rank's denoiser should see them for one step: a synced view in place of
        each request whose branches are split, the request itself otherwise."""
        state = current_parallel_state()
        batch: list[Req] = []
        for req in reqs:
            if skips_negative_branch(req):
                batch.append(self._view(req, 0, negative_approximated=True))
            elif splits_branches(req, state):
                assert state is not None
                batch.append(self._view(req, state.cfg_rank))
            else:
                batch.append(req)
        return batch

    def _view(self, req: Req, branch: int, negative_approximated: bool = False) -> CfgBranchView:
        """The request's kept view of `branch` (made at its first use), synced for this step."""
        view = self._views.get(req.request_id)
        if view is None or view.source is not req:
            view = self._views[req.request_id] = branch_view(req, branch, negative_approximated)
        copy_step_state(req, view)
        return view

    @staticmethod
    def leave(batch: list[Req]) -> None:
        """Copy each view's advanced step state back to its request."""
        for view in batch:
            if isinstance(view, CfgBranchView):
                assert view.source is not None
                copy_step_state(view, view.source)

    def release(self, request_id: str) -> None:
        self._views.pop(request_id, None)


def batch_lora_rows(batch: list[Req]) -> LoraRows | None:
    """Each DiT row's adapters for a batch built as `pipelines/cfg_batch.py` builds it (per request its
    prompt rows, then its negative-prompt rows: the same adapters); None when no request has any."""
    if not any(req.loras for req in batch):
        return None
    rows = []
    for req in batch:
        rows += [req.loras] * (req.batch_size * (2 if req.do_cfg else 1))
    return LoraRows.for_rows(rows)


class ModelRunner:
    #: Whether other ranks hold a mirror of each request (made by `pre_denoise`): a request copied on this
    #: rank alone would be unknown to them.
    mirrors_requests: ClassVar[bool] = False

    def __init__(
        self,
        pipeline: EnginePipeline,
        platform: Platform,
        attention_backend: AttentionBackend,
        parallel_state: ParallelState | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.platform = platform
        self.attention_backend = AttentionBackend(attention_backend)
        self.parallel_state = parallel_state
        self.step_timer = StepTimer(platform)
        #: CFG-parallel: this rank's one-branch views of the CFG requests it runs (distributed/cfg_parallel.py).
        self.cfg_views = CfgBranchViews()
        #: The LoRA adapters of this rank's model (None: the pipeline takes none, e.g. a test double).
        self.loras: LoraRegistry | None = None

    @contextmanager
    def model_scope(self) -> Iterator[AttentionBackend]:
        """The scope this runner's model calls run in; enter it around any other call into the models."""
        with parallel_scope(self.parallel_state), attention_backend_scope(self.attention_backend) as backend:
            yield backend

    def validate(self, req: Req) -> Req:
        with self.model_scope():
            return self.pipeline.validate(req)

    def pre_denoise(self, req: Req, span: PhaseSpan = WHOLE) -> Req:
        """The request's pre-denoise phase (encoding), its adapters pinned first where it denoises (read
        now if only named in `--lora-dir`). `span` (phases.py): the phases this engine runs for it; one
        that arrived as a hand-off (span after encode) was encoded by another engine: only its adapters
        are pinned."""
        pin = span.runs("denoise") and bool(req.params.loras)
        req.loras = self._lora_registry().acquire(req.params.loras) if pin else ()
        if not span.runs("encode"):
            return req
        with self.model_scope():
            return self.pipeline.run_pre_denoise(req)

    def denoise_step(self, reqs: list[Req], step_samples: list[float] | None = None) -> None:
        """One DiT batch over `reqs`; each request's `timings.steps`, and `step_samples` (the batch policy's
        curve), get this step's time when it is known. Each row applies its request's LoRA adapters (none:
        the base weights)."""
        with self.model_scope():
            start = self.step_timer.start()
            batch = self.cfg_views.enter(reqs)  # `reqs` itself unless CFG-parallel splits some
            with lora_rows_scope(batch_lora_rows(batch)):
                self.pipeline.denoise_step(batch)
            self.cfg_views.leave(batch)
            samples = () if step_samples is None else (step_samples,)
            self.step_timer.stop(start, *(req.timings.steps for req in reqs), *samples)

    def post_denoise(self, req: Req) -> Req:
        self.release(req)
        with self.model_scope():
            return self.pipeline.run_post_denoise(req)

    def release(self, req: Req) -> None:
        """The request has left the denoising loop (finished, cancelled or failed): drop what this runner
        kept for it, and unpin its adapters (once)."""
        self.cfg_views.release(req.request_id)
        if req.loras and self.loras is not None:
            self.loras.release(req.loras)
        req.loras = ()

    # -- LoRA adapters (runtime/lora_registry.py) ----------------------------------------------------

    def _lora_registry(self) -> LoraRegistry:
        if self.loras is None:
            raise LoraError("this pipeline takes no LoRA adapters")
        return self.loras

    def check_loras(self, choices: list[LoraChoice]) -> None:
        """LoraError unless every adapter a request names is loaded or can be read from `--lora-dir`."""
        if choices:
            self._lora_registry().check_known([c.name for c in choices])

    def load_lora(self, name: str, path: str, strict: bool = True) -> LoraInfo:
        return self._lora_registry().load(name, path, strict)

    def unload_lora(self, name: str) -> None:
        self._lora_registry().unload(name)

    def merge_loras(self, choices: list[LoraChoice]) -> None:
        self._lora_registry().merge(choices)

    def lora_infos(self) -> list[LoraInfo]:
        return [] if self.loras is None else self.loras.infos()

    def preview_images(self, req: Req) -> list[Image.Image]:
        """What the request's outputs would be if sampling stopped after its current step."""
        with self.model_scope():
            return self.pipeline.preview_images(req)

    def flush_step_times(self) -> None:
        self.step_timer.flush()

    def reset_peak_memory(self) -> None:
        self.platform.reset_peak_memory()

    def peak_memory_bytes(self) -> int | None:
        return self.platform.memory_info().peak_bytes
