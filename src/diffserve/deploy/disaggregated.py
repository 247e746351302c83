"""Disaggregated serving (`diffserve serve --ray --disaggregate`; a model's `disaggregate` in the builder's
args, spec.py): a model's requests run their three phases (phases.py) in three Ray Serve deployments, each
with its own replicas and devices (encoders and VAEs on small devices, DiTs on the big ones):

- `Encoder-<model>`: `EngineReplica`s (replica.py) whose engines run each job's encode phase (validation,
  text and image encoding, latents, timesteps) and answer with the request as a `Handoff`;
- `Denoiser-<model>`: `DenoiserReplica`s (below), the deployment the ingress sends the model's jobs to
  (routed by waiting steps, router.py; autoscaled with the model's replica fields). Each runs a job's
  encode call, then its denoising steps in its own engine, where requests that arrived encoded share DiT
  batches as in one server, then its decode call;
- `Decoder-<model>`: `EngineReplica`s whose engines decode (the VAE) and encode the images or write the
  video as the single server's engine does.

A hand-off is bytes (the request with its tensors on the CPU, runtime/handoff.py) in a stage call's
arguments or answer, which Ray carries through its object store from node to node; the ingress never
sees one. The tensors arrive bit-identical, so the pixels are those of one process (a DiT batch shared
with other requests may round the last bit differently, as in one server).

To the ingress a denoiser replica is an `EngineReplica`: the same stream (`Placed`, the encoder engine's
JobAccepted with the resolved parameters, the denoiser engine's JobStarted, progress and previews, then
the JobFinished with the decoder's images, or a FinishedVideo, or a ReplicaFailure) and the same cancel,
LoRA and state calls. LoRA adapters apply to the DiT, so they load in the denoisers' engines only. A bad
request is refused by the encoder's engine (its validation) with the single server's status. A stage
replica lost before the job's denoising started counts as its replica lost before the job started (the
ingress sends the job again); after, the job ends with 503 `engine_died`.

Each stage's engine loads the whole pipeline and runs only its part of it (the loader has no
per-component selection yet); a stage's `engine_args` can keep what it never runs in host memory
(`dit_cpu_offload` for the encoder and decoder).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from ray.exceptions import RayError
from ray.serve.handle import DeploymentHandle

from diffserve.deploy.engines import outside_request
from diffserve.deploy.lora_log import LoraLog
from diffserve.deploy.messages import FinishedVideo, Placed, ReplicaFailure
from diffserve.deploy.replica import EngineReplica, JobLoad
from diffserve.phases import Handoff, Phase, PhaseSpan
from diffserve.server import protocol as msg
from diffserve.server.args import ServerArgs
from diffserve.server.engine_client import JobCancelledError

logger = logging.getLogger("diffserve.server")

#: A stage's answer: its engine's JobAccepted (the encoder's has the resolved parameters) and its result.
StageResult = tuple[msg.JobAccepted | None, msg.JobFinished | FinishedVideo]


class DenoiserReplica(EngineReplica):
    """A disaggregated model's denoiser replica: its own engine runs the jobs' denoising steps; each job's
    encode and decode run on the encoder's and decoder's deployments (module docstring)."""

    async def __init__(
        self, server_args: ServerArgs, encoder: DeploymentHandle, decoder: DeploymentHandle
    ) -> None:
        await super().__init__(server_args)
        self.encoder, self.decoder = encoder, decoder
        #: The encode or decode call each job in flight here waits for (a cancel cancels it).
        self._stage_calls: dict[str, Any] = {}
        #: Jobs cancelled here: one cancelled between two phases stops before the next.
        self._cancelled: set[str] = set()

    async def submit(self, job: msg.GenerateJob, loras: LoraLog | None = None) -> AsyncIterator[Any]:
        """Run `job`'s three phases, streaming its messages as an `EngineReplica` does (module docstring)."""
        yield Placed(self.replica_id, self.node_id)
        rid = job.request_id
        load = self.jobs[rid] = JobLoad(total=int(job.params.num_inference_steps or 0))
        try:
            async with contextlib.aclosing(self._phases(job, loras, load)) as phases:
                async for item in phases:
                    yield item
        except (asyncio.CancelledError, GeneratorExit):
            if self._stop(rid):
                logger.info("Request %s: its caller went away; cancelling it", rid)
            raise
        finally:
            self.jobs.pop(rid, None)
            self._stage_calls.pop(rid, None)
            self._cancelled.discard(rid)

    async def _phases(self, job: msg.GenerateJob, loras: LoraLog | None, load: JobLoad) -> AsyncIterator[Any]:
        """Encode (the encoder's deployment), denoise (this engine), decode (the decoder's deployment)."""
        rid, started = job.request_id, time.perf_counter()
        if loras is not None:
            try:
                await self._catch_up(loras)
            except Exception as exc:
                yield ReplicaFailure.of(exc)
                return
        encoded = await self._stage_call(self.encoder, "encode", job, started=False)
        if isinstance(encoded, ReplicaFailure):
            yield encoded
            return
        accepted, encoded_result = encoded
        if (
            accepted is None
            or not isinstance(encoded_result, msg.JobFinished)
            or encoded_result.handoff is None
        ):
            yield ReplicaFailure("failed", f"the encoder answered request {rid} without its hand-off")
            return
        load.total = load.total or int(accepted.params.num_inference_steps or 0)
        yield accepted
        if rid in self._cancelled:
            yield ReplicaFailure.of(JobCancelledError(0))
            return
        denoised: msg.JobFinished | None = None
        async with contextlib.aclosing(self._denoise(job, encoded_result.handoff, load)) as steps:
            async for item in steps:
                if isinstance(item, msg.JobFinished):
                    denoised = item
                else:
                    yield item  # the engine's JobStarted, progress and previews; or its ReplicaFailure, last
        if denoised is None:
            return
        if denoised.handoff is None:
            yield ReplicaFailure(
                "failed", f"the denoiser's engine answered request {rid} without its hand-off"
            )
            return
        if rid in self._cancelled:
            yield ReplicaFailure.of(JobCancelledError(len(denoised.step_times)))
            return
        decode_job = dataclasses.replace(job, handoff=denoised.handoff)
        decoded = await self._stage_call(self.decoder, "decode", decode_job, started=True)
        if isinstance(decoded, ReplicaFailure):
            yield decoded
            return
        peaks = [encoded_result.peak_memory_bytes, denoised.peak_memory_bytes]
        yield combined(decoded[1], denoised, time.perf_counter() - started, peaks)

    async def _denoise(self, job: msg.GenerateJob, handoff: Handoff, load: JobLoad) -> AsyncIterator[Any]:
        """The job's denoising steps in this replica's engine, where they share DiT batches with the other
        jobs': its JobStarted, progress and previews, then its JobFinished (the hand-off to decode) or a
        ReplicaFailure."""
        events: asyncio.Queue = asyncio.Queue()
        local = self._local(dataclasses.replace(job, phases=PhaseSpan.only("denoise"), handoff=handoff))
        try:
            _, outcome = await self.client.submit(local, lambda m: self._on_event(load, events, job, m))
        except Exception as exc:
            yield ReplicaFailure.of(exc)
            return
        async for item in self._follow(events, outcome, local):
            yield item

    async def _stage_call(
        self, handle: DeploymentHandle, phase: Phase, job: msg.GenerateJob, *, started: bool
    ) -> StageResult | ReplicaFailure:
        """Run `phase` of `job` on a replica of `handle`'s deployment (Ray's router picks it): its engine's
        JobAccepted and result, or the failure. `started`: whether the job's denoising had started (a
        stage replica lost before it is a replica lost before the job started: the ingress resends it)."""
        rid = job.request_id
        stage_job = dataclasses.replace(job, phases=PhaseSpan.only(phase), partial_images=0)
        stream = outside_request(handle.options(stream=True).submit.remote, stage_job)
        self._stage_calls[rid] = stream
        accepted: msg.JobAccepted | None = None
        try:
            async for item in stream:
                if isinstance(item, msg.JobAccepted):
                    accepted = item
                elif isinstance(item, (msg.JobFinished, FinishedVideo)):
                    return accepted, item
                elif isinstance(item, ReplicaFailure):
                    return item
        except RayError as exc:
            if rid in self._cancelled:
                return ReplicaFailure.of(JobCancelledError(None))
            return _stage_lost(phase, exc, started)
        finally:
            self._stage_calls.pop(rid, None)
        return _stage_lost(phase, "its stream ended without the job's outcome", started)

    def _stop(self, request_id: str) -> bool:
        """Cancel the job's stage call in flight and its steps in this engine; False: neither was."""
        call = self._stage_calls.get(request_id)
        if call is not None:
            call.cancel()
        return self.client.cancel(request_id) or call is not None

    async def cancel(self, request_id: str, *, replica_id: str) -> bool:
        """Cancel a job in flight here, in whichever phase it is; False: not in flight."""
        self._check_target(replica_id)
        if request_id not in self.jobs:
            return False
        self._cancelled.add(request_id)
        self._stop(request_id)
        return True


