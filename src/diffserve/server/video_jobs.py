"""Video jobs of `/v1/videos`: their records (SQLite), their MP4 files, their runs in the engine.

As in OpenAI's video API the POST answers with a job the client polls. A job is recorded once the engine
accepted it, with the resolved parameters; progress lives in memory, status changes in SQLite. Finished
jobs and files go `--job-ttl` seconds after finishing. The store exists only for a video model: it opens
when the engine reports such a model ready, before it takes requests; then jobs a previous server left
unfinished fail (`server_restarted`) and files without a completed job are deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import sqlite3
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from diffserve.configs.sampling_params import SamplingParams
from diffserve.outputs import partial_path
from diffserve.server.engine_client import (
    EngineUnavailableError,
    JobCancelledError,
    JobFailedError,
    JobRejectedError,
)
from diffserve.server.metrics import ServerMetrics
from diffserve.server.protocol import VIDEO_TASKS, GenerateJob, JobChunk, JobFinished, JobProgress, JobStarted
from diffserve.server.replicas import Engines
from diffserve.server.video_stream import ChunkStream, file_stream

logger = logging.getLogger("diffserve.server")

VideoStatus = Literal["queued", "in_progress", "completed", "failed", "cancelled"]
ACTIVE_STATUSES: tuple[str, ...] = ("queued", "in_progress")
FINISHED_STATUSES: tuple[str, ...] = ("completed", "failed", "cancelled")

#: A job id. `\Z`, not `$` (which also accepts a trailing newline), so `.match` checks the whole id.
VIDEO_ID_PATTERN = re.compile(r"\Avideo_[0-9a-f]{32}\Z")

#: How long DELETE waits for the engine to confirm a running job stopped (within a step), and shutdown
#: for followers to record the outcome of jobs the engine client failed.
CANCEL_WAIT_S, CLOSE_WAIT_S = 30.0, 5.0


def video_file(output_dir: Path, video_id: str) -> Path:
    """The MP4 of a job; the engine writes it atomically through a hidden `.{name}.partial` sibling."""
    return output_dir / "videos" / f"{video_id}.mp4"


def progress_percent(message: JobProgress) -> int:
    """Denoising dominates a video's time: it runs from 0 to 90%, decoding is 90%, encoding 95%."""
    if message.phase == "denoising":
        return 90 * message.step // max(message.total, 1)
    return 90 if message.phase == "decoding" else 95


#: The resolved parameters a job records, and the fields its API object adds to OpenAI's.
_PARAM_FIELDS = (
    "width", "height", "num_frames", "fps", "seed", "num_inference_steps", "guidance_scale", "negative_prompt",
    "quality",
)  # fmt: skip
_EXTENSIONS = (
    "phase", "num_frames", "fps", "seed", "num_inference_steps", "guidance_scale", "image_to_video", "quality",
    "steps_computed_in_full", "cache", "stream",
)  # fmt: skip


