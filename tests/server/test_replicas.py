"""`--dp-size N` (issue 18): N engine replicas behind the one front end (`server/replicas.py`).

In-process, without engine processes: the routing policy (least loaded, ties in turn, not-ready replicas
skipped), a request's cancel going to its own replica, the server-wide queue limit, a platform mismatch
refused, and the server stopping only once every replica failed. Then a real `diffserve serve --dp-size 2`
on the session's tiny FLUX: the `openai` SDK's concurrent requests spread over both replicas, /server_info
and /metrics per replica, SIGKILL of one replica's engine (its request 503, the other keeps serving, the
dead one restarts), and SIGTERM leaving no engine process nor IPC folder behind.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import select
import signal
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import psutil
import pytest
from openai import OpenAI
from push_recorder import PushRecorder
from server_process import ServerProcess, start_server

from diffserve.cli.main import main
from diffserve.configs.engine_args import EngineArgs
from diffserve.configs.sampling_params import SamplingParams
from diffserve.server import protocol as msg
from diffserve.server.args import ServerArgs
from diffserve.server.engine_client import (
    EngineDiedError,
    EngineState,
    EngineUnavailableError,
    QueueFullError,
)
from diffserve.server.engine_process import pin_devices
from diffserve.server.metrics import ServerMetrics
from diffserve.server.replicas import ReplicaSet, choose_replica

INFO = {"task": "text-to-image", "diffusers_pipeline": "FluxPipeline", "platform": "cpu",
        "scheduler": {"max_running_requests": 1}}  # fmt: skip
SIZE, STEPS, LONG_STEPS = 32, 2, 20000  # LONG_STEPS: minutes of work, only ever interrupted


# -- the routing policy -----------------------------------------------------------------------------
def test_choose_replica_takes_the_least_loaded_ready_one() -> None:
    assert choose_replica([3, 1, 2], first=0) == 1
    assert choose_replica([None, 5, 2], first=0) == 2
    assert choose_replica([0, None], first=0) == 0
    assert choose_replica([None, None], first=0) is None


def test_choose_replica_breaks_ties_in_turn_from_first() -> None:
    assert [choose_replica([1, 1, 1], first=k) for k in range(4)] == [0, 1, 2, 0]
    assert choose_replica([2, None, 2], first=1) == 2  # the turn skips a replica that is not ready


def replica_set(n: int = 2, max_queue: int = 8, fatal: list | None = None) -> ReplicaSet:
    """A set of `n` real engine clients whose engine processes are recorders (not started); the server's
    fatal stops land in `fatal`."""
    args = ServerArgs(EngineArgs(model_path="/m"), dp_size=n, max_queue_size=max_queue)
    stops = fatal if fatal is not None else []
    replicas = ReplicaSet(args, ServerMetrics(), lambda code, message: stops.append((code, message)))
    for client in replicas.clients:
        client._push, client.state = PushRecorder(), EngineState.STARTING
    return replicas


def report_ready(replicas: ReplicaSet, index: int, info: dict = INFO) -> None:
    replicas.clients[index]._dispatch(msg.EngineReady(pid=1000 + index, info=info, probe_size=64))


def job(rid: str) -> msg.GenerateJob:
    return msg.GenerateJob(rid, SamplingParams("a cat", height=SIZE, width=SIZE, num_inference_steps=1))


def sent_to(replicas: ReplicaSet) -> list[list[str]]:
    return [client._push.job_ids() for client in replicas.clients]


def test_requests_go_to_the_least_loaded_ready_replica_and_cancel_follows_them() -> None:
    async def scenario() -> None:
        replicas = replica_set(3)
        with pytest.raises(EngineUnavailableError) as starting:
            await replicas.generate(job("r0"))
        assert starting.value.code == "engine_starting"
        report_ready(replicas, 0)
        report_ready(replicas, 2)  # replica 1 still loading: never chosen
        tasks = [asyncio.create_task(replicas.generate(job(f"r{i}"))) for i in range(1, 5)]
        await asyncio.sleep(0)
        assert sent_to(replicas) == [["r1", "r3"], [], ["r2", "r4"]]
        assert replicas.num_waiting == 4 and replicas.loads() == [2, None, 2]
        assert replicas.cancel("r4") and replicas.clients[2]._push.cancels() == ["r4"]
        assert replicas.clients[0]._push.cancels() == [] and not replicas.cancel("unknown")
        replicas.clients[0]._dispatch(msg.JobCancelled("r3"))
        await asyncio.sleep(0)
        assert replicas.loads() == [1, None, 2]  # an answered request no longer loads its replica
        report_ready(replicas, 1)
        tasks.append(asyncio.create_task(replicas.generate(job("r5"))))
        await asyncio.sleep(0)
        assert sent_to(replicas)[1] == ["r5"]
        replicas.abort("test over")
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(scenario())


def test_submitted_jobs_stay_on_their_replica_until_their_outcome() -> None:
    async def scenario() -> None:
        replicas = replica_set(2)
        report_ready(replicas, 0)
        report_ready(replicas, 1)
        submitted = asyncio.create_task(replicas.submit(job("v1")))
        await asyncio.sleep(0)
        [owner] = [c for c in replicas.clients if c._push.job_ids() == ["v1"]]
        owner._dispatch(msg.JobAccepted("v1", job("v1").params))
        _, outcome = await submitted
        assert replicas.cancel("v1") and owner._push.cancels() == ["v1"]
        owner._dispatch(msg.JobCancelled("v1", at_step=0))
        with pytest.raises(EngineUnavailableError):
            await outcome
        await asyncio.sleep(0)
        assert replicas.loads() == [0, 0] and not replicas.cancel("v1")

    asyncio.run(scenario())


def test_the_queue_limit_counts_waiting_requests_of_every_replica() -> None:
    async def scenario() -> None:
        replicas = replica_set(2, max_queue=1)  # one slot per replica, one request may wait in all
        report_ready(replicas, 0)
        report_ready(replicas, 1)
        tasks = [asyncio.create_task(replicas.generate(job(f"r{i}"))) for i in range(3)]
        await asyncio.sleep(0)
        assert replicas.num_waiting == 3  # two about to run (a free slot each), one waiting
        with pytest.raises(QueueFullError, match=r"1 requests waiting, --max-queue-size 1"):
            await replicas.generate(job("r3"))
        replicas.abort("test over")
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(scenario())


def test_a_replica_on_another_platform_is_refused_and_the_server_stops_only_when_all_failed() -> None:
    fatal: list[tuple[int, str]] = []
    replicas = replica_set(2, fatal=fatal)
    report_ready(replicas, 0)
    report_ready(replicas, 1, {**INFO, "platform": "cuda"})
    assert replicas.clients[1].state == EngineState.FAILED and replicas.ready
    assert "replica 1 runs on cuda but replica 0 on cpu" in replicas.clients[1].state_detail
    assert fatal == []  # replica 0 still serves
    replicas.clients[0].state = EngineState.FAILED
    replicas.clients[0].on_fatal(1, "boom")
    assert not replicas.ready and replicas.unavailable_error().code == "engine_failed"
    assert len(fatal) == 1 and fatal[0][0] == 1 and "every replica failed" in fatal[0][1]


def test_a_replica_on_another_platform_than_replica_0_is_failed_when_replica_0_reports_later() -> None:
    async def scenario() -> None:
        fatal: list[tuple[int, str]] = []
        replicas = replica_set(2, fatal=fatal)
        report_ready(replicas, 1)  # on the CPU: it found none of its devices
        request = asyncio.create_task(replicas.generate(job("r1")))
        await asyncio.sleep(0)
        assert sent_to(replicas) == [[], ["r1"]]
        report_ready(replicas, 0, {**INFO, "platform": "cuda"})
        with pytest.raises(EngineUnavailableError) as failed:
            await request
        assert failed.value.code == "engine_failed" and "replica 1 runs on cpu but replica 0 on cuda" in str(
            failed.value
        )
        assert replicas.clients[1].state == EngineState.FAILED and replicas.clients[0].ready and fatal == []

    asyncio.run(scenario())


# -- a replica dying with requests it had not started (issue 31 item 17) -----------------------------
def finished(rid: str) -> msg.JobFinished:
    return msg.JobFinished(rid, [], job(rid).params, {}, [], None, 0.0, 0.0)


async def kill(replicas: ReplicaSet, index: int) -> None:
    """Replica `index`'s engine process exits (as SIGKILL leaves it); its restart is not started here."""
    client = replicas.clients[index]

    async def restart(state: EngineState) -> None:
        client.incarnation += 1

    client._spawn = restart  # type: ignore[method-assign]
    await client._on_engine_exit(SimpleNamespace(exitcode=-9, pid=1000 + index))


