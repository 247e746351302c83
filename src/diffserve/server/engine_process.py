"""The engine process: `EngineProcess`, a thin transport around `runtime.Engine`, ZeroMQ in and the
engine's events out. The policy (validation, admission by the memory model, automatic VAE tiling) is the
runtime's, as for `DiffGenerator` and the CLI; this process only chooses when the memory model is built
(after its warm-up, calibrated).

The main thread drives the engine's loop and its event hooks answer; the receiver thread only receives:
it hands each job to the admission threads (engine_admission.py: validation and memory fitting never
hold the next message) and passes cancels on; one encoder thread writes video jobs' MP4s off the step
loop, and one LoRA thread runs the admin routes' loads and unloads between two steps (engine_loras.py).
A heartbeat thread reports how long the longest turn of the loop, the receiver or an admission has
lasted (engine_liveness.py), for the front end's watchdog. torch is imported inside `EngineProcess`,
so the front end imports this module and stays light.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq

from diffserve.configs.engine_args import EngineArgs
from diffserve.configs.sampling_params import SamplingParams
from diffserve.errors import LoraError, UserError
from diffserve.logging_setup import configure_logging
from diffserve.outputs import CONTENT_TYPES, encode_image, output_metadata, save_image, save_video
from diffserve.outputs.audio_track import save_video_with_audio
from diffserve.outputs.fmp4 import StreamedMp4File
from diffserve.outputs.images import bounded_metadata
from diffserve.phases import WHOLE, PhaseSpan
from diffserve.process_start import forget_parent
from diffserve.server import protocol as msg
from diffserve.server.engine_admission import Admissions
from diffserve.server.engine_liveness import HEARTBEAT_INTERVAL_S, Liveness
from diffserve.server.engine_loras import EngineLoras
from diffserve.server.image_files import image_path

if TYPE_CHECKING:
    from diffserve.request import Req
    from diffserve.runtime import ScheduledRequest

logger = logging.getLogger("diffserve.engine")

#: Seconds between progress lines of the requests denoising for longer (`runtime.RequestLog`).
PROGRESS_LOG_INTERVAL_S = 5.0


def preview_steps(total_steps: int, partial_images: int) -> list[int]:
    """The steps after which previews 0..k-1 are sent, evenly spaced (two may share a step)."""
    n, k = total_steps, partial_images
    return [min(n, max(1, round((i + 1) * n / (k + 1)))) for i in range(k)]


def _without_inputs(params: SamplingParams) -> SamplingParams:
    """Resolved parameters as sent back, without the (possibly large) input images the front end has (a
    ControlNet's control image and mask included)."""
    controlnets = [dataclasses.replace(c, image=None, mask=None) for c in params.controlnets]
    return dataclasses.replace(
        params, input_images=None, mask_image=None, input_video=None, controlnets=controlnets
    )


def _is_client_job(sr: ScheduledRequest) -> bool:
    """A client's request: logged by `RequestLog` (warm-up, calibration and health probes are not)."""
    return isinstance(sr.payload, msg.GenerateJob) and not sr.payload.internal


def _finished(
    sr: ScheduledRequest, encode_seconds: float, timings: dict, batching: dict[str, Any], **outputs: Any
) -> msg.JobFinished:
    req = sr.req
    return msg.JobFinished(
        sr.request_id,
        params=_without_inputs(req.params),
        timings=dict(timings),
        step_times=list(req.timings.steps),
        peak_memory_bytes=sr.peak_memory_bytes,
        engine_seconds=time.perf_counter() - sr.started_at,
        encode_seconds=encode_seconds,
        steps_computed_in_full=req.steps_computed_in_full,
        cache=req.cache_report,
        batch_sizes=list(sr.batch_sizes),
        batching=batching,
        **outputs,
    )


@dataclass
class EngineProcessConfig:
    engine_args: EngineArgs
    to_engine_address: str
    from_engine_address: str
    incarnation: int
    warmup: bool = True
    log_level: str = "info"
    progress_log_interval: float = PROGRESS_LOG_INTERVAL_S  # seconds between a long request's progress lines
    replica: int = 0  # its index among `--dp-size` replicas
    #: The accelerator indices this replica uses (`--dp-size` > 1); None: the platform's default device.
    device_indices: tuple[int, ...] | None = None


#: Each accelerator runtime's variable listing the devices a process sees (as the runtimes define them);
#: a replica narrows them to its own, so its engine's device 0 is the replica's first device.
VISIBLE_DEVICES_ENV: dict[str, str] = {
    "cuda": "CUDA_VISIBLE_DEVICES",
    "rocm": "HIP_VISIBLE_DEVICES",
    "musa": "MUSA_VISIBLE_DEVICES",
    "xpu": "ZE_AFFINITY_MASK",
    "npu": "ASCEND_RT_VISIBLE_DEVICES",
}


def pin_devices(
    device: str | None, indices: tuple[int, ...], environ: MutableMapping[str, str]
) -> dict[str, str]:
    """Narrow the visible devices of this process to `indices` (positions in what the runtime sees now:
    the user's own list when the variable is set) before any runtime starts; returns what was set.
    `device` (`--device`) picks the runtime; None (detect) narrows every runtime's list. A replica whose
    indices are beyond the devices there are sees none: its engine then fails (`--device`) or detects
    another platform, which the front end refuses (`ReplicaSet`)."""
    key = None if device is None else device.lower().partition(":")[0]
    names = [name for platform, name in VISIBLE_DEVICES_ENV.items() if key is None or platform == key]
    if key == "cuda":  # torch on ROCm answers to "cuda" too
        names.append(VISIBLE_DEVICES_ENV["rocm"])
    chosen = {}
    for name in names:
        current = environ.get(name)
        listed = current.split(",") if current else [str(i) for i in range(max(indices) + 1)]
        chosen[name] = ",".join(listed[i] for i in indices if i < len(listed))
    environ.update(chosen)
    return chosen


class Channel:
    """The engine's end of the link: PULL from the front end, PUSH to it (shared by both threads)."""

    def __init__(self, config: EngineProcessConfig) -> None:
        self.incarnation = config.incarnation
        self.context = zmq.Context()
        self.inbox = self.context.socket(zmq.PULL)
        self.inbox.connect(config.to_engine_address)
        self.outbox = self.context.socket(zmq.PUSH)
        self.outbox.setsockopt(zmq.LINGER, 2000)
        self.outbox.connect(config.from_engine_address)
        self._send_lock = threading.Lock()

    def send(self, message: Any) -> None:
        with self._send_lock:
            self.outbox.send_pyobj((self.incarnation, message))

    def recv(self, timeout_ms: int) -> Any | None:
        return self.inbox.recv_pyobj() if self.inbox.poll(timeout_ms) else None

    def close(self) -> None:
        self.inbox.close(linger=0)
        self.outbox.close()
        self.context.term()


#: How often the engine process checks its other ranks' processes (`EngineProcess._watch_ranks`).
RANK_WATCH_INTERVAL_S = 0.2


class EngineProcess:
    """The engine process's side of the link: the front end's jobs submitted to the runtime's `Engine`, and
    its events (`runtime.EngineEvents`) answered; requests without a job (warm-up, calibration) are not
    reported. `generator`: a loaded `DiffGenerator` (tests pass a stand-in), whose memory model is built
    in `start`, after the warm-up."""

    def __init__(self, config: EngineProcessConfig, channel: Channel, generator: Any = None) -> None:
        from diffserve.runtime.calibration import PROBE_PIXELS, round_up

        start = time.perf_counter()
        self.config, self.channel = config, channel
        if generator is None:
            from diffserve.api import DiffGenerator

            generator = DiffGenerator(config.engine_args, show_progress=False, memory_model=False)
        self.generator, self.engine, self.facts = generator, generator.engine, generator.pipeline.facts
        self.scheduler = self.engine.scheduler
        self.load_seconds = time.perf_counter() - start
        self.output_dir = Path(config.engine_args.output_path)
        self.stop = threading.Event()
        self.pixel_multiple = self.facts.pixel_multiple
        self.probe_size = round_up(PROBE_PIXELS, self.pixel_multiple)
        self.is_video = self.facts.makes_video
        self.probe_images = self.facts.probe_images(self.probe_size, self.probe_size)
        self.probe_mask = self.facts.probe_mask(self.probe_size, self.probe_size)
        # One thread: MP4s are written in job order, and x264 already uses several cores per file.
        self.encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="video-encoder")
        #: Video jobs whose file is being written -> their cancel flag (the job's `cancel_event`).
        self._encoding: dict[str, threading.Event] = {}
        self._encoding_lock = threading.Lock()
        #: Streamed video jobs whose decode hands out its chunks -> their file being written. Under
        #: `_encoding_lock`.
        self._streams: dict[str, StreamedMp4File] = {}
        self.engine.events = self
        #: When the loop's, the receiver's and each admission's current turn began (the heartbeat's).
        self.liveness = Liveness(describe_loop=self._describe_turn)
        #: Jobs received and being admitted, off the receiver thread.
        self.admissions = Admissions(self._admit_job, self.liveness)
        #: The LoRA admin ops (`POST/GET/DELETE /v1/loras`).
        self.loras = EngineLoras(self.engine, channel)
        from diffserve.runtime.engine import RequestLog

        self.engine.request_log = RequestLog(config.progress_log_interval, include=_is_client_job)

    def start(self) -> None:
        warmup_seconds = None
        if self.config.warmup:
            start = time.perf_counter()
            self.generator.generate_from_params(self.probe_params("warm-up"))
            warmup_seconds = time.perf_counter() - start
            logger.info("Warm-up generation done in %.2f seconds", warmup_seconds)
        # The runtime's memory model, as DiffGenerator's; calibrated at warm-up where the platform has a
        # peak counter (the CPU too, on Linux), estimated with --no-warmup or when calibration fails.
        self.generator.build_memory_model(calibrate=self.config.warmup)
        self._measure_step_curve()
        info = self.info(warmup_seconds)
        logger.info("Scheduler: %s", info["scheduler"])
        self.receiver = threading.Thread(target=self._receive_loop, name="engine-receiver", daemon=True)
        self.receiver.start()
        threading.Thread(target=self._heartbeat_loop, name="engine-heartbeat", daemon=True).start()
        if getattr(self.generator, "ranks", None) is not None:
            threading.Thread(target=self._watch_ranks, name="rank-watchdog", daemon=True).start()
        self.channel.send(msg.EngineReady(pid=os.getpid(), info=info, probe_size=self.probe_size))
        logger.info("Engine ready (pid %d)", os.getpid())

    def _measure_step_curve(self) -> None:
        """With --batch-policy auto, the warm-up's step times at batches of 1, 2, 4, ... probe requests
        (runtime/step_curve_probe.py); other sizes are measured while serving."""
        s = self.scheduler
        if not self.config.warmup or s.policy.name != "auto" or s.config.max_running_requests < 2:
            return
        from diffserve.runtime.step_curve_probe import measure_step_curve

        try:
            measure_step_curve(self.engine, self.probe_params("batch curve"), s.config.max_running_requests)
        except Exception:  # the policy measures while serving instead
            logger.exception("Batch policy: the warm-up measurement failed; measuring while serving")

    def _parallel_info(self) -> dict[str, Any]:
        """The rank layout (degrees) and the pids of this engine's other rank processes."""
        args = self.config.engine_args
        config = args.parallel_config()
        ranks = getattr(self.generator, "ranks", None)
        return {
            "num_gpus": config.num_gpus,
            "ulysses_degree": config.ulysses_degree,
            "ring_degree": config.ring_degree,
            "cfg_degree": config.cfg_degree,
            "worker_pids": [p.pid for p, _ in ranks.processes] if ranks is not None else [],
        }

    def _watch_ranks(self) -> None:
        """A rank process that died (or a rank group broken by a failed collective) leaves this engine
        unable to run any request: exit, so the front end answers what was in flight with 503
        `engine_died` and starts a new engine with new ranks (its usual restart)."""
        from diffserve.distributed.launch import RankFailedError

        while not self.stop.wait(RANK_WATCH_INTERVAL_S):
            try:
                self.generator.ranks.check_alive()  # raises once a rank exited or the group broke
            except RankFailedError as exc:
                logger.error("Engine: %s; exiting so the server restarts the engine", exc)
                exit_now(1)

    def probe_params(self, prompt: str, side: int | None = None) -> SamplingParams:
        """The warm-up's and the batch policy's probe request (`runtime.calibration.probe_params`)."""
        from diffserve.runtime.calibration import probe_params

        return probe_params(self.facts, prompt, side)

    def _describe_memory(self) -> dict[str, Any] | None:
        """The memory model as /server_info shows it, with the bytes kept for LoRA adapters."""
        memory = self.scheduler.memory
        return None if memory is None else memory.describe()

    def info(self, warmup_seconds: float | None) -> dict[str, Any]:
        """What /server_info shows of the engine."""
        import torch

        import diffserve
        from diffserve.backends import describe_backend
        from diffserve.registry import pipelines_for_task
        from diffserve.runtime.contract import resolved_params

        g, facts, s = self.generator, self.facts, self.scheduler
        probe = SamplingParams("-", input_images=self.probe_images, mask_image=self.probe_mask)
        facts.with_probe_video(probe, self.probe_size, self.probe_size, set_frames=False)  # video-to-video
        defaults = resolved_params(g.pipeline, probe).to_dict()
        defaults.pop("input_video", None)
        for key in ("prompt", "seed", "extra", "input_images", "mask_image", "loras", "controlnets"):
            defaults.pop(key, None)
        if self.probe_images:  # an edit model: its default size follows the input image
            defaults["height"] = defaults["width"] = None
        # The front end turns `seconds` into a valid num_frames with these.
        video = {k: getattr(facts, k) for k in ("temporal_factor", "max_frames", "max_fps")} if self.is_video else None  # fmt: skip
        return {
            "model_path": g.model_path,
            "family": g.family.name,
            "diffusers_pipeline": g.family.diffusers_pipeline,
            "task": g.family.task,
            "backend": describe_backend(self.config.engine_args.backend),
            "requires_input_image": bool(self.probe_images),
            "max_input_images": facts.max_input_images,
            "inpainting": facts.inpainting,  # whether /v1/images/edits takes a mask (the playground's brush)
            # What an error suggests for a task this model does not do (the front end imports no registry).
            "pipelines_for_task": {
                task: list(pipelines_for_task(task)) for task in ("image-edit", "image-to-video")
            },
            "video": video,
            "platform": g.platform.name,
            "parallel": self._parallel_info(),
            "device_name": g.platform.device_name(),
            "dtype": str(g.dtype).removeprefix("torch."),
            "pixel_multiple": self.pixel_multiple,
            "default_params": defaults,
            "load_seconds": round(self.load_seconds, 3),
            "scheduler": {
                "max_running_requests": s.config.max_running_requests,
                "max_batch_tokens": s.config.max_batch_tokens,
                "mem_fraction": self.config.engine_args.mem_fraction,
                "memory_model": self._describe_memory(),
            },
            "batching": self._batching(),
            "warmup_seconds": None if warmup_seconds is None else round(warmup_seconds, 3),
            "loras": self.loras.summary(),
            # The ControlNets requests may name (--controlnet; "default": the folder's own), each with a
            # Union ControlNet's number of control modes (None: no mode) and whether it is an inpainting one
            # (its entries need a mask); the playground lists them.
            "controlnets": [
                {
                    "name": name,
                    "modes": getattr(getattr(net, "config", None), "num_mode", None),
                    "inpainting": bool(getattr(getattr(net, "config", None), "inpainting", False)),
                }
                for name, net in getattr(g.pipeline, "controlnets", {}).items()
            ],
            "replica": self.config.replica,
            # str(): torch's version object would make the front end import torch to unpickle it.
            "versions": {"diffserve": diffserve.__version__, "torch": str(torch.__version__)},
        }

    def run_forever(self) -> None:
        while not self.stop.is_set():
            self.liveness.loop_turn()
            self.engine.run_once(timeout=0.5)
        self.admissions.shutdown()  # each job still being admitted is answered (cancelled)
        # Shutdown flagged the running requests: one more step reports them cancelled.
        self.engine.cancel_all()
        self.engine.step()
        self.encoder.shutdown(wait=True)  # files being written are finished and reported
        self.loras.close()
        self.receiver.join()  # it owns the inbox socket until it sees `stop`
        logger.debug("Engine loop ended")  # the front end logs "Engine stopped" (once) when it has exited

    def _describe_turn(self) -> str:
        """What the loop's turn is doing now, as the watchdog names it if that turn never ends."""
        running, waiting = self.scheduler.num_running, self.scheduler.num_waiting
        if not running and not waiting:
            return "the engine loop, idle"
        return f"one step of the engine loop ({running} running, {waiting} waiting)"

    def run_until_idle(self) -> None:  # tests drive the engine in-process with this
        self.engine.run_until_idle()

    def shutdown(self) -> None:
        with self.admissions.lock:  # a job being admitted now is either queued before, or sees `stop`
            self.stop.set()
            self.engine.cancel_all()  # the dropped waiting requests are reported through on_cancelled

    def _receive_loop(self) -> None:
        """Receive, and hand each job to the admission threads: nothing slow runs here, so a cancel, a
        LoRA op or the next job is taken while jobs are admitted. `_handle` does the rest."""
        while not self.stop.is_set():
            self.liveness.receiver_turn("the receiver, waiting for a message")
            message = self.channel.recv(timeout_ms=500)
            if message is None:
                continue
            self.liveness.receiver_turn(f"the receiver, handling a {type(message).__name__}")
            try:
                if isinstance(message, msg.GenerateJob):  # numbered now: it keeps its place in the queue
                    self.admissions.submit(message, self.scheduler.reserve_seq())
                else:
                    self._handle(message)
            except Exception as exc:  # one bad message must not stop the engine
                logger.exception("engine: failed to handle %s", type(message).__name__)
                if isinstance(message, msg.GenerateJob):
                    self.channel.send(msg.JobFailed(message.request_id, f"{type(exc).__name__}: {exc}"))

    def _heartbeat_loop(self) -> None:
        """Every HEARTBEAT_INTERVAL_S, the longest turn in progress (the front end's watchdog)."""
        while not self.stop.wait(HEARTBEAT_INTERVAL_S):
            stall = self.liveness.longest()
            self.channel.send(msg.EngineHeartbeat(round(stall.seconds, 3), stall.doing))

    def _admit_job(self, job: msg.GenerateJob, seq: int) -> None:
        """`Admissions`' work for one job, on an admission thread: admitted and queued, or answered."""
        try:
            with self.admissions.lock:
                dropped = self.stop.is_set() or self.admissions.cancelled(job.request_id)
            if dropped:  # cancelled, or the engine stops, before its admission began
                return self.channel.send(msg.JobCancelled(job.request_id))
            self._submit(job, seq)
        except Exception as exc:
            logger.exception("engine: failed to admit request %s", job.request_id)
            self.channel.send(msg.JobFailed(job.request_id, f"{type(exc).__name__}: {exc}"))

    def _handle(self, message: Any) -> None:
        """What one message does, on the calling thread (a job: admitted now; tests drive it so)."""
        if isinstance(message, msg.GenerateJob):
            self._submit(message)
        elif isinstance(message, msg.CancelJob):
            rid = message.request_id
            with self.admissions.lock:
                where = self.engine.cancel(rid)  # a waiting job is answered by on_cancelled
                if where is None and self.admissions.cancel(rid):  # answered once its admission ends
                    where = "being admitted"
            with self._encoding_lock:
                if where is None and rid in self._encoding:
                    self._encoding[rid].set()  # the encoder thread deletes the file and answers JobCancelled
                    where = "encoding"
            if where is not None:
                logger.info("Request %s cancelled while %s", rid, where)
        elif isinstance(message, (msg.LoadLora, msg.UnloadLora, msg.ListLoras)):
            self.loras.handle(message)
        elif isinstance(message, msg.ShutdownEngine):
            logger.info("Engine shutting down")
            self.shutdown()
        else:
            logger.warning("engine: ignoring unknown message %r", message)

    def _submit(self, job: msg.GenerateJob, seq: int | None = None) -> None:
        """Admit `job` (validation and the memory model's check: `Engine.prepare`) and queue it with
        arrival number `seq` (None: now), or answer why not: rejected, or cancelled meanwhile."""
        from diffserve.runtime import RequestTooLargeError

        rid, params = job.request_id, job.params
        if job.internal:  # /health_generate: completed as the family's probes are (inputs, frames, steps)
            from diffserve.runtime.calibration import health_probe_params

            health_probe_params(self.facts, params, self.probe_size)
        else:
            family, video = self.generator.family, job.video_path is not None
            mismatch = msg.wrong_route(family.task, family.diffusers_pipeline, video)
            if mismatch is not None:  # the front end checks first; this is the engine's own guard
                return self.channel.send(msg.JobRejected(rid, mismatch, param="model"))
        span = job.phases or WHOLE
        try:
            req = self._request_of(job, span)
        except ValueError as exc:
            logger.error("Request %s: %s", rid, exc)
            return self.channel.send(msg.JobFailed(rid, f"the request's hand-off is unusable: {exc}"))
        try:
            scheduled = self.engine.prepare(req, job.priority, payload=job, span=span)
        except RequestTooLargeError as exc:
            logger.info("Request %s refused: %s", rid, exc)
            return self.channel.send(msg.JobRejected(rid, str(exc), param=exc.param, status=413))
        except UserError as exc:
            return self.channel.send(msg.JobRejected(rid, str(exc), param=getattr(exc, "param", None)))
        with self.admissions.lock:
            if self.stop.is_set() or self.admissions.cancelled(rid):
                self.engine.discard(scheduled)  # let go of the adapters it holds
                logger.info("Request %s cancelled while it was admitted", rid)
                return self.channel.send(msg.JobCancelled(rid))
            if job.ack:  # before queueing: the main thread's JobStarted must come after it
                self.channel.send(msg.JobAccepted(rid, _without_inputs(scheduled.req.params)))
            scheduled.req.on_step = lambda req: self._on_step(job, req)
            # Only where this engine decodes (a denoise-only span's request is handed off undecoded): a
            # chunked model (SkyReels-V2 DF) decodes finished windows while it denoises.
            if job.stream_chunks and job.video_path is not None and span.runs("decode"):
                scheduled.req.on_decoded = self._chunk_publisher(job, scheduled)
            self.engine.enqueue(scheduled, seq)

    def _request_of(self, job: msg.GenerateJob, span: PhaseSpan) -> Req:
        """The job's request: a new one over its params, or, for a span after encode (disaggregated
        serving), the one its hand-off brings, its tensors on this engine's device (ValueError when the
        hand-off is missing or not for this span)."""
        from diffserve.request import Req
        from diffserve.runtime.handoff import unpack_handoff

        if span.first == "encode":
            if job.handoff is not None:
                raise ValueError("a job that starts with its encode phase brings no hand-off")
            return Req(params=job.params, request_id=job.request_id)
        if job.handoff is None or job.handoff.next_phase != span.first:
            raise ValueError(f"a job that starts with its {span.first} phase needs the hand-off for it")
        return unpack_handoff(job.handoff, self.generator.platform.device())

    def on_started(self, sr: ScheduledRequest) -> None:
        if isinstance(sr.payload, msg.GenerateJob):  # its start line: `RequestLog.started`
            self.channel.send(msg.JobStarted(sr.request_id))

    def on_cancelled(self, sr: ScheduledRequest) -> None:
        if isinstance(sr.payload, msg.GenerateJob):
            self._drop_stream(sr.request_id)
            self.channel.send(msg.JobCancelled(sr.request_id, at_step=sr.req.step_index))

    def on_failed(self, sr: ScheduledRequest, error: BaseException) -> None:
        if not isinstance(sr.payload, msg.GenerateJob):
            return
        self._drop_stream(sr.request_id)
        user_error = isinstance(error, UserError)
        if not user_error:
            logger.error("Request %s failed", sr.request_id, exc_info=error)
        message = str(error) if user_error else f"{type(error).__name__}: {error}"
        # A LoRA error once running: an adapter of --lora-dir read on first use that does not fit.
        param = "loras" if isinstance(error, LoraError) else None
        self.channel.send(msg.JobFailed(sr.request_id, message, user_error=user_error, param=param))

    def on_finished(self, sr: ScheduledRequest) -> None:
        """Decoded: encode the images and answer, or hand a video to the encoder thread."""
        job, req = sr.payload, sr.req
        if not isinstance(job, msg.GenerateJob):
            return
        if sr.span.next_phase is not None:  # its next phase runs on another engine: hand the request over
            from diffserve.runtime.handoff import pack_handoff

            handoff = pack_handoff(req, sr.span.next_phase)
            self.channel.send(
                _finished(sr, 0.0, req.timings.stages, self._batching(), images=[], handoff=handoff)
            )
            return
        if job.video_path is not None:
            # Registered before the engine frees the slot: the job stays cancellable while its file is written.
            with self._encoding_lock:
                self._encoding[sr.request_id] = sr.cancel_event
            steps = len(req.timings.steps)
            self.channel.send(msg.JobProgress(sr.request_id, steps, steps, "encoding"))
            self.encoder.submit(self._write_video, sr, job)
            return
        encode_start = time.perf_counter()
        images = self._encode(job, req.outputs.images or [], req.params)
        encode_seconds = time.perf_counter() - encode_start  # its finish line: `RequestLog.ended`, next
        self.channel.send(_finished(sr, encode_seconds, req.timings.stages, self._batching(), images=images))

    def _batching(self) -> dict[str, Any]:
        """The batch policy and its measured curve, as /server_info shows them (any thread may ask)."""
        return self.engine.scheduler.policy.describe()

    def _on_step(self, job: msg.GenerateJob, req: Any) -> None:
        """`Req.on_step`: one JobProgress per step (the last one starts decoding), and the job's previews."""
        total = req.num_steps
        phase = "decoding" if req.step_index >= total else "denoising"
        self.channel.send(msg.JobProgress(req.request_id, req.step_index, total, phase))
        steps = preview_steps(total, job.partial_images)
        indices = [i for i, step in enumerate(steps) if step == req.step_index]
        if not indices:
            return
        try:  # a preview that fails is skipped (logged): it must never fail the request
            encoded = [encode_image(image, "png") for image in self.engine.runner.preview_images(req)]
        except Exception:
            logger.exception("Request %s: preview after step %d failed", req.request_id, req.step_index)
            return
        for index in indices:
            self.channel.send(msg.JobPreview(req.request_id, index, req.step_index, total, encoded))

    def _chunk_publisher(self, job: msg.GenerateJob, sr: ScheduledRequest) -> Callable[[Any], None]:
        """A streamed job's `Req.on_decoded`, called on the decode's thread with each temporal chunk's
        pixels: the frames go to the encoder thread, which appends them to the job's file and sends them
        (`JobChunk`), while the decode goes on. If a chunk cannot be handed out, the rest of the file is
        written after the decode (`_write_video`), as for a VAE that hands out nothing."""
        rid = job.request_id

        def publish(pixels: Any) -> None:
            from diffserve.stages.video_vae_decoding import video_to_uint8

            with self._encoding_lock:
                stream = self._streams.get(rid)
                if stream is None:
                    params = sr.req.params
                    sink = self._chunk_sink(rid, params.fps)
                    path = Path(job.video_path or "")
                    stream = self._streams[rid] = StreamedMp4File(
                        path, params.fps, self._metadata(params), sink
                    )
            if not stream.live:
                return  # a chunk could not be handed out: the rest is written after the decode
            try:
                videos = video_to_uint8(pixels)
                if len(videos) != 1:
                    raise ValueError(f"a decode chunk of {len(videos)} videos")
                self.encoder.submit(stream.add_safely, videos[0])  # in order, before the job's _write_video
            except Exception:
                logger.exception(
                    "Request %s: a decoded chunk could not be streamed; the rest follows the decode", rid
                )
                stream.live = False

        return publish

    def _chunk_sink(self, rid: str, fps: int) -> Callable[..., None]:
        def send(
            index: int, start: int, count: int, data: bytes, init: bytes | None, mime: str | None
        ) -> None:
            self.channel.send(msg.JobChunk(rid, index, start, count, int(fps), data, init, mime))

        return send

    def _drop_stream(self, rid: str) -> None:
        """A streamed job ended without its file: delete what its chunks wrote (after them, in order)."""
        with self._encoding_lock:
            stream = self._streams.pop(rid, None)
        if stream is not None:
            self.encoder.submit(stream.abort)

    def _write_video(self, sr: ScheduledRequest, job: msg.GenerateJob) -> None:
        """Write the MP4 atomically, then JobFinished (or JobCancelled / JobFailed)."""
        rid, req, path = sr.request_id, sr.req, Path(job.video_path or "")
        cancelled = msg.JobCancelled(rid, at_step=len(req.timings.steps))
        with self._encoding_lock:  # the chunks its decode handed out are written: this thread ran them
            stream = self._streams.pop(rid, None)
        try:
            if sr.cancel_event.is_set():
                if stream is not None:
                    stream.abort()
                return self.channel.send(cancelled)
            videos = req.outputs.frames or []
            if len(videos) != 1:
                raise RuntimeError(f"expected one video from the pipeline, got {len(videos)}")
            frames, params = videos[0], _without_inputs(req.params)
            encode_start = time.perf_counter()
            if req.outputs.audio:  # a soundtrack (LTX-2): the MP4 carries it as an AAC track
                if stream is not None:  # its VAE hands out no chunks (they could not be this file)
                    stream.abort()
                waveform, rate = req.outputs.audio[0].numpy(), int(req.outputs.audio_sample_rate)
                save_video_with_audio(frames, path, params.fps, self._metadata(params), waveform, rate)
            elif job.stream_chunks:  # fragmented, each VAE chunk sent as it is written (outputs/fmp4.py)
                factor = int(getattr(self.facts, "temporal_factor", 1) or 1)
                if stream is None:  # no chunk handed out during the decode: all of them now
                    stream = StreamedMp4File(
                        path, params.fps, self._metadata(params), self._chunk_sink(rid, params.fps)
                    )
                elif not stream.matches(frames):
                    logger.warning("Request %s: the streamed chunks differ from the decoded clip", rid)
                logger.info(
                    "Request %s: %d of %d frames streamed as they were decoded", rid, stream.frames_written,
                    len(frames),
                )  # fmt: skip
                try:
                    stream.finish(frames, factor, sr.cancel_event.is_set)
                except InterruptedError:
                    return self.channel.send(cancelled)
            else:
                save_video(frames, path, params.fps, self._metadata(params), "mp4")
            encode_seconds = time.perf_counter() - encode_start
            if sr.cancel_event.is_set():  # cancelled while the file was written: it must not stay
                path.unlink(missing_ok=True)
                logger.info("Request %s cancelled while its video was written; file removed", rid)
                return self.channel.send(cancelled)
            num_frames, height, width, _ = frames.shape
            size = path.stat().st_size
            shape = int(num_frames), int(width), int(height)
            video = msg.EncodedVideo(str(path), size, *shape, int(params.fps))
            logger.info(
                "Request %s: video written in %.2f s (%d frames, %d bytes), %.2f s after it was submitted",
                rid, encode_seconds, num_frames, size, time.perf_counter() - sr.submitted_at,
            )  # fmt: skip
            timings = {**req.timings.stages, "VideoEncoding": encode_seconds}
            self.channel.send(
                _finished(sr, encode_seconds, timings, self._batching(), images=[], videos=[video])
            )
        except Exception as exc:
            logger.exception("Request %s failed while writing its video", rid)
            if stream is not None:
                stream.abort()
            path.unlink(missing_ok=True)
            self.channel.send(msg.JobFailed(rid, f"writing the video failed: {type(exc).__name__}: {exc}"))
        finally:
            with self._encoding_lock:
                self._encoding.pop(rid, None)

    def _metadata(self, params: SamplingParams) -> dict[str, Any]:
        """What the job's files embed, its prompts bounded (an MP4's comment as much as a PNG's chunk)."""
        family = self.generator.family
        return bounded_metadata(output_metadata(self.generator.model_path, family.diffusers_pipeline, params))

    def _encode(self, job: msg.GenerateJob, images: list, params: SamplingParams) -> list[msg.EncodedImage]:
        """The images in the job's format: bytes in the message (b64_json), or files in the output dir (url)."""
        fmt, metadata = params.output_format, self._metadata(params)
        encoded = []
        for i, image in enumerate(images):
            image_id = f"{job.request_id}-{i}"
            data: bytes | None = None
            if job.response_format == "url":
                path = image_path(self.output_dir, image_id, fmt)
                save_image(image, path, metadata, fmt, job.output_compression)
            else:
                data = encode_image(image, fmt, job.output_compression, metadata)
            encoded.append(msg.EncodedImage(data=data, image_id=image_id, content_type=CONTENT_TYPES[fmt]))
        return encoded