@dataclass
class VideoJob:
    id: str
    status: VideoStatus
    model: str
    prompt: str
    created_at: float
    progress: int = 0
    #: What the job does now: queued, denoising, decoding, encoding, or its final status.
    phase: str = "queued"
    completed_at: float | None = None  # when it finished (completed, failed or cancelled)
    error_code: str | None = None
    error_message: str | None = None
    file_bytes: int | None = None
    # Resolved parameters (the model's defaults applied), known once the engine accepted the job.
    width: int | None = None
    height: int | None = None
    num_frames: int | None = None
    fps: int | None = None
    seed: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    negative_prompt: str | None = None
    image_to_video: bool = False
    quality: str | None = None  # the tier run: "high" (exact), "medium", "low" or "draft"
    steps_computed_in_full: int | None = None  # known when completed; fewer than the steps with a lossy tier
    cache: dict[str, Any] | None = None  # known when completed: the cache's report (`Req.cache_report`)
    extra: dict[str, Any] = field(default_factory=dict)
    #: Who created it (access.Principal.owner: a digest of the client's key; "" without one). Never shown.
    owner: str = ""
    #: Created with `stream: true`: its chunks are published as they are decoded (video_stream.py).
    stream: bool = False
    #: A completed streamed job: (first frame, frame count) of each chunk, its file's segments. Never shown.
    chunk_frames: list[list[int]] | None = None

    @property
    def finished(self) -> bool:
        return self.status in FINISHED_STATUSES

    def apply_params(self, params: SamplingParams) -> None:
        for name in _PARAM_FIELDS:
            setattr(self, name, getattr(params, name))

    def expires_at(self, ttl: float) -> float | None:
        return None if self.completed_at is None else self.completed_at + ttl

    def to_api(self, ttl: float) -> dict[str, Any]:
        """OpenAI's `Video` object (what `client.videos.retrieve` parses), then diffserve's extensions."""
        expires = self.expires_at(ttl)
        return {
            "id": self.id,
            "object": "video",
            "model": self.model,
            "status": self.status,
            "progress": self.progress,
            "created_at": int(self.created_at),
            "completed_at": None if self.completed_at is None else int(self.completed_at),
            "expires_at": None if expires is None else int(expires),
            # OpenAI's string `seconds`: frames / fps, to the millisecond
            "seconds": f"{round(self.num_frames / self.fps, 3):g}" if self.num_frames and self.fps else None,
            "size": None if self.width is None else f"{self.width}x{self.height}",
            "prompt": self.prompt,
            "remixed_from_video_id": None,
            "error": self.error_code and {"code": self.error_code, "message": self.error_message},
            # diffserve extensions
            **{name: getattr(self, name) for name in _EXTENSIONS},
        }


# Columns that are queried get their own; everything else travels in `details` (JSON).
_COLUMNS = (
    "id", "status", "progress", "phase", "created_at", "completed_at", "error_code", "error_message", "file_bytes",
    "owner",
)  # fmt: skip
_SCHEMA = """
CREATE TABLE IF NOT EXISTS videos (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- creation order: list order and pagination cursor
    id TEXT NOT NULL UNIQUE, status TEXT NOT NULL, progress INTEGER NOT NULL, phase TEXT NOT NULL,
    created_at REAL NOT NULL, completed_at REAL, error_code TEXT, error_message TEXT, file_bytes INTEGER,
    details TEXT NOT NULL, owner TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS videos_completed_at ON videos (completed_at);
"""
#: A store written before jobs had owners gets the column (its jobs: no owner, "").
_OWNER_COLUMN = "ALTER TABLE videos ADD COLUMN owner TEXT NOT NULL DEFAULT ''"