def test_requests_a_dead_replica_had_not_started_go_to_a_live_one() -> None:
    async def scenario() -> None:
        replicas = replica_set(2)
        report_ready(replicas, 0)
        report_ready(replicas, 1)
        tasks = {f"r{i}": asyncio.create_task(replicas.generate(job(f"r{i}"))) for i in range(1, 6)}
        await asyncio.sleep(0)
        assert sent_to(replicas) == [["r1", "r3", "r5"], ["r2", "r4"]]
        replicas.clients[0]._dispatch(msg.JobStarted("r1"))  # r1 runs on replica 0, r3 and r5 wait there
        await kill(replicas, 0)
        with pytest.raises(EngineDiedError) as died:
            await tasks["r1"]
        assert died.value.code == "engine_died" and died.value.started
        assert "while this request was running (it had started" in str(died.value)
        await asyncio.sleep(0)
        assert sent_to(replicas)[1] == ["r2", "r4", "r3", "r5"]  # re-sent, in their order
        assert replicas.loads() == [None, 4]
        assert replicas.cancel("r5") and replicas.clients[1]._push.cancels() == ["r5"]  # cancel follows it
        for rid in ("r2", "r3", "r4"):
            replicas.clients[1]._dispatch(finished(rid))
        replicas.clients[1]._dispatch(msg.JobCancelled("r5"))
        assert [(await tasks[rid]).request_id for rid in ("r2", "r3", "r4")] == ["r2", "r3", "r4"]
        with pytest.raises(EngineUnavailableError):
            await tasks["r5"]
        assert replicas.loads() == [None, 0]

    asyncio.run(scenario())


