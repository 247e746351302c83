"""The engine process: loads the model once, then runs the front end's requests one at a time.

Two threads:
- the main thread runs the engine loop: `queue.pop()` -> `_run(job)` -> JobFinished / JobCancelled /
  JobFailed. Step-level batching later swaps `RequestQueue.pop` + `_run` for a scheduler that hands
  several requests to the pipeline's step function; the messages stay the same.
- the receiver thread reads the front end's messages: a GenerateJob is validated (family defaults
  applied, `SamplingParams.validate`) and queued, or answered at once with JobRejected; a CancelJob
  drops a waiting request or flags the running one, which stops at its next denoising step;
  ShutdownEngine stops the loop.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
from PIL import Image

from diffserve.cli.logging_setup import configure_logging
from diffserve.configs.engine_args import EngineArgs
from diffserve.configs.sampling_params import SamplingParams
from diffserve.errors import InvalidRequestError, RequestCancelledError, UserError
from diffserve.server.image_encoding import CONTENT_TYPES, encode_image, image_path
from diffserve.server.protocol import (
    CancelJob,
    EncodedImage,
    EngineFatal,
    EngineReady,
    GenerateJob,
    JobCancelled,
    JobFailed,
    JobFinished,
    JobRejected,
    JobStarted,
    ShutdownEngine,
)
from diffserve.server.request_queue import QueuedJob, RequestQueue

logger = logging.getLogger("diffserve.engine")

#: Warm-up and /health_generate draw an image about this many pixels wide (rounded up to the model's granularity).
PROBE_PIXELS = 64


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
        self.load_seconds = time.perf_counter() - start
        self.output_dir = Path(config.engine_args.output_path)
        self.queue = RequestQueue()
        self.stop = threading.Event()
        self.pixel_multiple = int(self.generator.pipeline.pixel_multiple)
        self.probe_size = -(-PROBE_PIXELS // self.pixel_multiple) * self.pixel_multiple
        self.probe_images = self._probe_images()

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        warmup_seconds = None
        if self.config.warmup:
            start = time.perf_counter()
            self.generator.generate_from_params(self.probe_params("warm-up"))
            warmup_seconds = time.perf_counter() - start
            logger.info("Warm-up generation done in %.2f seconds", warmup_seconds)
        self.receiver = threading.Thread(target=self._receive_loop, name="engine-receiver", daemon=True)
        self.receiver.start()
        self.channel.send(EngineReady(pid=os.getpid(), info=self.info(warmup_seconds), probe_size=self.probe_size))
        logger.info("Engine ready (pid %d)", os.getpid())

    def _probe_images(self) -> list[Image.Image] | None:
        """A plain input image for the warm-up and /health_generate when the family requires one (edit
        models refuse a request without it, naming `image`); None for text-to-image families."""
        params = SamplingParams(prompt="probe", height=self.probe_size, width=self.probe_size, num_inference_steps=1)
        try:
            self.generator.pipeline.resolve_params(params)
        except InvalidRequestError as exc:
            if exc.param == "image":
                return [Image.new("RGB", (self.probe_size, self.probe_size), (128, 128, 128))]
        return None

    def probe_params(self, prompt: str) -> SamplingParams:
        return SamplingParams(prompt=prompt, height=self.probe_size, width=self.probe_size, num_inference_steps=1,
                              input_images=self.probe_images)

    def info(self, warmup_seconds: float | None) -> dict[str, Any]:
        import torch

        import diffserve

        g = self.generator
        defaults = g.pipeline.resolve_params(SamplingParams(prompt="-", input_images=self.probe_images)).to_dict()
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
            "platform": g.platform.name,
            "device_name": g.platform.device_name(),
            "dtype": str(g.dtype).removeprefix("torch."),
            "pixel_multiple": self.pixel_multiple,
            "default_params": defaults,
            "load_seconds": round(self.load_seconds, 3),
            "warmup_seconds": None if warmup_seconds is None else round(warmup_seconds, 3),
            # str(): torch's version object would make the front end import torch to unpickle it.
            "versions": {"diffserve": diffserve.__version__, "torch": str(torch.__version__)},
        }

    def run_forever(self) -> None:
        while not self.stop.is_set():
            queued = self.queue.pop(timeout=0.5)
            if queued is None:
                continue
            try:
                self._run(queued)
            finally:
                self.queue.finish(queued.request_id)
        self.receiver.join()  # it owns the inbox socket until it sees `stop`
        logger.info("Engine stopped")

    def shutdown(self) -> None:
        self.stop.set()
        for request_id in self.queue.cancel_all():
            self.channel.send(JobCancelled(request_id))

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

    def _handle(self, message: Any) -> None:
        if isinstance(message, GenerateJob):
            if message.internal and self.probe_images and not message.params.input_images:
                message.params.input_images = list(self.probe_images)  # /health_generate on an edit model
            try:
                self.generator.pipeline.resolve_params(message.params)  # validate before queueing
            except UserError as exc:
                self.channel.send(JobRejected(message.request_id, str(exc), param=getattr(exc, "param", None)))
                return
            self.queue.put(message)
        elif isinstance(message, CancelJob):
            where = self.queue.cancel(message.request_id)
            if where == "waiting":
                self.channel.send(JobCancelled(message.request_id))
            if where is not None:
                logger.info("Request %s cancelled while %s", message.request_id, where)
        elif isinstance(message, ShutdownEngine):
            logger.info("Engine shutting down")
            self.shutdown()
        else:
            logger.warning("engine: ignoring unknown message %r", message)

    # -- main thread -----------------------------------------------------------------------------
    def _run(self, queued: QueuedJob) -> None:
        from diffserve.request import Req

        job = queued.job
        rid = job.request_id
        if queued.cancel_event.is_set():
            self.channel.send(JobCancelled(rid))
            return
        self.channel.send(JobStarted(rid))
        logger.info("Request %s started (%d waiting)", rid, self.queue.num_waiting)
        req = Req(params=job.params, request_id=rid, cancel_event=queued.cancel_event)
        start = time.perf_counter()
        try:
            out = self.generator.generate_from_params(job.params, request=req)
            encode_start = time.perf_counter()
            images = self._encode(job, out.images, out.params)
            encode_seconds = time.perf_counter() - encode_start
        except RequestCancelledError:
            logger.info("Request %s cancelled at step %d", rid, req.step_index)
            self.channel.send(JobCancelled(rid, at_step=req.step_index))
            return
        except UserError as exc:
            self.channel.send(JobFailed(rid, str(exc), user_error=True))
            return
        except Exception as exc:
            logger.exception("Request %s failed", rid)
            self.channel.send(JobFailed(rid, f"{type(exc).__name__}: {exc}"))
            return
        peak = None if out.peak_memory_mb is None else int(out.peak_memory_mb * 2**20)
        logger.info("Request %s finished in %.2f seconds (%d image(s))", rid, time.perf_counter() - start, len(images))
        # The input images are not sent back: the front end has them, and they can be large.
        params = dataclasses.replace(out.params, input_images=None, mask_image=None)
        self.channel.send(
            JobFinished(
                rid, images, params, out.timings, out.step_times, peak,
                engine_seconds=time.perf_counter() - start, encode_seconds=encode_seconds,
            )
        )

    def _encode(self, job: GenerateJob, images: list, params: SamplingParams) -> list[EncodedImage]:
        fmt = params.output_format
        metadata = {"model": self.generator.model_path, "pipeline": self.generator.family.diffusers_pipeline,
                    **params.to_dict()}
        encoded = []
        for i, image in enumerate(images):
            data = encode_image(image, fmt, job.output_compression, metadata)
            image_id = f"{job.request_id}-{i}"
            if job.response_format == "url":
                path = image_path(self.output_dir, image_id, fmt)
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(".partial")
                tmp.write_bytes(data)
                tmp.replace(path)
                data = None
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
