"""Running one engine over N ranks: rank 0's `DistributedRunner` broadcasts each phase as an `Op`
before running it too, and every other rank's `OpFollower` runs the same op on its mirror of the request.

After each op every rank's status is gathered on rank 0 (distributed/worker.py, the control channel),
so an error on any rank fails that op's request(s) on rank 0 with the rank's message instead of a hang.
Validation and previews stay on rank 0: they run no collective. Ops:

- `pre_denoise(request_id, params)`: validate the params rank 0 resolved (same seed: same generator and
  latents; same text: same embeddings) and run the pre-denoise phase on a new mirror.
- `denoise_step(request_ids)`: one step over the mirrors as one DiT batch; the DiT splits its work by the
  `ParallelState` in scope (CFG branch, sequence shard), and every rank ends with the same latents.
- `post_denoise(request_id)`: every rank runs the post-denoise phase on its mirror, then drops it: the
  decode is split by rows over all ranks (distributed/parallel_vae.py), each rank ends with the whole
  output and only rank 0's is used. (A VAE without a row split, or fewer latent rows than ranks, is
  decoded whole on every rank: same latency, no collective.)
- `drop(request_id)`: the request ended early on rank 0 (cancelled, failed): the mirrors are dropped.
- `load_lora` / `unload_lora` (`lora`: name, path, strict): every rank's LoRA registry does the same, in
  the same order, so adapter ids agree (an adapter read on demand from `--lora-dir` is read by every
  rank in its `pre_denoise`, which every rank runs on the same params).

Limit: an op that fails on one rank after another rank entered a collective of the same step (e.g. the
CFG all-gather) leaves that rank waiting until `--dist-timeout`; the request then fails, not hangs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TypeVar

from diffserve.configs.sampling_params import SamplingParams
from diffserve.distributed.interrupts import hold_interrupts
from diffserve.distributed.launch import RankFailedError, RankGroup
from diffserve.distributed.state import ParallelState
from diffserve.distributed.worker import (
    STOP,
    describe_error,
    exit_if_rank0_gone,
    receive_message,
    send_status,
)
from diffserve.layers.attention import AttentionBackend
from diffserve.phases import WHOLE, PhaseSpan
from diffserve.platforms.base import Platform
from diffserve.request import Req
from diffserve.runtime.contract import EnginePipeline
from diffserve.runtime.lora_registry import LoraInfo
from diffserve.runtime.runner import ModelRunner

T = TypeVar("T")
logger = logging.getLogger("diffserve.distributed")

OpKind = Literal["pre_denoise", "denoise_step", "post_denoise", "drop", "load_lora", "unload_lora"]
#: Test hook: "KIND:PROMPT" makes every worker rank raise in op KIND for a request whose prompt is PROMPT.
FAILURE_HOOK_ENV = "DIFFSERVE_TEST_WORKER_FAILURE"


@dataclass(frozen=True)
class Op:
    """One decision of rank 0, the same for every rank."""

    kind: OpKind
    request_ids: tuple[str, ...]
    params: SamplingParams | None = None
    lora: tuple[str, str, bool] | None = None  # load_lora / unload_lora: name, path, strict


class DistributedRunner(ModelRunner):
    """Rank 0's runner: each phase is broadcast, run here, then every rank's status is checked."""

    mirrors_requests = True

    def __init__(
        self,
        pipeline: EnginePipeline,
        platform: Platform,
        attention_backend: AttentionBackend,
        ranks: RankGroup,
    ) -> None:
        super().__init__(pipeline, platform, attention_backend, parallel_state=ranks.state)
        self.ranks = ranks
        #: Requests whose pre-denoise was broadcast and whose mirrors the workers still hold.
        self.mirrored: set[str] = set()

    def pre_denoise(self, req: Req, span: PhaseSpan = WHOLE) -> Req:
        """Every rank encodes the request from its params (its mirror); a request's phases run apart
        (`span`, disaggregated serving) only on one-rank engines: the other ranks have no mirror of a
        request that arrived as a hand-off."""
        if not span.whole:
            raise ValueError(
                f"this engine runs on {self.ranks.state.world_size} ranks: it runs whole requests only, "
                f"not their {span} phase (a disaggregated stage runs on one device)"
            )
        self.mirrored.add(req.request_id)
        run_here = super().pre_denoise
        return self._run(Op("pre_denoise", (req.request_id,), req.params), lambda: run_here(req))

    def denoise_step(self, reqs: list[Req], step_samples: list[float] | None = None) -> None:
        run_here = super().denoise_step
        op = Op("denoise_step", tuple(req.request_id for req in reqs))
        self._run(op, lambda: run_here(reqs, step_samples))

    def post_denoise(self, req: Req) -> Req:
        """Decoding runs on every rank, split by rows; the workers then drop their mirror."""
        run_here = super().post_denoise
        self.mirrored.discard(req.request_id)
        return self._run(Op("post_denoise", (req.request_id,)), lambda: run_here(req))

    def load_lora(self, name: str, path: str, strict: bool = True) -> LoraInfo:
        run_here = super().load_lora
        return self._run(Op("load_lora", (), lora=(name, path, strict)), lambda: run_here(name, path, strict))

    def unload_lora(self, name: str) -> None:
        run_here = super().unload_lora
        self._run(Op("unload_lora", (), lora=(name, "", True)), lambda: run_here(name))

    def release(self, req: Req) -> None:
        """Also tell the workers to drop their mirror, if they hold one. Never raises: the request has
        already ended; a broken group is logged here and fails the next op."""
        super().release(req)
        if req.request_id not in self.mirrored:
            return
        self.mirrored.discard(req.request_id)
        if self.ranks.failure is None:
            try:
                self._run(Op("drop", (req.request_id,)), lambda: None)
            except Exception:
                logger.exception("Dropping request %s on the other ranks failed", req.request_id)

    def _run(self, op: Op, run_here: Callable[[], T]) -> T:
        """Broadcast `op`, run it here, gather the ranks' statuses; raise rank 0's own error, else the
        first other rank's as RankFailedError, else return rank 0's result. A Ctrl-C meanwhile waits for
        the op's end (`hold_interrupts`): every rank is then between two ops, and can be told to stop."""
        with hold_interrupts():
            self.ranks.broadcast(op)
            try:
                result = run_here()
            except Exception as exc:
                self.ranks.gather(describe_error(exc))  # the workers report too, whatever they did
                raise
            statuses = self.ranks.gather(None)
        failed = [(rank, status) for rank, status in enumerate(statuses) if status is not None]
        if failed:
            rank, status = failed[0]
            raise RankFailedError(f"rank {rank} failed in {op.kind}: {status}")
        return result