class VideoJobStore:
    """The job records in `<output dir>/video_jobs.sqlite3`."""

    def __init__(self, path: Path) -> None:
        self.path, self._lock = path, threading.Lock()
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.executescript("PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;" + _SCHEMA)
        if "owner" not in {row["name"] for row in self._db.execute("PRAGMA table_info(videos)")}:
            self._db.execute(_OWNER_COLUMN)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _run(self, sql: str, params: Any = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, params).fetchall()

    @staticmethod
    def _values(job: VideoJob) -> dict[str, Any]:
        data = asdict(job)
        details = {k: v for k, v in data.items() if k not in _COLUMNS}
        return {**{k: data[k] for k in _COLUMNS}, "details": json.dumps(details)}

    @staticmethod
    def _job(row: sqlite3.Row) -> VideoJob:
        return VideoJob(**{k: row[k] for k in _COLUMNS}, **json.loads(row["details"]))

    def insert(self, job: VideoJob) -> None:
        values = self._values(job)
        self._run(
            f"INSERT INTO videos ({', '.join(values)}) VALUES ({', '.join(':' + n for n in values)})", values
        )

    def update(self, job: VideoJob) -> None:
        """Write the record back; a record deleted meanwhile stays deleted."""
        values = self._values(job)
        sets = ", ".join(f"{n} = :{n}" for n in values if n != "id")
        self._run(f"UPDATE videos SET {sets} WHERE id = :id", values)

    def get(self, video_id: str) -> VideoJob | None:
        rows = self._run("SELECT * FROM videos WHERE id = ?", (video_id,))
        return self._job(rows[0]) if rows else None

    def delete(self, video_id: str) -> None:
        self._run("DELETE FROM videos WHERE id = ?", (video_id,))

    def page(
        self, limit: int, after: str | None, descending: bool, owners: set[str] | None = None
    ) -> tuple[list[VideoJob], bool]:
        """Up to `limit` jobs after the job `after` (KeyError if unknown), and whether more follow.
        `owners`: only the jobs of these owners (`after` among them); None: every job."""
        order, compare = ("DESC", "<") if descending else ("ASC", ">")
        mine, params = "", ()
        if owners is not None:
            names = sorted(owners)
            mine, params = f" AND owner IN ({', '.join('?' * len(names))})", tuple(names)
        if after is None:
            sql = f"SELECT * FROM videos WHERE 1{mine} ORDER BY seq {order} LIMIT ?"
            rows = self._run(sql, (*params, limit + 1))
        else:
            cursor = self._run(f"SELECT seq FROM videos WHERE id = ?{mine}", (after, *params))
            if not cursor:
                raise KeyError(after)
            sql = f"SELECT * FROM videos WHERE seq {compare} ?{mine} ORDER BY seq {order} LIMIT ?"
            rows = self._run(sql, (cursor[0][0], *params, limit + 1))
        return [self._job(row) for row in rows[:limit]], len(rows) > limit

    def finished_before(self, cutoff: float) -> list[str]:
        return [row[0] for row in self._run("SELECT id FROM videos WHERE completed_at <= ?", (cutoff,))]

    def mark_interrupted(self, now: float) -> list[str]:
        """Fail every job left queued or running by a previous server; returns their ids."""
        ids = [row[0] for row in self._run("SELECT id FROM videos WHERE status IN (?, ?)", ACTIVE_STATUSES)]
        message = "server restarted: the server stopped before this job finished; submit it again"
        self._run(
            "UPDATE videos SET status = 'failed', phase = 'failed', completed_at = ?, error_code = ?, "
            "error_message = ? WHERE status IN (?, ?)",
            (now, "server_restarted", message, *ACTIVE_STATUSES),
        )
        return ids

    def completed_ids(self) -> set[str]:
        return {row[0] for row in self._run("SELECT id FROM videos WHERE status = 'completed'")}


