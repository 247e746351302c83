"""A video job is stored only once its response can be rendered: `GET /v1/videos` renders every stored
job, so one record that cannot be rendered would break the list for every client."""

from __future__ import annotations

import asyncio
import math

import pytest

from diffserve.configs.sampling_params import SamplingParams
from diffserve.server import video_jobs
from diffserve.server.engine_client import JobRejectedError
from diffserve.server.metrics import ServerMetrics
from diffserve.server.protocol import JobAccepted


class AcceptingEngine:
    """Accepts every job at once; records cancellations."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []

    async def submit(self, job, on_event):
        return JobAccepted(job.request_id, job.params), asyncio.get_running_loop().create_future()

    def cancel(self, request_id: str) -> bool:
        self.cancelled.append(request_id)
        return True


def test_a_job_that_cannot_be_rendered_is_refused_and_never_stored(tmp_path, monkeypatch) -> None:
    engine = AcceptingEngine()
    manager = video_jobs.VideoJobManager(tmp_path, 3600.0, engine, ServerMetrics())  # type: ignore[arg-type]
    to_api = video_jobs.VideoJob.to_api
    monkeypatch.setattr(
        video_jobs.VideoJob, "to_api", lambda self, ttl: {**to_api(self, ttl), "progress": math.nan}
    )

    async def scenario() -> None:
        manager.open()
        try:
            params = SamplingParams(prompt="a fox", num_frames=5, height=32, width=32, fps=8)
            with pytest.raises(JobRejectedError, match="cannot be represented"):
                await manager.create(params, "m", image_to_video=False)
            assert manager.store is not None and manager.store.completed_ids() == set()
            assert manager.list(limit=10, after=None, descending=True) == ([], False)
        finally:
            await manager.close()

    asyncio.run(scenario())
    assert len(engine.cancelled) == 1 and engine.cancelled[0].startswith("video_")