def test_a_video_job_a_dead_replica_had_not_started_runs_on_a_live_one_with_its_seed() -> None:
    async def scenario() -> None:
        replicas = replica_set(2)
        report_ready(replicas, 0)
        report_ready(replicas, 1)
        first, second = replicas.clients
        submitted = asyncio.create_task(replicas.submit(job("v1")))
        await asyncio.sleep(0)
        accepted_params = dataclasses.replace(job("v1").params, seed=1234)  # the engine's resolved seed
        first._dispatch(msg.JobAccepted("v1", accepted_params))
        accepted, outcome = await submitted
        assert accepted.params.seed == 1234 and sent_to(replicas) == [["v1"], []]
        await kill(replicas, 0)
        for _ in range(3):
            await asyncio.sleep(0)
        [resent] = second._push.jobs()
        assert resent.request_id == "v1" and resent.params.seed == 1234 and resent.ack
        second._dispatch(msg.JobAccepted("v1", accepted_params))
        second._dispatch(msg.JobStarted("v1"))
        assert not outcome.done() and replicas.cancel("v1") and second._push.cancels() == ["v1"]
        second._dispatch(finished("v1"))
        assert (await outcome).request_id == "v1" and replicas.loads() == [None, 0]

    asyncio.run(scenario())


def test_an_unstarted_request_fails_saying_so_when_no_other_replica_is_ready() -> None:
    async def scenario() -> None:
        replicas = replica_set(2)
        report_ready(replicas, 0)  # replica 1 still loading
        tasks = [asyncio.create_task(replicas.generate(job(f"r{i}"))) for i in range(2)]
        await asyncio.sleep(0)
        replicas.clients[0]._dispatch(msg.JobStarted("r0"))
        await kill(replicas, 0)
        started, waiting = await asyncio.gather(*tasks, return_exceptions=True)
        assert isinstance(started, EngineDiedError) and started.started
        assert isinstance(waiting, EngineDiedError) and not waiting.started
        assert "before this request started" in str(waiting) and "no other replica was ready" in str(waiting)
        assert waiting.code == "engine_died"

    asyncio.run(scenario())


