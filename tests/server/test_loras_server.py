"""LoRA through the HTTP server (issue 19): one real `diffserve serve` on the session's tiny FLUX with a
`--lora-dir` of random adapters (two for FLUX, one for a tiny Z-Image, one corrupt file).

- requests: the `openai` SDK's `extra_body={"loras": [...]}` changes the image; without `loras` the image
  is the base model's, byte for byte the one made before any adapter was loaded;
- admin routes: load by a path relative to --lora-dir, list, delete; the API key is required;
- errors: an unknown adapter, `../` and absolute paths, another family's file, a corrupt file (400s naming
  the field), deleting an adapter a running request uses (409); the engine keeps serving after each;
- batch invariance: concurrent requests with adapters a, a+b and none share DiT steps and each gets the
  image it gets alone (within 1 uint8 level);
- /server_info's `loras` block, and the memory budget keeping --max-lora-memory for adapters.
In-process (no server): the `loras` field's validation, and `--dp-size` replicas applying an op on every
replica or none, and replaying them on a restarted engine.
"""

from __future__ import annotations

import asyncio
import base64
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from openai import OpenAI
from PIL import Image
from push_recorder import PushRecorder
from server_process import ServerProcess, serving

from diffserve.configs.engine_args import EngineArgs
from diffserve.server import protocol as msg
from diffserve.server.args import ServerArgs
from diffserve.server.engine_client import EngineState
from diffserve.server.errors import validation_error_message
from diffserve.server.lora_client import LoraOpError
from diffserve.server.metrics import ServerMetrics
from diffserve.server.replicas import ReplicaSet
from diffserve.server.request_body import validate
from diffserve.server.schemas import EDIT_ACCEPTED_FIELDS, ImageEditRequest, VideoCreateRequest

API_KEY = "lora-key-0123"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL = "tiny-flux-lora"
BASE = {"prompt": "a red fox", "size": "32x32", "num_inference_steps": 4, "seed": 7}
MAX_LORA_MEMORY_MB = 64


@pytest.fixture(scope="module")
def lora_dir(tiny_flux_dir, tmp_path_factory) -> Path:
    from diffserve.families.z_image.tiny import build_tiny_zimage
    from diffserve.testing.tiny_lora import write_random_lora

    root = tmp_path_factory.mktemp("loras")
    folder = root / "lora-dir"
    # std 0.2: on the tiny model, visibly different images (0.05, the helper's default, moves ~1 level).
    write_random_lora(tiny_flux_dir, folder / "a.safetensors", rank=4, alpha=4.0, seed=1, std=0.2)
    write_random_lora(tiny_flux_dir, folder / "sub" / "b.safetensors", rank=2, seed=2, std=0.2)
    zimage = build_tiny_zimage(root / "tiny-zimage")
    write_random_lora(zimage, folder / "zimage.safetensors", rank=2, seed=3)
    (folder / "corrupt.safetensors").write_bytes(b"\x20\x00\x00\x00\x00\x00\x00\x00{not a header")
    write_random_lora(tiny_flux_dir, root / "outside.safetensors", rank=2, seed=4)
    return folder


@pytest.fixture(scope="module")
def srv(tiny_flux_dir, lora_dir, tmp_path_factory):
    with serving(
        tiny_flux_dir,
        tmp_path_factory.mktemp("lora-server"),
        "--served-model-name", MODEL,
        "--lora-dir", str(lora_dir),
        "--max-lora-memory", f"{MAX_LORA_MEMORY_MB}MiB",
        "--max-running-requests", "4",
        "--batch-policy", "throughput",  # requests with different adapters must share steps here
        "--max-inference-steps", "100000",  # the in-use test's request runs until it is cancelled
        api_key=API_KEY,
    ) as srv:  # fmt: skip
        yield srv


