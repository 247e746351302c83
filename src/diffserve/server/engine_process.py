"""The engine process: loads the model once, then runs the front end's requests with step-level batching.

Two threads:
- the main thread drives the generator's engine: `runtime.Engine.step()` (diffserve/runtime/engine.py),
  the same loop `DiffGenerator` and the CLI run, over and over. Each iteration admits waiting requests (JobStarted), runs one denoising step for one group
  of running requests of the same shape as one DiT batch (JobProgress per request, JobPreview when a
  job asked for partial images), and decodes the requests whose steps are done (JobFinished). Several
  requests run at once (`--max-running-requests`, `--max-batch-tokens`, `--mem-fraction`); with
  `--max-running-requests 1` this is the one-request-at-a-time engine.
- the receiver thread reads the front end's messages: a GenerateJob is validated once by the engine
  (`Engine.prepare`: family defaults applied, `SamplingParams.validate`), costed against the memory
  model, and queued, or answered at
  once with JobRejected (400; 413 when it can never fit in memory); a CancelJob drops a waiting
  request or flags a running one, which leaves the running set at its next step boundary (the others
  in its batch carry on); ShutdownEngine stops the loop.
- one video-encoder thread (a ThreadPoolExecutor) writes the MP4s of video jobs: once a video job's
  frames are decoded, the main thread hands them over and moves on to the next job; the job finishes
  (JobFinished) when its file is written. A cancel that arrives while the file is being written
  deletes it and answers JobCancelled.

torch and the model code are imported inside `Engine`, never at module level: the front end imports
this module (for the process target) and stays small and quick to start.
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq
from PIL import Image

from diffserve.configs.engine_args import EngineArgs
from diffserve.configs.sampling_params import SamplingParams
from diffserve.errors import UserError
from diffserve.logging_setup import configure_logging
from diffserve.outputs import CONTENT_TYPES, encode_image, output_metadata, save_image, save_video
from diffserve.server.image_files import image_path
from diffserve.server.protocol import (
    CancelJob,
    EncodedImage,
    EncodedVideo,
    EngineFatal,
    EngineReady,
    GenerateJob,
    JobAccepted,
    JobCancelled,
    JobFailed,
    JobFinished,
    JobPreview,
    JobProgress,
    JobRejected,
    JobStarted,
    ShutdownEngine,
)

if TYPE_CHECKING:
    from diffserve.runtime import ScheduledRequest

logger = logging.getLogger("diffserve.engine")

#: Warm-up and /health_generate draw an image about this many pixels wide (rounded up to the model's granularity).
PROBE_PIXELS = 64
#: Video families draw a one-frame clip for the warm-up and /health_generate (1 = 4 * 0 + 1 is always valid).
PROBE_FRAMES = 1


def preview_steps(total_steps: int, partial_images: int) -> list[int]:
    """The steps after which previews 0..k-1 are sent: round((i + 1) * n / (k + 1)), at least step 1
    (with few steps two previews can fall on the same step; each still gets its own index)."""
    return [
        min(total_steps, max(1, round((i + 1) * total_steps / (partial_images + 1))))
        for i in range(partial_images)
    ]


@dataclass
class EngineProcessConfig:
    engine_args: EngineArgs
    to_engine_address: str
    from_engine_address: str
    incarnation: int
    warmup: bool = True
    log_level: str = "info"


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
        if self.inbox.poll(timeout_ms) == 0:
            return None
        return self.inbox.recv_pyobj()

    def close(self) -> None:
        self.inbox.close(linger=0)
        self.outbox.close()
        self.context.term()


class Engine:
    def __init__(self, config: EngineProcessConfig, channel: Channel, generator: Any = None) -> None:
        """`generator`: a loaded `DiffGenerator` (tests pass a stand-in); None loads `config.engine_args`."""
        start = time.perf_counter()
        self.config = config
        self.channel = channel
        if generator is None:
            from diffserve.api import DiffGenerator

            generator = DiffGenerator(config.engine_args, show_progress=False)
        self.generator = generator
        self.engine = generator.engine
        self.platform = self.engine.platform
        self.facts = generator.pipeline.facts
        self.load_seconds = time.perf_counter() - start
        self.output_dir = Path(config.engine_args.output_path)
        self.stop = threading.Event()
        self.pixel_multiple = self.facts.pixel_multiple
        self.probe_size = -(-PROBE_PIXELS // self.pixel_multiple) * self.pixel_multiple
        self.is_video = self.facts.makes_video
        self.probe_images = self._probe_images()
        # One thread: MP4s are written in job order, and x264 already uses several cores per file.
        self.encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="video-encoder")
        #: Video jobs whose file is being written -> their cancel flag (the job's `cancel_event`).
        self._encoding: dict[str, threading.Event] = {}
        self._encoding_lock = threading.Lock()
        self.scheduler = self.engine.scheduler
        #: The engine reports the front end's jobs here (warm-up and calibration requests have no job).
        self.engine.events = self

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        warmup_seconds = None
        if self.config.warmup:
            start = time.perf_counter()
            self.generator.generate_from_params(self.probe_params("warm-up"))
            warmup_seconds = time.perf_counter() - start
            logger.info("Warm-up generation done in %.2f seconds", warmup_seconds)
        self.engine.memory = self._memory_model()
        logger.info("Scheduler: %s", self.scheduler_info())
        self.receiver = threading.Thread(target=self._receive_loop, name="engine-receiver", daemon=True)
        self.receiver.start()
        self.channel.send(
            EngineReady(pid=os.getpid(), info=self.info(warmup_seconds), probe_size=self.probe_size)
        )
        logger.info("Engine ready (pid %d)", os.getpid())

    def _probe_images(self) -> list[Image.Image] | None:
        """Plain input images for the warm-up and /health_generate when the family requires them (edit
        and image-to-video models); None for text-to-image families."""
        if self.facts.min_input_images == 0:
            return None
        side = self.probe_size
        return [Image.new("RGB", (side, side), (128, 128, 128)) for _ in range(self.facts.min_input_images)]

    def probe_params(self, prompt: str, side: int | None = None) -> SamplingParams:
        side = side or self.probe_size
        return SamplingParams(
            prompt=prompt,
            height=side,
            width=side,
            num_inference_steps=1,
            input_images=self.probe_images,
            num_frames=PROBE_FRAMES if self.is_video else None,
        )

    def _memory_model(self) -> Any:
        """Calibrated at warm-up where the platform can measure peaks; estimated otherwise (CPU, or
        --no-warmup). A calibration that fails (a side the model refuses, out of memory) falls back
        to the estimate rather than stopping the engine."""
        from diffserve.runtime.calibration import calibrate_memory_model
        from diffserve.runtime.memory import CALIBRATION_SIDES, estimated_memory_model

        fraction = self.config.engine_args.mem_fraction
        if self.config.warmup:
            sides = [-(-s // self.pixel_multiple) * self.pixel_multiple for s in CALIBRATION_SIDES]
            try:
                return calibrate_memory_model(
                    self.engine, [self.probe_params("calibration", s) for s in sides], fraction
                )
            except Exception as exc:
                logger.warning(
                    "Memory calibration failed (%s: %s); using the estimated memory model",
                    type(exc).__name__,
                    exc,
                )
        return estimated_memory_model(self.facts, self.platform, fraction)

    def scheduler_info(self) -> dict[str, Any]:
        """The scheduler's limits and memory model (for /server_info and the log)."""
        s = self.scheduler
        memory = s.memory.describe() if s.memory is not None else None
        return {
            "max_running_requests": s.config.max_running_requests,
            "max_batch_tokens": s.config.max_batch_tokens,
            "mem_fraction": self.config.engine_args.mem_fraction,
            "memory_model": memory,
        }

    def video_limits(self) -> dict[str, int] | None:
        """The family's frame rules for the front end (it turns `seconds` into a valid num_frames)."""
        facts = self.facts
        if not facts.makes_video:
            return None
        return {
            "temporal_factor": facts.temporal_factor,
            "max_frames": facts.max_frames,
            "max_fps": facts.max_fps,
        }

    def info(self, warmup_seconds: float | None) -> dict[str, Any]:
        import torch

        import diffserve

        g = self.generator
        from diffserve.runtime.contract import resolved_params

        defaults = resolved_params(
            g.pipeline, SamplingParams(prompt="-", input_images=self.probe_images)
        ).to_dict()
        for key in ("prompt", "seed", "extra", "input_images", "mask_image"):
            defaults.pop(key, None)
        if self.probe_images:  # an edit model: its default size follows the input image
            defaults["height"] = defaults["width"] = None
        return {
            "model_path": g.model_path,
            "family": g.family.name,
            "diffusers_pipeline": g.family.diffusers_pipeline,
            "task": g.family.task,
            "requires_input_image": bool(self.probe_images),
            "video": self.video_limits(),
            "platform": g.platform.name,
            "device_name": g.platform.device_name(),
            "dtype": str(g.dtype).removeprefix("torch."),
            "pixel_multiple": self.pixel_multiple,
            "default_params": defaults,
            "load_seconds": round(self.load_seconds, 3),
            "scheduler": self.scheduler_info(),
            "warmup_seconds": None if warmup_seconds is None else round(warmup_seconds, 3),
            # str(): torch's version object would make the front end import torch to unpickle it.
            "versions": {"diffserve": diffserve.__version__, "torch": str(torch.__version__)},
        }

    def run_forever(self) -> None:
        while not self.stop.is_set():
            self.run_once(timeout=0.5)
        # Shutdown flagged the running requests: one more pass reports them cancelled (and drops any
        # request that arrived after the flags were set).
        self.engine.cancel_all()
        self.engine.step()
        self.encoder.shutdown(wait=True)  # files being written are finished and reported
        self.receiver.join()  # it owns the inbox socket until it sees `stop`
        logger.info("Engine stopped")

    def run_once(self, timeout: float = 0.0) -> bool:
        """One scheduler iteration, after waiting up to `timeout` seconds for work. False: idle."""
        return self.engine.run_once(timeout)

    def run_until_idle(self) -> None:
        """Run until nothing waits or runs (tests drive the engine in-process with this)."""
        self.engine.run_until_idle()

    def shutdown(self) -> None:
        self.stop.set()
        self.engine.cancel_all()  # the dropped waiting requests are reported through on_cancelled

    # -- receiver thread -------------------------------------------------------------------------
    def _receive_loop(self) -> None:
        while not self.stop.is_set():
            message = self.channel.recv(timeout_ms=500)
            if message is None:
                continue
            try:
                self._handle(message)
            except Exception as exc:  # one bad message must not stop the engine
                logger.exception("engine: failed to handle %s", type(message).__name__)
                if isinstance(message, GenerateJob):
                    self.channel.send(JobFailed(message.request_id, f"{type(exc).__name__}: {exc}"))

    def _kind_mismatch(self, job: GenerateJob) -> str | None:
        """Why this model cannot serve the job's kind of output (the front end checks first; this is the
        engine's own guard), or None."""
        if job.internal:
            return None
        family = self.generator.family
        if self.is_video and job.video_path is None:
            return (
                f"{family.diffusers_pipeline} is a {family.task} model and generates videos; "
                "use POST /v1/videos"
            )
        if not self.is_video and job.video_path is not None:
            return (
                f"{family.diffusers_pipeline} is a {family.task} model and generates images; "
                "use POST /v1/images/generations"
            )
        return None

    def _handle(self, message: Any) -> None:
        if isinstance(message, GenerateJob):
            if message.internal and self.probe_images and not message.params.input_images:
                message.params.input_images = list(self.probe_images)  # /health_generate on an edit model
            if message.internal and self.is_video and message.params.num_frames is None:
                message.params.num_frames = PROBE_FRAMES  # /health_generate on a video model
            mismatch = self._kind_mismatch(message)
            if mismatch is not None:
                self.channel.send(JobRejected(message.request_id, mismatch, param="model"))
                return
            from diffserve.request import Req
            from diffserve.runtime import RequestTooLargeError

            req = Req(params=message.params, request_id=message.request_id, cancel_event=threading.Event())
            try:
                scheduled = self.engine.prepare(
                    req, priority=message.priority, payload=message
                )  # validates once
            except RequestTooLargeError as exc:
                logger.info("Request %s refused: %s", message.request_id, exc)
                self.channel.send(JobRejected(message.request_id, str(exc), param=exc.param, status=413))
                return
            except UserError as exc:
                self.channel.send(
                    JobRejected(message.request_id, str(exc), param=getattr(exc, "param", None))
                )
                return
            if message.ack:  # before queueing: the main thread's JobStarted must come after it
                params = dataclasses.replace(scheduled.req.params, input_images=None, mask_image=None)
                self.channel.send(JobAccepted(message.request_id, params))
            req.on_step = lambda r, job=message: self._on_step(job, r)
            self.engine.enqueue(scheduled)
        elif isinstance(message, CancelJob):
            where = self.engine.cancel(message.request_id)  # a waiting job is answered by on_cancelled
            if where is None:
                with self._encoding_lock:
                    flag = self._encoding.get(message.request_id)
                if flag is not None:
                    flag.set()  # the encoder thread deletes the file and answers JobCancelled
                    where = "encoding"
            if where is not None:
                logger.info("Request %s cancelled while %s", message.request_id, where)
        elif isinstance(message, ShutdownEngine):
            logger.info("Engine shutting down")
            self.shutdown()
        else:
            logger.warning("engine: ignoring unknown message %r", message)

    # -- main thread: the scheduler's events ------------------------------------------------------
    def on_started(self, sr: ScheduledRequest) -> None:
        if not isinstance(sr.payload, GenerateJob):
            return
        self.channel.send(JobStarted(sr.request_id))
        logger.info(
            "Request %s started (%d running, %d waiting)",
            sr.request_id,
            self.scheduler.num_running,
            self.scheduler.num_waiting,
        )

    def on_cancelled(self, sr: ScheduledRequest) -> None:
        if not isinstance(sr.payload, GenerateJob):
            return
        self.channel.send(JobCancelled(sr.request_id, at_step=sr.req.step_index))

    def on_failed(self, sr: ScheduledRequest, error: BaseException) -> None:
        if not isinstance(sr.payload, GenerateJob):
            return
        rid = sr.request_id
        if isinstance(error, UserError):
            self.channel.send(JobFailed(rid, str(error), user_error=True))
        else:
            logger.error("Request %s failed", rid, exc_info=error)
            self.channel.send(JobFailed(rid, f"{type(error).__name__}: {error}"))

    def on_finished(self, sr: ScheduledRequest) -> None:
        """Decoded: encode the images and answer, or hand a video to the encoder thread."""
        from diffserve.api import GenerationOutput

        if not isinstance(sr.payload, GenerateJob):
            return

        job, req = sr.payload, sr.req
        start = sr.started_at
        out = GenerationOutput(
            images=req.images or [],
            frames=req.frames or [],
            params=req.params,
            request_id=req.request_id,
            timings=dict(req.timings),
            step_times=list(req.step_times),
            peak_memory_mb=None if sr.peak_memory_bytes is None else sr.peak_memory_bytes / 2**20,
        )
        if job.video_path is not None:
            self._hand_to_encoder(sr, out, start)
            return
        encode_start = time.perf_counter()
        images = self._encode(job, out.images, out.params)
        encode_seconds = time.perf_counter() - encode_start
        peak = sr.peak_memory_bytes
        logger.info(
            "Request %s finished in %.2f seconds (%d image(s), %d step(s), mean batch %.1f)",
            sr.request_id,
            time.perf_counter() - start,
            len(images),
            len(sr.batch_sizes),
            sum(sr.batch_sizes) / max(len(sr.batch_sizes), 1),
        )
        # The input images are not sent back: the front end has them, and they can be large.
        params = dataclasses.replace(out.params, input_images=None, mask_image=None)
        self.channel.send(
            JobFinished(
                sr.request_id,
                images,
                params,
                out.timings,
                out.step_times,
                peak,
                engine_seconds=time.perf_counter() - start,
                encode_seconds=encode_seconds,
                batch_sizes=list(sr.batch_sizes),
                steps_computed_in_full=req.steps_computed_in_full,
            )
        )

    def _on_step(self, job: GenerateJob, req: Any) -> None:
        """`Req.on_step` of every job: one JobProgress per denoising step (after the last one the VAE
        decodes, so that step is reported as the start of the decoding phase), and the job's previews."""
        total = req.num_steps
        phase = "decoding" if req.step_index >= total else "denoising"
        self.channel.send(JobProgress(req.request_id, req.step_index, total, phase))
        if job.partial_images > 0:
            indices = [
                i for i, step in enumerate(preview_steps(total, job.partial_images)) if step == req.step_index
            ]
            if indices:
                self._send_previews(req, indices)

    def _send_previews(self, req: Any, indices: list[int]) -> None:
        """Preview(s) `indices` of the request after its current step; a preview that fails is skipped
        (logged): it must never fail the request."""
        try:
            images = self.engine.runner.preview_images(req)
            encoded = [encode_image(image, "png") for image in images]
        except Exception:
            logger.exception("Request %s: preview after step %d failed", req.request_id, req.step_index)
            return
        for index in indices:
            self.channel.send(JobPreview(req.request_id, index, req.step_index, req.num_steps, encoded))

    def _hand_to_encoder(self, sr: ScheduledRequest, out: Any, start: float) -> None:
        """Queue the MP4 write of a finished video job on the encoder thread and return at once. The job
        stays cancellable through its `cancel_event`, registered before the scheduler frees its slot."""
        rid = sr.request_id
        steps = len(out.step_times)
        with self._encoding_lock:
            self._encoding[rid] = sr.cancel_event
        self.channel.send(JobProgress(rid, steps, steps, "encoding"))
        self.encoder.submit(self._write_video, sr, out, start)

    def _write_video(self, sr: ScheduledRequest, out: Any, start: float) -> None:
        """Encoder thread: write the MP4 atomically, then JobFinished (or JobCancelled / JobFailed)."""
        job, rid = sr.payload, sr.request_id
        path = Path(job.video_path)
        cancelled = sr.cancel_event
        try:
            if cancelled.is_set():
                self.channel.send(JobCancelled(rid, at_step=len(out.step_times)))
                return
            if len(out.frames) != 1:
                raise RuntimeError(f"expected one video from the pipeline, got {len(out.frames)}")
            frames = out.frames[0]
            params = dataclasses.replace(out.params, input_images=None, mask_image=None)
            metadata = output_metadata(
                self.generator.model_path, self.generator.family.diffusers_pipeline, params
            )
            encode_start = time.perf_counter()
            save_video(frames, path, params.fps, metadata, "mp4")
            encode_seconds = time.perf_counter() - encode_start
            if cancelled.is_set():  # cancelled while the file was written: it must not stay
                path.unlink(missing_ok=True)
                logger.info("Request %s cancelled while its video was written; file removed", rid)
                self.channel.send(JobCancelled(rid, at_step=len(out.step_times)))
                return
            num_frames, height, width, _ = frames.shape
            video = EncodedVideo(
                str(path), path.stat().st_size, int(num_frames), int(width), int(height), int(params.fps)
            )
            peak = None if out.peak_memory_mb is None else int(out.peak_memory_mb * 2**20)
            timings = {**out.timings, "VideoEncoding": encode_seconds}
            logger.info(
                "Request %s finished in %.2f seconds (%d frames, %d bytes, encoded in %.2f s)",
                rid,
                time.perf_counter() - start,
                num_frames,
                video.size_bytes,
                encode_seconds,
            )
            self.channel.send(
                JobFinished(
                    rid,
                    [],
                    params,
                    timings,
                    list(out.step_times),
                    peak,
                    engine_seconds=time.perf_counter() - start,
                    encode_seconds=encode_seconds,
                    videos=[video],
                    steps_computed_in_full=sr.req.steps_computed_in_full,
                )
            )
        except Exception as exc:
            logger.exception("Request %s failed while writing its video", rid)
            path.unlink(missing_ok=True)
            self.channel.send(JobFailed(rid, f"writing the video failed: {type(exc).__name__}: {exc}"))
        finally:
            with self._encoding_lock:
                self._encoding.pop(rid, None)

    def _encode(self, job: GenerateJob, images: list, params: SamplingParams) -> list[EncodedImage]:
        fmt = params.output_format
        metadata = output_metadata(
            self.generator.model_path, self.generator.family.diffusers_pipeline, params
        )
        encoded = []
        for i, image in enumerate(images):
            image_id = f"{job.request_id}-{i}"
            data: bytes | None = None
            if job.response_format == "url":
                save_image(
                    image, image_path(self.output_dir, image_id, fmt), metadata, fmt, job.output_compression
                )
            else:
                data = encode_image(image, fmt, job.output_compression, metadata)
            encoded.append(EncodedImage(data=data, image_id=image_id, content_type=CONTENT_TYPES[fmt]))
        return encoded


def _exit_with_parent() -> None:
    """Stop the engine when the front end process dies (nothing is left to report to)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        os._exit(0)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def run_engine_process(config: EngineProcessConfig) -> None:
    """Target of the engine process (started with multiprocessing's spawn)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the front end, which shuts us down
    configure_logging(config.log_level)
    _exit_with_parent()
    channel = Channel(config)
    try:
        engine = Engine(config, channel)
        engine.start()
    except UserError as exc:
        channel.send(EngineFatal(str(exc), user_error=True))
        channel.close()
        _exit(2)
    except Exception as exc:
        logger.exception("Engine failed to start")
        channel.send(EngineFatal(f"{type(exc).__name__}: {exc}", user_error=False))
        channel.close()
        _exit(1)
    engine.run_forever()
    channel.close()
    _exit(0)


def _exit(code: int) -> None:
    # Skip interpreter teardown (seconds with torch and transformers loaded); everything is flushed.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