def test_pin_devices_narrows_each_runtime_to_the_replicas_devices() -> None:
    environ: dict[str, str] = {}
    assert pin_devices("cuda", (2, 3), environ)["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert set(environ) == {"CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"}  # torch on ROCm answers to cuda
    environ = {"CUDA_VISIBLE_DEVICES": "4,5,6"}  # the user's list: positions in it
    assert pin_devices(None, (1,), environ)["CUDA_VISIBLE_DEVICES"] == "5"
    assert environ["ZE_AFFINITY_MASK"] == "1"  # detection: every runtime narrowed
    assert pin_devices("cuda", (3,), {"CUDA_VISIBLE_DEVICES": "4,5"})["CUDA_VISIBLE_DEVICES"] == ""


def test_bad_dp_size_flags_are_one_line_errors(tmp_path, capsys) -> None:
    code = main(["serve", "--model-path", str(tmp_path / "absent"), "--dp-size", "0"])
    assert code == 2 and capsys.readouterr().err == "error: --dp-size must be >= 1, got 0\n"
    code = main(["serve", "--model-path", str(tmp_path), "--dp-size", "2", "--dist-init-addr", "h:1234"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: --dp-size > 1 cannot be combined")


# -- a real server with two replicas ----------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_flux_dir, tmp_path_factory) -> ServerProcess:
    srv = start_server(
        tiny_flux_dir, tmp_path_factory.mktemp("replicas"),
        "--dp-size", "2", "--max-running-requests", "1", "--no-warmup", "--shutdown-timeout", "4",
        "--max-inference-steps", "100000",
    )  # fmt: skip
    try:
        srv.wait_ready()
        srv.wait_for(
            lambda: all(r["state"] == "ready" for r in srv.info()["replicas"]), 120, what="both ready"
        )
        yield srv
    finally:
        if srv.process.poll() is None:
            srv.process.kill()
            srv.process.wait(30)


def post(srv: ServerProcess, steps: int, timeout: float = 60) -> httpx.Response:
    body = {"prompt": "a red square", "size": f"{SIZE}x{SIZE}", "num_inference_steps": steps}
    return httpx.post(f"{srv.base_url}/v1/images/generations", json=body, timeout=timeout)


def replicas_info(srv: ServerProcess) -> list[dict]:
    return srv.info()["replicas"]


def test_openai_sdk_requests_spread_over_both_replicas(server) -> None:
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=60)

    def generate(i: int) -> int:
        extra = {"num_inference_steps": 8, "seed": i}
        response = client.images.generate(prompt=f"shape {i}", size=f"{SIZE}x{SIZE}", extra_body=extra)
        return len(response.data[0].b64_json or "")

    with ThreadPoolExecutor(4) as pool:
        assert all(size > 0 for size in pool.map(generate, range(4)))
    replicas = replicas_info(server)
    completed = [r["completed"] for r in replicas]
    assert sum(completed) == 4 and min(completed) >= 1, replicas  # both served some


def test_streamed_previews_come_from_each_requests_own_replica(server) -> None:
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=60)
    before = [r["completed"] for r in replicas_info(server)]

    def stream(i: int) -> list[str]:
        extra = {"num_inference_steps": 4, "seed": i}
        events = client.images.generate(
            prompt=f"fox {i}", size=f"{SIZE}x{SIZE}", stream=True, partial_images=1, extra_body=extra
        )
        return [event.type for event in events]

    with ThreadPoolExecutor(2) as pool:
        kinds = list(pool.map(stream, range(2)))
    assert kinds == [["image_generation.partial_image", "image_generation.completed"]] * 2
    after = [r["completed"] for r in replicas_info(server)]
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1]  # ties are taken in turn


def test_server_info_and_metrics_show_each_replica(server) -> None:
    info = server.info()
    replicas = info["replicas"]
    assert [r["replica"] for r in replicas] == [0, 1] and info["server_args"]["dp_size"] == 2
    assert all(r["state"] == "ready" and r["restarts"] == 0 and r["platform"] == "cpu" for r in replicas)
    assert replicas[0]["pid"] != replicas[1]["pid"] and [r["device_indices"] for r in replicas] == [[0], [1]]
    assert info["engine"]["state"] == "ready" and info["engine"]["family"] == "flux"
    text = httpx.get(f"{server.base_url}/metrics").text
    for i in ("0", "1"):
        assert f'diffserve_replica_engine_up{{replica="{i}"}} 1.0' in text
        assert f'diffserve_replica_queue_depth{{replica="{i}"}} 0.0' in text
        assert f'diffserve_replica_running_requests{{replica="{i}"}} 0.0' in text
    assert "diffserve_engine_ready 1.0" in text
    probe = httpx.get(f"{server.base_url}/health_generate", timeout=60)  # routed like any request
    assert probe.status_code == 200 and probe.json()["status"] == "ok", probe.text