def post(srv: ServerProcess, path: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{srv.base_url}{path}", json=body, headers=AUTH, timeout=timeout)


def generate(srv: ServerProcess, **fields) -> str:
    """The b64 PNG of one image."""
    r = post(srv, "/v1/images/generations", {**BASE, **fields})
    assert r.status_code == 200, r.text
    return r.json()["data"][0]["b64_json"]


def pixels(b64: str) -> np.ndarray:
    import io

    with Image.open(io.BytesIO(base64.b64decode(b64))) as image:
        return np.asarray(image.convert("RGB")).astype(int)


def loras(srv: ServerProcess) -> dict[str, dict]:
    r = httpx.get(f"{srv.base_url}/v1/loras", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "list"
    return {entry["name"]: entry for entry in r.json()["data"]}


def assert_error(r: httpx.Response, status: int, param: str | None, *parts: str) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    for part in parts:
        assert part in error["message"], error
    return error


@pytest.fixture(scope="module")
def base_before(srv) -> str:
    """The base image, made before any adapter was loaded (no layer wrapped yet)."""
    assert loras(srv) == {}
    return generate(srv)


@pytest.fixture(scope="module")
def loaded(srv, base_before) -> dict[str, dict]:
    """Adapters a and b loaded through POST /v1/loras, by paths relative to --lora-dir."""
    for name, path in (("a", "a.safetensors"), ("b", "sub/b.safetensors")):
        r = post(srv, "/v1/loras", {"name": name, "path": path})
        assert r.status_code == 200, r.text
        card = r.json()
        assert card["id"] == card["name"] == name and card["object"] == "lora" and card["resident"]
        assert card["family"] == "flux" and card["format"] == "diffusers" and card["targets"] > 0
    return loras(srv)


def test_openai_sdk_lora_changes_the_image_and_no_lora_is_the_base_exactly(srv, base_before, loaded) -> None:
    assert loaded["a"]["rank"] == 4 and loaded["b"]["rank"] == 2 and loaded["a"]["bytes"] > 0
    client = OpenAI(base_url=f"{srv.base_url}/v1", api_key=API_KEY)
    extra = {k: v for k, v in BASE.items() if k not in ("prompt", "size")}
    response = client.images.generate(
        model=MODEL, prompt=BASE["prompt"], size=BASE["size"],
        extra_body={**extra, "loras": [{"name": "a", "scale": 0.8}]},
    )  # fmt: skip
    with_lora = pixels(response.data[0].b64_json)
    base = pixels(base_before)
    diff = int(np.abs(with_lora - base).max())
    print(f"LoRA a x0.8 vs base: max abs pixel diff {diff}, mean {np.abs(with_lora - base).mean():.2f}")
    assert diff > 8
    # No adapter: the base model bit for bit, though every targeted Linear now carries adapters.
    assert generate(srv) == base_before
    assert generate(srv, loras=[]) == base_before
    # Scale 0 turns the adapter off.
    assert int(np.abs(pixels(generate(srv, loras=[{"name": "a", "scale": 0.0}])) - base).max()) <= 1


def test_admin_routes_list_and_delete(srv, loaded) -> None:
    r = post(srv, "/v1/loras", {"name": "b-again", "path": "./sub/../sub/b.safetensors", "strict": False})
    assert r.status_code == 200, r.text
    assert set(loras(srv)) == {"a", "b", "b-again"}
    r = httpx.delete(f"{srv.base_url}/v1/loras/b-again", headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.json() == {"id": "b-again", "object": "lora.deleted", "deleted": True}
    assert set(loras(srv)) == {"a", "b"}
    r = httpx.delete(f"{srv.base_url}/v1/loras/b-again", headers=AUTH, timeout=30)
    assert_error(r, 404, "name", "no LoRA named 'b-again'")
    assert_error(
        post(srv, "/v1/loras", {"name": "a", "path": "a.safetensors"}), 409, "name", "already loaded"
    )


def test_admin_routes_need_the_api_key(srv) -> None:
    for method, path in (("GET", "/v1/loras"), ("POST", "/v1/loras"), ("DELETE", "/v1/loras/a")):
        r = httpx.request(
            method, f"{srv.base_url}{path}", json={"name": "x", "path": "a.safetensors"}, timeout=30
        )
        assert r.status_code == 401, (method, path, r.text)
        assert r.json()["error"]["type"] == "authentication_error"


def test_bad_adapters_and_paths_are_400s_and_the_engine_keeps_serving(srv, lora_dir, loaded) -> None:
    r = post(srv, "/v1/images/generations", {**BASE, "loras": [{"name": "nope", "scale": 1.0}]})
    assert_error(r, 400, "loras", "unknown LoRA 'nope'")
    r = post(srv, "/v1/images/generations", {**BASE, "loras": [{"name": "a"}, {"name": "a"}]})
    assert_error(r, 400, "loras", "twice")
    r = post(srv, "/v1/images/generations", {**BASE, "loras": [{"name": "a", "scale": "strong"}]})
    assert_error(r, 400, "loras", "valid number")
    load = "/v1/loras"
    assert_error(
        post(srv, load, {"name": "x", "path": "../outside.safetensors"}), 400, "path", "outside --lora-dir"
    )
    absolute = str(lora_dir / "a.safetensors")
    assert_error(post(srv, load, {"name": "x", "path": absolute}), 400, "path", "relative to --lora-dir")
    error = assert_error(post(srv, load, {"name": "x", "path": "zimage.safetensors"}), 400, "path")
    print("wrong family:", error["message"])
    assert "another model family" in error["message"] and error["code"] == "invalid_lora"
    error = assert_error(post(srv, load, {"name": "x", "path": "corrupt.safetensors"}), 400, "path")
    print("corrupt:", error["message"])
    assert "corrupt.safetensors" in error["message"]
    assert_error(post(srv, load, {"name": "x", "path": "missing.safetensors"}), 400, "path", "not a file")
    assert_error(post(srv, load, {"name": "../x", "path": "a.safetensors"}), 400, "name", "not valid")
    assert_error(
        post(srv, load, {"name": "x", "path": "a.safetensors", "scale": 2}), 400, "scale", "name, path"
    )
    assert "x" not in loras(srv)  # nothing was registered by a refused load
    assert generate(srv, loras=[{"name": "a"}])  # the engine serves on


def test_deleting_an_adapter_in_use_is_409_until_its_request_ends(srv, loaded) -> None:
    assert post(srv, "/v1/loras", {"name": "busy", "path": "sub/b.safetensors"}).status_code == 200
    body = {**BASE, "prompt": "slow", "num_inference_steps": 100000, "loras": [{"name": "busy"}]}
    outcome: list[object] = []

    def run() -> None:  # the client gives up after a few seconds: the server cancels the request
        try:
            outcome.append(post(srv, "/v1/images/generations", body, timeout=6).status_code)
        except httpx.TimeoutException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        srv.wait_for(lambda: loras(srv)["busy"]["in_use"] == 1, timeout=30, what="the slow request to start")
        info = srv.info()["engine"]["loras"]
        assert info["live"] and {a["name"]: a["in_use"] for a in info["adapters"]}["busy"] == 1
        r = httpx.delete(f"{srv.base_url}/v1/loras/busy", headers=AUTH, timeout=30)
        error = assert_error(r, 409, "name", "used by 1 request (1 running, 0 queued)")
        assert error["code"] == "lora_in_use"
        assert generate(srv, loras=[{"name": "a"}])  # other requests run alongside
    finally:
        thread.join(30)
    assert isinstance(outcome[0], httpx.TimeoutException), outcome
    srv.wait_for(
        lambda: loras(srv)["busy"]["in_use"] == 0, timeout=30, what="the cancelled request to release it"
    )
    assert httpx.delete(f"{srv.base_url}/v1/loras/busy", headers=AUTH, timeout=30).status_code == 200


def metric(srv: ServerProcess, name: str) -> float:
    text = httpx.get(f"{srv.base_url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rpartition(" ")[2])
    return 0.0


def test_concurrent_requests_with_different_adapters_equal_each_alone(srv, loaded) -> None:
    bodies = [
        {**BASE, "num_inference_steps": 12, "seed": 11, "loras": [{"name": "a", "scale": 0.8}]},
        {
            **BASE,
            "num_inference_steps": 12,
            "seed": 12,
            "loras": [{"name": "a"}, {"name": "b", "scale": -0.5}],
        },
        {**BASE, "num_inference_steps": 12, "seed": 13},
    ]
    steps, alone = (
        metric(srv, "diffserve_batch_size_count"),
        metric(srv, 'diffserve_batch_size_bucket{le="1.0"}'),
    )
    with ThreadPoolExecutor(len(bodies)) as pool:
        together = list(pool.map(lambda body: pixels(generate(srv, **body)), bodies))
    shared = (metric(srv, "diffserve_batch_size_count") - steps) - (
        metric(srv, 'diffserve_batch_size_bucket{le="1.0"}') - alone
    )
    print(f"request-steps run in a shared DiT batch: {shared:.0f} of {12 * len(bodies)}")
    assert shared > 0
    for body, got in zip(bodies, together, strict=True):
        want = pixels(generate(srv, **body))  # alone
        diff = int(np.abs(got - want).max())
        print(f"loras {body.get('loras')}: batched vs alone max abs pixel diff {diff}")
        assert diff <= 1


def test_server_info_shows_the_adapters_and_the_reserved_memory(srv, loaded) -> None:
    engine = srv.info()["engine"]
    block = engine["loras"]
    assert block["live"] and block["enabled"] and block["merged"] == []
    assert block["max_lora_memory"] == MAX_LORA_MEMORY_MB * 2**20
    adapters = {a["name"]: a for a in block["adapters"]}
    assert {"a", "b"} <= set(adapters) and adapters["a"]["in_use"] == 0
    assert block["resident_bytes"] == sum(a["bytes"] for a in adapters.values() if a["resident"])
    memory = engine["scheduler"]["memory_model"]
    # Kept for adapters: --max-lora-memory, none were resident at start.
    assert memory["lora_reserved_mb"] == MAX_LORA_MEMORY_MB and memory["budget_mb"] > 0


# -- in-process: the request field, and --dp-size replicas -----------------------------------------------


def test_loras_field_of_edits_form_and_videos() -> None:
    form = {"prompt": "p", "image": "data:,", "loras": '[{"name": "ink", "scale": 0.5}]'}
    params = validate(ImageEditRequest, form, EDIT_ACCEPTED_FIELDS).to_sampling_params()
    assert [(c.name, c.scale) for c in params.loras] == [("ink", 0.5)]
    video = VideoCreateRequest.model_validate({"prompt": "p", "loras": [{"name": "ink"}]})
    assert [(c.name, c.scale) for c in video.to_sampling_params({"temporal_factor": 4, "max_frames": 81}, 16).loras] == [("ink", 1.0)]  # fmt: skip
    for bad, words in (
        ("not json", "JSON list"),
        ('{"name": "ink"}', "a list"),
        ('[{"weight": 1}]', "entry 0"),
    ):
        with pytest.raises(Exception) as info:
            validate(ImageEditRequest, {**form, "loras": bad}, EDIT_ACCEPTED_FIELDS)
        assert info.value.param == "loras" and words in info.value.message, info.value.message  # type: ignore[attr-defined]
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as error:
        VideoCreateRequest.model_validate({"prompt": "p", "loras": [{"name": "ink", "scale": float("inf")}]})
    message, param = validation_error_message(error.value.errors())
    assert param == "loras" and "finite" in message


STATE = {"adapters": [], "merged": [], "resident_bytes": 0, "max_lora_memory": 1}
INFO = {"task": "text-to-image", "diffusers_pipeline": "FluxPipeline", "platform": "cpu",
        "scheduler": {"max_running_requests": 1}}  # fmt: skip


def replica_set(n: int = 2) -> ReplicaSet:
    args = ServerArgs(EngineArgs(model_path="/m"), dp_size=n)
    replicas = ReplicaSet(args, ServerMetrics(), lambda code, message: None)
    for client in replicas.clients:
        client._push, client.state = PushRecorder(), EngineState.STARTING
    return replicas


def report_ready(replicas: ReplicaSet, index: int) -> None:
    replicas.clients[index]._dispatch(msg.EngineReady(pid=1000 + index, info=INFO, probe_size=64))


def last_op(client) -> msg.LoadLora | msg.UnloadLora | msg.ListLoras:
    ops = [m for m in client._push.sent if isinstance(m, (msg.LoadLora, msg.UnloadLora, msg.ListLoras))]
    return ops[-1]


async def settle() -> None:
    """Let the tasks and futures waiting on the event loop run."""
    for _ in range(10):
        await asyncio.sleep(0)


async def answer(client, ok: bool = True, status: int = 400, message: str = "bad file") -> None:
    """The engine's answer to `client`'s last LoRA op."""
    await settle()
    op = last_op(client)
    adapter = {"name": getattr(op, "name", "")} if isinstance(op, msg.LoadLora) else None
    reply = (
        msg.LoraOpDone(op.op_id, STATE, adapter)
        if ok
        else msg.LoraOpFailed(op.op_id, message, status, "path")
    )
    client._dispatch(reply)
    await settle()


def test_replicas_load_everywhere_or_nowhere_and_a_restarted_replica_replays() -> None:
    async def scenario() -> None:
        replicas = replica_set(2)
        first, second = replicas.clients
        report_ready(replicas, 0)
        report_ready(replicas, 1)
        # Replica 1 refuses: replica 0's load is undone, and the refusal is the answer.
        task = asyncio.create_task(replicas.load_lora("a", "a.safetensors"))
        await answer(first)
        await answer(second, ok=False)
        assert isinstance(last_op(first), msg.UnloadLora)  # the undo
        await answer(first)
        with pytest.raises(LoraOpError) as refused:
            await task
        assert refused.value.status == 400 and "replica 1: bad file" in str(refused.value)
        assert first.loras.changes == [] and second.loras.changes == []
        # Both load it: kept by each for replay.
        task = asyncio.create_task(replicas.load_lora("a", "a.safetensors"))
        await answer(first)
        await answer(second)
        assert (await task).adapter == {"name": "a"}
        assert [c.name for c in first.loras.changes] == ["a"] == [c.name for c in second.loras.changes]
        # An unload where replica 1 no longer has it: done; where no replica has it: 404.
        task = asyncio.create_task(replicas.unload_lora("a"))
        await answer(first)
        await answer(second, ok=False, status=404, message="no LoRA named 'a'")
        await task
        task = asyncio.create_task(replicas.unload_lora("a"))
        await answer(first, ok=False, status=404, message="no LoRA named 'a'")
        await answer(second, ok=False, status=404, message="no LoRA named 'a'")
        with pytest.raises(LoraOpError) as missing:
            await task
        assert missing.value.status == 404
        # Replica 1 restarts; a load meanwhile reaches replica 0 now and replica 1 once it is back.
        second.state = EngineState.RESTARTING
        task = asyncio.create_task(replicas.load_lora("c", "c.safetensors"))
        await answer(first)
        await task
        before = len(second._push.sent)
        report_ready(replicas, 1)
        await settle()
        replayed = second._push.sent[before:]
        assert [(type(m).__name__, m.name) for m in replayed] == [("LoadLora", "c")]
        assert second.state == EngineState.RESTARTING  # not ready before its adapters are back
        await answer(second)
        assert second.state == EngineState.READY and second.engine_info["loras"] == STATE
        replicas.abort("test over")

    asyncio.run(scenario())