class VideoJobManager:
    """The jobs of `/v1/videos` (see the module docstring)."""

    def __init__(self, output_dir: Path, job_ttl: float, engine: Engines, metrics: ServerMetrics) -> None:
        self.output_dir, self.ttl, self.engine, self.metrics = output_dir, job_ttl, engine, metrics
        self.store: VideoJobStore | None = None
        #: Jobs the engine has in flight: the live records (progress is kept here, not in SQLite).
        self._active: dict[str, VideoJob] = {}
        self._followers: dict[str, asyncio.Task] = {}
        #: The chunks of streamed jobs in flight (video_stream.py).
        self._streams: dict[str, ChunkStream] = {}
        self._sweeper: asyncio.Task | None = None

    @property
    def is_open(self) -> bool:
        """Whether the store is open: the engine has reported a video model ready."""
        return self.store is not None

    def on_engine_ready(self, info: Mapping[str, Any]) -> None:
        """The engine client's ready hook: open the store if the model makes videos (an image model gets
        no `video_jobs.sqlite3`). A restarted engine finds it open already."""
        if self.store is None and info.get("task") in VIDEO_TASKS:
            self.open()

    def open(self) -> None:
        """Open the store, fail what a previous server left unfinished, apply the TTL, delete stray files."""
        directory = video_file(self.output_dir, "-").parent
        directory.mkdir(parents=True, exist_ok=True)
        self.store = VideoJobStore(self.output_dir / "video_jobs.sqlite3")
        if n := len(self.store.mark_interrupted(time.time())):
            logger.warning("Marked %d video job(s) left unfinished by a previous server as failed", n)
        self.expire()
        completed = self.store.completed_ids()
        for path in directory.iterdir():
            if path.is_file() and not (path.suffix == ".mp4" and path.stem in completed):
                path.unlink(missing_ok=True)  # a cancelled/failed job's file, or a half-written .partial
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_loop())

    async def close(self) -> None:
        """After the engine client stopped: let followers record the outcome it gave, then close the store."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        if followers := list(self._followers.values()):
            await asyncio.wait(followers, timeout=CLOSE_WAIT_S)
        for task in followers:
            task.cancel()
        if self.store is not None:
            self.store.close()
            self.store = None

    async def _sweep_loop(self) -> None:
        interval = min(60.0, max(0.5, self.ttl / 4))
        while True:
            await asyncio.sleep(interval)
            try:
                self.expire()
            except Exception:
                logger.exception("Could not delete expired video jobs")

    def expire(self) -> int:
        """Delete the finished jobs older than the TTL, and their files; returns how many."""
        assert self.store is not None
        ids = self.store.finished_before(time.time() - self.ttl)
        for video_id in ids:
            self._remove(video_id, record=True)
        if ids:
            logger.info("Deleted %d expired video job(s) (--job-ttl %g s)", len(ids), self.ttl)
        return len(ids)

    def _remove(self, video_id: str, record: bool = False) -> None:
        """Delete a job's files, and with `record` its record."""
        if record:
            assert self.store is not None
            self.store.delete(video_id)
        path = video_file(self.output_dir, video_id)
        path.unlink(missing_ok=True)
        partial_path(path).unlink(missing_ok=True)

    async def create(
        self, params: SamplingParams, model: str, image_to_video: bool, priority: int = 0, owner: str = "",
        stream: bool = False,
    ) -> VideoJob:  # fmt: skip
        """Submit a job of `owner` and record it once the engine accepted it (`stream`: publish its chunks,
        `chunks()`). Raises what `Engines.submit` raises."""
        assert self.store is not None
        video_id = f"video_{uuid.uuid4().hex}"
        job = VideoJob(
            video_id, "queued", model, params.prompt, time.time(), image_to_video=image_to_video, owner=owner,
            stream=stream,
        )  # fmt: skip
        path = str(video_file(self.output_dir, video_id))
        self._active[video_id], arrived = job, time.monotonic()
        if stream:
            self._streams[video_id] = ChunkStream()
        try:
            engine_job = GenerateJob(
                video_id, params, video_path=path, priority=priority, stream_chunks=stream
            )
            accepted, outcome = await self.engine.submit(engine_job, lambda m: self._on_event(job, m))
        except BaseException:
            self._active.pop(video_id, None)
            self._streams.pop(video_id, None)
            raise
        job.apply_params(accepted.params)
        try:  # stored only once its answer can be rendered: GET /v1/videos renders every stored job
            json.dumps(job.to_api(self.ttl), allow_nan=False).encode()
        except (ValueError, UnicodeEncodeError) as exc:
            self.engine.cancel(video_id)
            outcome.add_done_callback(lambda done: done.cancelled() or done.exception())  # its cancellation
            self._active.pop(video_id, None)
            self._streams.pop(video_id, None)
            raise JobRejectedError(f"the job cannot be represented in a response: {exc}", None) from exc
        self.store.insert(job)
        self._followers[video_id] = asyncio.get_running_loop().create_task(
            self._follow(job, outcome, arrived)
        )
        logger.info(
            "Video job %s queued: %sx%s, %s frames at %s fps, %s steps",
            video_id, job.width, job.height, job.num_frames, job.fps, job.num_inference_steps,
        )  # fmt: skip
        return job

    def _on_event(self, job: VideoJob, message: JobStarted | JobProgress | JobChunk) -> None:
        if job.finished:  # cancelled by DELETE: the engine's last words change nothing
            return
        if isinstance(message, JobChunk):
            if (stream := self._streams.get(job.id)) is not None:
                stream.add(message)
            return
        if isinstance(message, JobStarted):
            job.status, job.phase = "in_progress", "denoising"
            self._save(job)  # status changes are persisted; progress is not
        else:
            job.progress, job.phase = max(job.progress, progress_percent(message)), message.phase

    def _save(self, job: VideoJob) -> None:
        if self.store is not None:
            self.store.update(job)

    async def _follow(self, job: VideoJob, outcome: asyncio.Future, arrived: float) -> None:
        """Await the engine's outcome and record it."""
        try:
            result: JobFinished = await outcome
        except JobCancelledError:
            self.metrics.count("cancelled")
            if job.status != "cancelled":  # not our DELETE: the engine was shutting down
                message = "the engine cancelled this job because the server is shutting down"
                self._finish(job, "failed", "cancelled", message)
        except JobFailedError as exc:
            self.metrics.count("invalid" if exc.user_error else "failed")
            code = "invalid_request" if exc.user_error else "generation_failed"
            self._finish(job, "failed", code, str(exc))
        except EngineUnavailableError as exc:
            self.metrics.count("unavailable")
            self._finish(job, "failed", exc.code, str(exc))
        except Exception as exc:
            logger.exception("Video job %s: unexpected error", job.id)
            self.metrics.count("failed")
            self._finish(job, "failed", "internal_error", f"{type(exc).__name__}: {exc}")
        else:
            self.metrics.observe_finished(result, time.monotonic() - arrived)
            if job.status == "cancelled":  # DELETE came while the file was being finished
                self._remove(job.id)
            else:
                job.file_bytes = result.videos[0].size_bytes if result.videos else None
                if (stream := self._streams.get(job.id)) is not None:
                    job.chunk_frames = stream.chunk_frames()
                job.steps_computed_in_full = result.steps_computed_in_full
                job.cache = result.cache
                self._finish(job, "completed")
        finally:
            self._active.pop(job.id, None)
            self._followers.pop(job.id, None)
            if (stream := self._streams.pop(job.id, None)) is not None:
                stream.finish()  # its subscribers send what they have not yet, then the job

    def _finish(
        self, job: VideoJob, status: VideoStatus, code: str | None = None, message: str | None = None
    ) -> None:
        job.status = job.phase = status
        job.completed_at, job.error_code, job.error_message = time.time(), code, message
        if status == "completed":
            job.progress = 100
        else:
            self._remove(job.id)
        self._save(job)
        logger.info("Video job %s %s%s", job.id, status, f": {message}" if message else "")

    def get(self, video_id: str) -> VideoJob | None:
        """The job (live if in flight), or None when unknown or expired (an expired one is deleted now)."""
        assert self.store is not None
        job = self._active.get(video_id) or self.store.get(video_id)
        if job is None:
            return None
        expires = job.expires_at(self.ttl)
        if expires is not None and expires <= time.time() and video_id not in self._active:
            self._remove(video_id, record=True)
            return None
        return job

    def list(
        self, limit: int, after: str | None, descending: bool, owners: set[str] | None = None
    ) -> tuple[list[VideoJob], bool]:
        """A page of the jobs of `owners` (None: of everyone); see `VideoJobStore.page`."""
        assert self.store is not None
        self.expire()
        jobs, has_more = self.store.page(limit, after, descending, owners)
        return [self._active.get(job.id, job) for job in jobs], has_more

    async def delete(self, video_id: str) -> VideoJob | None:
        """Cancel a job in flight (its record stays, `cancelled`) or delete a finished one; None: unknown."""
        job = self.get(video_id)
        if job is None:
            return None
        if job.finished or video_id not in self._active:
            self._remove(video_id, record=True)
            return job
        job.status = job.phase = "cancelled"
        job.completed_at = time.time()
        self._save(job)
        if (stream := self._streams.pop(video_id, None)) is not None:
            stream.finish()
        self.engine.cancel(video_id)
        if (follower := self._followers.get(video_id)) is not None:
            # The engine confirms within a denoising step (or once a file being written is deleted).
            await asyncio.wait({follower}, timeout=CANCEL_WAIT_S)
        self._remove(video_id)
        logger.info("Video job %s cancelled", video_id)
        return job

    async def chunks(self, job: VideoJob) -> ChunkStream | None:
        """The chunks of a streamed job: live while it is in flight, read from its file once completed;
        None when there are none to give (not created with `stream`, failed, cancelled, file gone)."""
        if not job.stream:
            return None
        if (stream := self._streams.get(job.id)) is not None:
            return stream
        if job.status != "completed" or not job.chunk_frames:  # none: a model with a soundtrack (LTX-2)
            return None
        path = video_file(self.output_dir, job.id)
        try:
            return await asyncio.to_thread(file_stream, path, job.chunk_frames, job.fps or 1)
        except (OSError, ValueError):
            logger.warning("Video job %s: its streamed chunks cannot be read back from its file", job.id)
            return None
