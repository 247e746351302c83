"""Disaggregated stages on Ray Serve (issue 32, deploy/disaggregated.py): the shipped demo model's text
encoding, denoising and decoding as three deployments on a real two-node Ray cluster on the loopback,
the encoder and decoder on the head node ("small" devices) and the denoiser on the worker ("big"), so the
requests' tensors cross nodes through Ray's object store.

Through the official `openai` SDK: an image equal, within 1 uint8 level, to the in-process API's for the
same prompt and seed; two concurrent requests share DiT steps on the denoiser (the DiT batch sizes the
ingress counts at /metrics); a streamed image with a preview (made on the denoiser); a LoRA loaded
through /v1/loras applies (on the denoiser's DiT); /health_generate's probe runs through the three
stages; a request the engine refuses is the single server's 400.

One application for the module, on the cluster tests/deploy/conftest.py shares with test_ray_serve.py
(about a minute on 2 busy cores).
"""

from __future__ import annotations

import base64
import io
import re
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
from PIL import Image

ray = pytest.importorskip("ray", reason='the Ray Serve tests need the extra: pip install "diffserve[ray]"')
pytest.importorskip("ray.serve", reason='the Ray Serve tests need the extra: pip install "diffserve[ray]"')
openai = pytest.importorskip("openai")

DEMO = "shapes-demo"
SIZE, STEPS, SEED = 64, 4, 42
#: Steps of the two concurrent requests: enough for the second to arrive while the first denoises.
BATCHED_STEPS = 80
PROMPT = "a large red circle in the center on a black background"
READY_TIMEOUT_S = 240