def test_a_killed_replica_fails_its_request_and_restarts_while_the_other_serves(server) -> None:
    result: dict[str, httpx.Response] = {}
    thread = threading.Thread(target=lambda: result.setdefault("long", post(server, LONG_STEPS)))
    thread.start()
    busy = server.wait_for(
        lambda: [r for r in replicas_info(server) if r["running"] == 1], 30, what="the long request running"
    )
    victim, pid = busy[0]["replica"], busy[0]["pid"]
    os.kill(pid, signal.SIGKILL)
    thread.join(30)
    assert result["long"].status_code == 503, result["long"].text
    assert result["long"].json()["error"]["code"] == "engine_died"
    # The other replica answers while the killed one restarts.
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert post(server, STEPS).status_code == 200
    assert replicas_info(server)[1 - victim]["state"] == "ready"

    def restarted() -> bool:
        r = replicas_info(server)[victim]
        return r["state"] == "ready" and r["restarts"] == 1 and r["pid"] != pid

    server.wait_for(restarted, 120, what="the killed replica restarted")
    assert replicas_info(server)[1 - victim]["restarts"] == 0


class RawPost:
    """A generation POSTed over a plain socket: its answer read later, or the connection closed (the
    client leaving, which cancels the request)."""

    def __init__(self, srv: ServerProcess, steps: int) -> None:
        body = json.dumps({"prompt": "a red square", "size": f"{SIZE}x{SIZE}", "num_inference_steps": steps})
        head = (
            "POST /v1/images/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        self.sock = socket.create_connection(("127.0.0.1", srv.port), timeout=120)
        self.sock.sendall(head.encode() + body.encode())

    def response(self) -> tuple[int, dict]:
        data = b""
        while chunk := self.sock.recv(65536):
            data += chunk
        self.sock.close()
        head, _, body = data.partition(b"\r\n\r\n")
        return int(head.split()[1]), json.loads(body)


def test_requests_queued_on_a_killed_replica_complete_on_the_other(server) -> None:
    """Issue 31 item 17: SIGKILL of a replica with queued requests: they run on the other replica; the
    one it was running gets 503 `engine_died` saying it had started."""
    server.wait_for(lambda: all(r["state"] == "ready" for r in replicas_info(server)), 120, what="both ready")
    longs = [RawPost(server, LONG_STEPS) for _ in range(2)]  # one running on each replica (ties in turn)
    server.wait_for(lambda: [r["running"] for r in replicas_info(server)] == [1, 1], 30, what="both running")
    with ThreadPoolExecutor(4) as pool:
        quick = [pool.submit(post, server, STEPS, 240) for _ in range(4)]
        server.wait_for(
            lambda: [r["waiting"] for r in replicas_info(server)] == [2, 2], 30, what="two queued on each"
        )
        victim = replicas_info(server)[0]
        os.kill(victim["pid"], signal.SIGKILL)
        [answered], _, _ = select.select([long.sock for long in longs], [], [], 30)
        [dead_long] = [long for long in longs if long.sock is answered]
        status, body = dead_long.response()
        assert status == 503 and body["error"]["code"] == "engine_died", body
        assert "while this request was running (it had started" in body["error"]["message"], body
        [other_long] = [long for long in longs if long is not dead_long]
        other_long.sock.close()  # its client leaves: the other replica cancels it, then runs the queue
        answers = [future.result(timeout=240) for future in quick]
    assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
    resent = re.findall(r"Replica 0 died before request \S+ started: sent to replica 1", server.log())
    assert len(resent) == 2, server.log()[-3000:]

    def restarted() -> bool:
        r = replicas_info(server)[0]
        return r["state"] == "ready" and r["pid"] != victim["pid"]

    server.wait_for(restarted, 120, what="the killed replica restarted")


def test_sigterm_stops_every_replica_and_leaves_nothing_behind(server) -> None:
    pids = [r["pid"] for r in replicas_info(server)]
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(60) == 0
    assert not [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    folders = re.findall(r"Replica \d link: ZeroMQ IPC sockets in (\S+)", server.log())
    assert len(folders) == 2 and not any(Path(folder).exists() for folder in folders)
    assert "Replica 0 stopped" in server.log() and "Replica 1 stopped" in server.log()