def _stage_lost(phase: Phase, error: BaseException | str, started: bool) -> ReplicaFailure:
    """A stage replica lost with the job's `phase` on it (Ray's first line says why)."""
    why = (str(error).strip().splitlines() or [type(error).__name__])[0]
    message = f"the replica running this request's {phase} phase was lost ({why})"
    return ReplicaFailure("died", message, "engine_died", 503, started=started)


def combined(
    decoded: msg.JobFinished | FinishedVideo,
    denoised: msg.JobFinished,
    seconds: float,
    peaks: list[int | None],
) -> msg.JobFinished | FinishedVideo:
    """The job's result as one engine would give it: the decoder's images or video and timings (the
    request's stage and step times travelled with it), the denoiser's DiT batches and cache figures, the
    highest peak memory of the three engines, and `seconds` from the encode call to the images."""
    result = decoded.result if isinstance(decoded, FinishedVideo) else decoded
    highest = [peak for peak in [*peaks, result.peak_memory_bytes] if peak is not None]
    merged = dataclasses.replace(
        result,
        batch_sizes=list(denoised.batch_sizes),
        batching=denoised.batching,
        steps_computed_in_full=denoised.steps_computed_in_full,
        cache=denoised.cache,
        peak_memory_bytes=max(highest) if highest else None,
        engine_seconds=seconds,
        handoff=None,
    )
    return FinishedVideo(merged, decoded.data) if isinstance(decoded, FinishedVideo) else merged