def follow_ops(state: ParallelState, runner: ModelRunner) -> None:
    """A worker rank's loop: run each op rank 0 broadcasts and report its status, until `STOP`."""
    follower = OpFollower(runner, failure_hook=os.environ.get(FAILURE_HOOK_ENV))
    while (message := receive_message(state)) != STOP:
        if not isinstance(message, Op):
            raise RuntimeError(f"rank {state.rank} received {type(message).__name__}, not an Op, from rank 0")
        send_status(state, follower.run(message))


class OpFollower:
    """A worker's request mirrors, and how each op acts on them."""

    def __init__(self, runner: ModelRunner, failure_hook: str | None = None) -> None:
        self.runner = runner
        self.mirrors: dict[str, Req] = {}
        self.failure_hook = failure_hook

    def run(self, op: Op) -> str | None:
        """Run `op`; its error's text (logged with its traceback here), or None."""
        try:
            self._injected_failure(op)
            self._run(op)
        except Exception as exc:
            exit_if_rank0_gone()  # a collective that failed because rank 0 exited: nobody to report to
            logger.exception("op %s on requests %s failed", op.kind, ", ".join(op.request_ids))
            return describe_error(exc)
        return None

    def _run(self, op: Op) -> None:
        if op.kind == "pre_denoise":
            if op.params is None or len(op.request_ids) != 1:
                raise ValueError("pre_denoise takes one request id and its params")
            (request_id,) = op.request_ids
            req = self.mirrors[request_id] = Req(params=op.params, request_id=request_id)  # dropped by `drop`
            self.mirrors[request_id] = self.runner.pre_denoise(self.runner.validate(req))
        elif op.kind == "denoise_step":
            self.runner.denoise_step([self._mirror(request_id) for request_id in op.request_ids])
        elif op.kind == "post_denoise":
            for request_id in op.request_ids:
                req = self._mirror(request_id)
                del self.mirrors[request_id]  # dropped even when its decode fails
                self.runner.post_denoise(req)  # releases it too
        elif op.kind in ("load_lora", "unload_lora"):
            if op.lora is None:
                raise ValueError(f"{op.kind} needs the adapter's name, path and strictness")
            name, path, strict = op.lora
            if op.kind == "load_lora":
                self.runner.load_lora(name, path, strict)
            else:
                self.runner.unload_lora(name)
        elif op.kind == "drop":
            for request_id in op.request_ids:
                if (req := self.mirrors.pop(request_id, None)) is not None:
                    self.runner.release(req)
        else:
            raise ValueError(f"unknown op {op.kind!r}")

    def _mirror(self, request_id: str) -> Req:
        if request_id not in self.mirrors:
            raise RuntimeError(f"request {request_id} has no mirror on this rank (its pre-denoise never ran)")
        return self.mirrors[request_id]

    def _injected_failure(self, op: Op) -> None:
        if not self.failure_hook:
            return
        kind, _, prompt = self.failure_hook.partition(":")
        prompts = [op.params.prompt] if op.params is not None else []
        prompts += [self.mirrors[i].params.prompt for i in op.request_ids if i in self.mirrors]
        if op.kind == kind and prompt in prompts:
            raise RuntimeError(f"injected failure ({FAILURE_HOOK_ENV}={self.failure_hook})")
