"""diffserve on Ray Serve (issue 32, deploy/): a real two-node Ray cluster on the loopback (a head and a
worker node of 1 CPU each, `ray.cluster_utils.Cluster`), one application serving two models at one
address: the shipped demo model on 2 replicas (one per node) and a tiny Wan (text-to-video) on one.

Through the official `openai` SDK: images equal to the in-process API's for the same seed, a url image
served by the ingress, a streamed image with a preview, an edit (multipart), a /v1/videos job (create,
poll, download); requests spread over both nodes (/server_info names each replica's node and what it
served); /v1/models lists both models, an unknown model is a 404 naming them; /metrics labels each
model; a LoRA loaded through /v1/loras reaches every replica. Last, a replica killed under load: every
request gets its image or a 503, and Ray Serve's replacement serves, the LoRA loaded before it started
included.

One application for the module (and the autoscaling test's, last) on the cluster tests/deploy/conftest.py
shares with test_ray_disaggregated.py (about two minutes on 2 busy cores).
"""

from __future__ import annotations

import base64
import io
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
from PIL import Image

ray = pytest.importorskip("ray", reason='the Ray Serve tests need the extra: pip install "diffserve[ray]"')
pytest.importorskip("ray.serve", reason='the Ray Serve tests need the extra: pip install "diffserve[ray]"')
openai = pytest.importorskip("openai")

DEMO = "shapes-demo"
WAN = "tiny-wan"
SIZE, STEPS, SEED = 64, 4, 42
PROMPT = "a large red circle in the center on a black background"
READY_TIMEOUT_S = 300


def pixels(data: bytes | str) -> np.ndarray:
    raw = base64.b64decode(data) if isinstance(data, str) else data
    return np.asarray(Image.open(io.BytesIO(raw)).convert("RGB"))


