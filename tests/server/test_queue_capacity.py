"""Issue 17 item 10: `--max-queue-size` counts the requests that wait, not the running ones, even in a burst.

The engine client is the real one; only its PUSH socket to the engine process is replaced by a recorder,
and the engine's answers (EngineReady, JobStarted, JobFinished) are dispatched as the receive task would.
"""

from __future__ import annotations

import asyncio

import pytest
from push_recorder import PushRecorder

from diffserve.configs.engine_args import EngineArgs
from diffserve.configs.sampling_params import SamplingParams
from diffserve.server import protocol as msg
from diffserve.server.args import ServerArgs
from diffserve.server.engine_client import EngineClient, EngineState, QueueFullError
from diffserve.server.metrics import ServerMetrics

ENGINE_SLOTS = 4  # --max-running-requests, as the engine reports it when ready
MAX_QUEUE = 3


def ready_client(slots: int = ENGINE_SLOTS, max_queue: int = MAX_QUEUE) -> EngineClient:
    """An engine client whose engine reported ready with `slots` running slots."""
    args = ServerArgs(EngineArgs(model_path="/m"), max_queue_size=max_queue)
    client = EngineClient(args, ServerMetrics(), on_fatal=lambda code, message: None)
    client._push = PushRecorder()
    client.state = EngineState.STARTING
    info = {"task": "text-to-image", "scheduler": {"max_running_requests": slots}}
    client._dispatch(msg.EngineReady(pid=1, info=info, probe_size=64))
    assert client.ready and client.engine_slots == slots
    return client


def finished(request_id: str) -> msg.JobFinished:
    return msg.JobFinished(request_id, [], SamplingParams(prompt="p"), {}, [], None, 0.0, 0.0)


def test_a_burst_queues_max_queue_size_beyond_the_free_running_slots() -> None:
    async def scenario() -> None:
        client = ready_client()
        jobs = [msg.GenerateJob(f"r{i}", SamplingParams(prompt="p")) for i in range(ENGINE_SLOTS + MAX_QUEUE)]
        # The burst arrives before the engine has started any: the first 4 are about to run, 3 wait.
        tasks = [asyncio.create_task(client.generate(job)) for job in jobs]
        await asyncio.sleep(0)
        assert len(client._push.sent) == len(jobs) and client.num_waiting == len(jobs)
        assert client.num_queued == MAX_QUEUE
        with pytest.raises(QueueFullError, match=r"\(3 requests waiting, --max-queue-size 3\)"):
            await client.generate(msg.GenerateJob("one-too-many", SamplingParams(prompt="p")))

        # The engine starts 4 of them: still 3 waiting, still full.
        for job in jobs[:ENGINE_SLOTS]:
            client._dispatch(msg.JobStarted(job.request_id))
        assert (client.num_running, client.num_waiting, client.num_queued) == (
            ENGINE_SLOTS,
            MAX_QUEUE,
            MAX_QUEUE,
        )
        with pytest.raises(QueueFullError):
            await client.generate(msg.GenerateJob("still-too-many", SamplingParams(prompt="p")))

        # One finishes: its slot goes to a waiting job, so one more may wait.
        client._dispatch(finished(jobs[0].request_id))
        assert (await tasks[0]).request_id == jobs[0].request_id
        assert client.num_queued == MAX_QUEUE - 1
        extra = asyncio.create_task(client.generate(msg.GenerateJob("fits", SamplingParams(prompt="p"))))
        await asyncio.sleep(0)
        assert client.num_queued == MAX_QUEUE and not extra.done()
        for task in [*tasks[1:], extra]:
            task.cancel()
        await asyncio.gather(*tasks[1:], extra, return_exceptions=True)

    asyncio.run(scenario())


def test_a_zero_queue_still_fills_the_free_running_slots() -> None:
    async def scenario() -> None:
        client = ready_client(slots=2, max_queue=0)
        tasks = [
            asyncio.create_task(client.generate(msg.GenerateJob(f"r{i}", SamplingParams("p"))))
            for i in range(2)
        ]
        await asyncio.sleep(0)
        assert len(client._push.sent) == 2
        with pytest.raises(QueueFullError, match=r"\(0 requests waiting, --max-queue-size 0\)"):
            await client.generate(msg.GenerateJob("third", SamplingParams(prompt="p")))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(scenario())