def pixels(data: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB"))


def metric(text: str, sample: str) -> float:
    """The value of `sample` (a name with its labels, model label aside) in a Prometheus exposition."""
    total = 0.0
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if re.sub(r',?model="[^"]*"', "", name).replace("{}", "") == sample:
            total += float(value)
    return total


@pytest.fixture(scope="module")
def app(cluster, tmp_path_factory, lora_dir):
    """The demo model disaggregated on the shared cluster (tests/deploy/conftest.py): the encoder and decoder
    on the head node ("small"), the denoiser on the worker ("big"); deleted after the module."""
    from ray import serve

    from diffserve.configs.demo_model import demo_model_path
    from diffserve.deploy.app import build_app

    small = {"num_cpus": 0, "resources": {"small": 1}}
    args = {
        "models": [
            {
                "model_path": str(demo_model_path()),
                "engine_args": {"lora_dir": str(lora_dir)},
                "disaggregate": {
                    "encoder": {"ray_actor_options": small},
                    "denoiser": {"num_replicas": 1, "ray_actor_options": {"resources": {"big": 1}}},
                    "decoder": {"ray_actor_options": small},
                },
            }
        ],
        "server": {"output_path": str(tmp_path_factory.mktemp("ray-out")), "log_level": "warning"},
    }
    started = time.monotonic()
    try:
        serve.run(build_app(args), name="diffserve", route_prefix="/")
        deadline = time.monotonic() + READY_TIMEOUT_S
        while httpx.get(f"{cluster.base_url}/health", timeout=10).status_code != 200:
            assert time.monotonic() < deadline, f"not ready after {READY_TIMEOUT_S} s"
            time.sleep(0.2)
        print(f"application ready in {time.monotonic() - started:.1f} s")
        yield SimpleNamespace(base_url=cluster.base_url, nodes=cluster.nodes)
    finally:
        for name in list(serve.status().applications):
            serve.delete(name)


@pytest.fixture(scope="module")
def client(app) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{app.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_the_stages_run_on_their_own_nodes(app) -> None:
    from ray import serve

    nodes = {}
    for stage in ("Encoder", "Denoiser", "Decoder"):
        handle = serve.get_deployment_handle(f"{stage}-{DEMO}", app_name="diffserve")
        nodes[stage] = handle.record_routing_stats.remote().result(timeout_s=60)["node_id"]
    assert nodes["Encoder"] == nodes["Decoder"] != nodes["Denoiser"], nodes


def test_pixels_equal_one_process_within_one_level(app, client) -> None:
    import torch

    from diffserve.api import DiffGenerator
    from diffserve.configs.demo_model import demo_model_path

    response = client.images.generate(
        prompt=PROMPT, size=f"{SIZE}x{SIZE}", extra_body={"seed": SEED, "num_inference_steps": STEPS}
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the replicas' engines (Ray's workers of one CPU or none)
    try:
        with DiffGenerator.from_pretrained(demo_model_path(), show_progress=False) as offline:
            expected = offline.generate(PROMPT, height=SIZE, width=SIZE, num_inference_steps=STEPS, seed=SEED)
    finally:
        torch.set_num_threads(threads)
    got = pixels(response.data[0].b64_json).astype(int)
    assert np.abs(got - np.asarray(expected.images[0]).astype(int)).max() <= 1


def test_concurrent_requests_share_dit_steps_on_the_denoiser(app, client) -> None:
    def batch_steps() -> tuple[float, float]:
        text = httpx.get(f"{app.base_url}/metrics", timeout=30).text
        return metric(text, "diffserve_batch_size_count"), metric(
            text, 'diffserve_batch_size_bucket{le="1.0"}'
        )

    steps_before, alone_before = batch_steps()

    def generate(seed: int) -> str:
        extra = {"seed": seed, "num_inference_steps": BATCHED_STEPS}
        return client.images.generate(prompt=PROMPT, size=f"{SIZE}x{SIZE}", extra_body=extra).data[0].b64_json

    with ThreadPoolExecutor(2) as pool:
        images = list(pool.map(generate, [1, 2]))
    assert all(pixels(image).shape == (SIZE, SIZE, 3) for image in images)
    steps_after, alone_after = batch_steps()
    assert steps_after - steps_before == 2 * BATCHED_STEPS  # each request's steps, counted by the ingress
    batched = (steps_after - steps_before) - (alone_after - alone_before)
    assert batched > 0, "no DiT step of the two requests ran as one batch"


def test_a_streamed_image_with_a_preview(app, client) -> None:
    body = {"seed": SEED, "num_inference_steps": STEPS}
    events = list(client.images.generate(
        prompt=PROMPT, size=f"{SIZE}x{SIZE}", stream=True, partial_images=1, extra_body=body))  # fmt: skip
    assert [e.type for e in events] == ["image_generation.partial_image", "image_generation.completed"]
    plain = client.images.generate(prompt=PROMPT, size=f"{SIZE}x{SIZE}", extra_body=body)
    np.testing.assert_array_equal(pixels(events[-1].b64_json), pixels(plain.data[0].b64_json))


def test_a_lora_loaded_through_the_api_applies(app, client) -> None:
    loaded = httpx.post(
        f"{app.base_url}/v1/loras", json={"name": "ink", "path": "ink.safetensors"}, timeout=60
    )
    assert loaded.status_code == 200, loaded.text
    body = {"seed": SEED, "num_inference_steps": STEPS}
    base = client.images.generate(prompt=PROMPT, size=f"{SIZE}x{SIZE}", extra_body=body)
    ink = client.images.generate(
        prompt=PROMPT, size=f"{SIZE}x{SIZE}", extra_body={**body, "loras": [{"name": "ink", "scale": 1.0}]}
    )
    assert not np.array_equal(pixels(ink.data[0].b64_json), pixels(base.data[0].b64_json))


def test_the_health_probe_runs_through_the_stages(app) -> None:
    probe = httpx.get(f"{app.base_url}/health_generate", timeout=120)
    assert probe.status_code == 200, probe.text


def test_a_request_the_engine_refuses_is_a_400(app) -> None:
    """The encoder's engine validates, and its refusal is the single server's answer."""
    body = {"prompt": PROMPT, "size": f"{SIZE}x{SIZE}", "skip_guidance_layers": [1]}
    response = httpx.post(f"{app.base_url}/v1/images/generations", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "skip_guidance_layers" and "FluxPipeline" in error["message"], error
    assert client_still_serves(app)


def client_still_serves(app) -> bool:
    body = {"prompt": PROMPT, "size": f"{SIZE}x{SIZE}", "num_inference_steps": 2, "seed": 1}
    return httpx.post(f"{app.base_url}/v1/images/generations", json=body, timeout=60).status_code == 200