def same_image(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal within one uint8 level: concurrent requests may share a DiT batch or run alone, whichever the
    timing gives, and batched equals alone to that bar."""
    return a.shape == b.shape and int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max()) <= 1


def png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 40, 40)).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory):
    from diffserve.families.wan.tiny import TinyWanSpec, build_tiny_wan

    return build_tiny_wan(tmp_path_factory.mktemp("tiny-wan"), TinyWanSpec())


@pytest.fixture(scope="module")
def app(cluster, wan_dir, lora_dir, tmp_path_factory):
    """The application: the demo model on 2 replicas (1 CPU each: one per node) and the tiny Wan on one;
    deleted after the module (the autoscaling test's, once it has replaced it)."""
    from ray import serve

    from diffserve.configs.demo_model import demo_model_path
    from diffserve.deploy.app import build_app

    output = tmp_path_factory.mktemp("ray-out")
    args = {
        "models": [
            {
                "model_path": str(demo_model_path()),
                "num_replicas": 2,
                "engine_args": {"lora_dir": str(lora_dir)},
            },
            {
                "model_path": str(wan_dir),
                "name": WAN,
                "num_replicas": 1,
                "ray_actor_options": {"num_cpus": 0},
            },
        ],
        "server": {"output_path": str(output), "log_level": "warning"},
    }
    started = time.monotonic()
    try:
        serve.run(build_app(args), name="diffserve", route_prefix="/")
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            health = httpx.get(f"{cluster.base_url}/health", timeout=10)
            info = httpx.get(f"{cluster.base_url}/server_info", timeout=10).json()
            demo_ready = sum(r["state"] == "ready" for r in info["models"][DEMO]["replicas"]) == 2
            if health.status_code == 200 and demo_ready:
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"not ready after {READY_TIMEOUT_S} s: {health.text}")
        print(f"application ready in {time.monotonic() - started:.1f} s")
        yield SimpleNamespace(base_url=cluster.base_url, output=output)
    finally:
        for name in list(serve.status().applications):  # this one, or the autoscaling test's
            serve.delete(name)


@pytest.fixture(scope="module")
def client(app) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{app.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline():
    """The in-process API on the demo model, one torch thread as the replicas (Ray's 1-CPU workers)."""
    import torch

    from diffserve.api import DiffGenerator
    from diffserve.configs.demo_model import demo_model_path

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield DiffGenerator.from_pretrained(demo_model_path(), show_progress=False)
    finally:
        torch.set_num_threads(threads)


def server_info(app) -> dict:
    return httpx.get(f"{app.base_url}/server_info", timeout=30).json()


# -- one address, two models -------------------------------------------------------------------------
def test_models_are_listed_and_an_unknown_one_is_a_404_naming_them(app, client) -> None:
    assert sorted(m.id for m in client.models.list().data) == sorted([DEMO, WAN])
    with pytest.raises(openai.NotFoundError) as info:
        client.images.generate(model="nope", prompt=PROMPT, size=f"{SIZE}x{SIZE}")
    error = info.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "'nope'" in error["message"] and DEMO in error["message"] and WAN in error["message"]
    video_route = httpx.post(
        f"{app.base_url}/v1/images/generations", json={"model": WAN, "prompt": "x"}, timeout=30
    )
    assert video_route.status_code == 400 and "/v1/videos" in video_route.text  # the model's own app


# -- images --------------------------------------------------------------------------------------------
def test_images_equal_the_in_process_api_for_the_same_seed(app, client, offline) -> None:
    response = client.images.generate(
        model=DEMO,
        prompt=PROMPT,
        n=2,
        size=f"{SIZE}x{SIZE}",
        extra_body={"seed": SEED, "num_inference_steps": STEPS},
    )
    expected = offline.generate(PROMPT, height=SIZE, width=SIZE, num_inference_steps=STEPS, seed=SEED, num_outputs_per_prompt=2)  # fmt: skip
    for data, image in zip(response.data, expected.images, strict=True):
        np.testing.assert_array_equal(pixels(data.b64_json), np.asarray(image.convert("RGB")))
    # A request without `model` goes to the default model (the first listed).
    plain = httpx.post(f"{app.base_url}/v1/images/generations", timeout=60, json={
        "prompt": PROMPT, "size": f"{SIZE}x{SIZE}", "seed": SEED, "num_inference_steps": STEPS})  # fmt: skip
    assert plain.status_code == 200, plain.text
    np.testing.assert_array_equal(
        pixels(plain.json()["data"][0]["b64_json"]), pixels(response.data[0].b64_json)
    )


def test_a_url_image_is_served_by_the_ingress(app, client) -> None:
    body = {"seed": SEED, "num_inference_steps": STEPS}
    response = client.images.generate(model=DEMO, prompt=PROMPT, size=f"{SIZE}x{SIZE}", response_format="url", extra_body=body)  # fmt: skip
    url = response.data[0].url
    assert url.startswith(app.base_url) and url.endswith("/content")
    image = httpx.get(url, timeout=30)
    assert image.status_code == 200 and image.headers["content-type"] == "image/png"
    b64 = client.images.generate(model=DEMO, prompt=PROMPT, size=f"{SIZE}x{SIZE}", extra_body=body)
    np.testing.assert_array_equal(pixels(image.content), pixels(b64.data[0].b64_json))
    assert list(Path(app.output, DEMO).glob("*.png")), "the ingress keeps the url files in the model's folder"


def test_a_streamed_image_brings_its_preview_then_the_image(app, client) -> None:
    body = {"seed": SEED, "num_inference_steps": STEPS}
    events = list(client.images.generate(
        model=DEMO, prompt=PROMPT, size=f"{SIZE}x{SIZE}", stream=True, partial_images=1, extra_body=body))  # fmt: skip
    assert [e.type for e in events] == ["image_generation.partial_image", "image_generation.completed"]
    plain = client.images.generate(model=DEMO, prompt=PROMPT, size=f"{SIZE}x{SIZE}", extra_body=body)
    np.testing.assert_array_equal(pixels(events[-1].b64_json), pixels(plain.data[0].b64_json))


def test_an_edit_sent_as_multipart(app, client) -> None:
    response = client.images.edit(
        model=DEMO, image=("in.png", png(SIZE, SIZE), "image/png"), prompt="a blue square", size=f"{SIZE}x{SIZE}",
        extra_body={"seed": 3, "num_inference_steps": STEPS, "strength": 0.5},
    )  # fmt: skip
    assert pixels(response.data[0].b64_json).shape == (SIZE, SIZE, 3)


# -- videos --------------------------------------------------------------------------------------------
def test_a_video_job_is_created_polled_and_downloaded(app, client) -> None:
    import av

    video = client.videos.create(
        model=WAN, prompt="a red fox running", size="32x32", seconds="1", extra_body={"fps": 8, "seed": 7, "num_inference_steps": 2}
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while video.status not in ("completed", "failed") and time.monotonic() < deadline:
        time.sleep(0.2)
        video = client.videos.retrieve(video.id)
    assert video.status == "completed", video
    data = client.videos.download_content(video.id).read()
    with av.open(io.BytesIO(data)) as container:
        frames = list(container.decode(container.streams.video[0]))
    assert data[4:8] == b"ftyp" and len(frames) == 9 and frames[0].width == 32
    assert [v.id for v in client.videos.list().data][:1] == [video.id]

    # DELETE cancels a running job on its replica.
    body = {
        "model": WAN,
        "prompt": "a long clip",
        "size": "32x32",
        "num_frames": 5,
        "num_inference_steps": 1000,
    }
    job = httpx.post(f"{app.base_url}/v1/videos", json=body, timeout=30).json()
    while client.videos.retrieve(job["id"]).status == "queued":
        time.sleep(0.05)
    deleted = httpx.delete(f"{app.base_url}/v1/videos/{job['id']}", timeout=60)
    assert deleted.status_code == 200 and deleted.json()["deleted"], deleted.text
    assert client.videos.retrieve(job["id"]).status == "cancelled"


# -- spreading, state, metrics -------------------------------------------------------------------------
def test_concurrent_requests_spread_over_both_nodes(app, client) -> None:
    before = {r["replica"]: r["completed"] for r in server_info(app)["models"][DEMO]["replicas"]}

    def one(seed: int) -> None:
        client.images.generate(model=DEMO, prompt=PROMPT, size=f"{SIZE}x{SIZE}", extra_body={"seed": seed, "num_inference_steps": 12})  # fmt: skip

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(16)))
    time.sleep(1.5)  # the replicas' next reports
    replicas = server_info(app)["models"][DEMO]["replicas"]
    served = {r["replica"]: r["completed"] - before.get(r["replica"], 0) for r in replicas}
    nodes = {r["node"]["id"] for r in replicas}
    print(f"requests served per replica: {served}; nodes: {nodes}")
    assert len(nodes) == 2 and all(count > 0 for count in served.values()), served
    assert sum(served.values()) >= 16


def test_server_info_health_and_metrics_cover_every_model(app) -> None:
    info = server_info(app)
    assert info["model"] == DEMO and set(info["models"]) == {DEMO, WAN}
    assert [r["state"] for r in info["models"][WAN]["replicas"]] == ["ready"]
    assert httpx.get(f"{app.base_url}/health", timeout=10).json() == {"status": "ok"}
    probes = httpx.get(f"{app.base_url}/health_generate", timeout=120)
    assert probes.status_code == 200 and set(probes.json()["models"]) == {DEMO, WAN}, probes.text
    metrics = httpx.get(f"{app.base_url}/metrics", timeout=10).text
    images = rf'^diffserve_images_generated_total\{{model="{DEMO}"\}} [1-9]'
    assert re.search(images, metrics, re.M), metrics[:2000]
    assert re.search(rf'^diffserve_videos_generated_total\{{model="{WAN}"\}} 1\.0', metrics, re.M)
    up = rf'^diffserve_replica_engine_up\{{model="{DEMO}",replica="\w+"\}} 1\.0'
    assert len(re.findall(up, metrics, re.M)) == 2


def lora_images(client, n: int) -> list[np.ndarray]:
    """`n` images with the adapter `ink` at once, seed SEED (each the same within a level, whichever replica
    made it)."""
    body = {"seed": SEED, "num_inference_steps": STEPS, "loras": [{"name": "ink", "scale": 1.0}]}

    def one(_: int) -> np.ndarray:
        response = client.images.generate(model=DEMO, prompt=PROMPT, size=f"{SIZE}x{SIZE}", extra_body=body)
        return pixels(response.data[0].b64_json)

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def test_a_lora_loaded_through_the_api_reaches_every_replica(app, client) -> None:
    url = f"{app.base_url}/v1/loras"
    lora = {"name": "ink", "path": "ink.safetensors"}
    assert httpx.post(url, json=lora, timeout=60).status_code == 400  # which model: ?model= is needed
    loaded = httpx.post(url, params={"model": DEMO}, json=lora, timeout=60)
    assert loaded.status_code == 200, loaded.text
    listed = httpx.get(url, params={"model": DEMO}, timeout=30).json()
    assert [a["id"] for a in listed["data"]] == ["ink"]
    images = lora_images(client, 4)
    assert all(same_image(images[0], image) for image in images[1:])
    base = client.images.generate(model=DEMO, prompt=PROMPT, size=f"{SIZE}x{SIZE}", extra_body={"seed": SEED, "num_inference_steps": STEPS})  # fmt: skip
    assert not np.array_equal(images[0], pixels(base.data[0].b64_json)), "the adapter changes the image"
    app.lora_image = images[0]  # the fault test's replacement replica must make it too


# -- faults (last: it replaces a replica) --------------------------------------------------------------
def test_a_killed_replica_loses_no_request_and_is_replaced(app, client) -> None:
    victim = server_info(app)["models"][DEMO]["replicas"][0]

    def one(seed: int) -> int | str:
        try:
            client.images.generate(model=DEMO, prompt=PROMPT, size=f"{SIZE}x{SIZE}", extra_body={"seed": seed, "num_inference_steps": 30})  # fmt: skip
            return 200
        except openai.APIStatusError as exc:
            return f"{exc.status_code} {exc.body}"

    def running(replica: str) -> bool:
        replicas = server_info(app)["models"][DEMO]["replicas"]
        return any(r["replica"] == replica and r["running"] > 0 for r in replicas)

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, seed) for seed in range(16)]
        deadline = time.monotonic() + 30
        while not running(victim["replica"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        # SIGKILL the replica's Ray worker (its engine process follows it) mid-run.
        os.kill(victim["node"]["replica_pid"], signal.SIGKILL)
        outcomes = [future.result(timeout=300) for future in futures]
    print(f"outcomes: {outcomes}")
    others = [o for o in outcomes if o != 200]
    assert all(isinstance(o, str) and o.startswith("503") and "engine_died" in o for o in others), others
    assert outcomes.count(200) >= 8, outcomes  # the other replica kept serving (and took the unstarted ones)

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        replicas = server_info(app)["models"][DEMO]["replicas"]
        fresh = [r for r in replicas if r["replica"] != victim["replica"] and r["state"] == "ready"]
        if len(fresh) == 2:
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"no replacement within 60 s: {replicas}")
    # Both serve, the replacement with the adapter loaded through /v1/loras before it started.
    before = {r["replica"]: r["completed"] for r in fresh}
    images = lora_images(client, 8)
    assert all(same_image(app.lora_image, image) for image in images)
    time.sleep(1.5)
    after = {r["replica"]: r["completed"] for r in server_info(app)["models"][DEMO]["replicas"]}
    assert all(after[k] > before[k] for k in before), (before, after)
    unloaded = httpx.delete(f"{app.base_url}/v1/loras/ink", params={"model": DEMO}, timeout=60)
    assert unloaded.status_code == 200, unloaded.text


# -- autoscaling (after the faults: it replaces the application) ---------------------------------------
def test_autoscaling_goes_to_two_replicas_under_a_queue_and_back_to_one(app, client) -> None:
    from ray import serve

    from diffserve.configs.demo_model import demo_model_path
    from diffserve.deploy.app import build_app

    serve.delete("diffserve")  # both nodes' CPUs for the autoscaled model
    # No delays and a 1 s look-back: the load goes from 8 to none at once (the clients stop when the second
    # replica is up), so nothing here can flap; with a 1 s downscale delay and a 2 s look-back, going back
    # to one replica took 12 s instead of 3.
    model = {"model_path": str(demo_model_path()), "min_replicas": 1, "max_replicas": 2,
             "target_ongoing_requests": 1, "upscale_delay_s": 0, "downscale_delay_s": 0, "look_back_period_s": 1}  # fmt: skip
    serve.run(
        build_app({"models": [model], "server": {"log_level": "warning"}}), name="autoscale", route_prefix="/"
    )

    def ready_replicas() -> int:
        info = httpx.get(f"{app.base_url}/server_info", timeout=30).json()
        return sum(r["state"] == "ready" for r in info["replicas"])

    stop = threading.Event()

    def keep_busy(seed: int) -> None:
        """One client that sends a request after each answer until the second replica is up: the queue
        stays at 8 for as long as the scale-up takes, and no more work than that is left to finish."""
        while not stop.is_set():
            client.images.generate(model=DEMO, prompt=PROMPT, size=f"{SIZE}x{SIZE}", extra_body={"seed": seed, "num_inference_steps": 30})  # fmt: skip
            seed += 8

    deadline = time.monotonic() + READY_TIMEOUT_S
    while httpx.get(f"{app.base_url}/health", timeout=10).status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    seen = [ready_replicas()]
    assert seen == [1]
    started = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        load = [pool.submit(keep_busy, seed) for seed in range(8)]
        deadline = time.monotonic() + 90
        while seen[-1] < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
            seen.append(ready_replicas())
        scaled_up = time.monotonic()
        stop.set()
        for future in load:
            future.result(timeout=300)
    drained = time.monotonic()
    assert seen[-1] == 2, f"no second replica under a queue of 8: {seen}"
    deadline = time.monotonic() + 90
    while seen[-1] > 1 and time.monotonic() < deadline:
        time.sleep(0.2)
        seen.append(ready_replicas())
    print(f"two replicas after {scaled_up - started:.1f} s of load, the load drained {drained - scaled_up:.1f} s "
          f"later, one replica {time.monotonic() - drained:.1f} s after that")  # fmt: skip
    assert seen[-1] == 1, f"not back to one replica once idle: {seen}"