def _exit_with_parent() -> None:
    """Stop the engine when the front end process dies (nothing is left to report to)."""
    if (parent := multiprocessing.parent_process()) is not None:
        watch = lambda: (parent.join(), exit_now(0))  # noqa: E731
        threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def no_shared_semaphores() -> None:
    """tqdm's global lock is a multiprocessing RLock: a named semaphore, registered with the front end's
    resource tracker (shared by every process it spawns), which calls it leaked at shutdown when the
    process that made it never unlinks it (`os._exit`, a killed engine). No progress bar of this process
    is shared with another, so a thread lock serves, and no semaphore is made."""
    import tqdm

    tqdm.tqdm.set_lock(threading.RLock())


def exit_now(code: int) -> None:
    """Exit without the interpreter's teardown (seconds with torch and transformers loaded), but with
    multiprocessing's exit finalizers (they unlink this process's semaphores) and the logs flushed."""
    from multiprocessing import util

    util._run_finalizers(0)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_engine_process(config: EngineProcessConfig) -> None:
    """Target of the engine process (started by `process_start.process_context`: spawn, or a fork of the
    front end)."""
    forget_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the front end, which shuts us down
    no_shared_semaphores()
    configure_logging(config.log_level)
    _exit_with_parent()
    if config.device_indices is not None:  # before any accelerator runtime starts in this process
        chosen = pin_devices(config.engine_args.device, config.device_indices, os.environ)
        logger.info("Replica %d: devices %s", config.replica, " ".join(f"{k}={v}" for k, v in chosen.items()))
    channel, code = Channel(config), 0
    try:
        engine = EngineProcess(config, channel)
        engine.start()
    except Exception as exc:
        user_error = isinstance(exc, UserError)
        if not user_error:
            logger.exception("Engine failed to start")
        channel.send(msg.EngineFatal(str(exc) if user_error else f"{type(exc).__name__}: {exc}", user_error))
        code = 2 if user_error else 1
    else:
        try:
            engine.run_forever()
        finally:
            engine.generator.close()  # its rank processes (num_gpus > 1) stop with it, not by watchdog
    channel.close()
    exit_now(code)
