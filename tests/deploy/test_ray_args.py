"""The Ray Serve application's arguments and the pieces that need no Ray (issue 32, deploy/): the
builder's args validated with errors that say where and what (spec.py), `serve --ray`'s flags and the
args they make (cli_args.py), `--ray` without Ray installed, the LoRA log replicas catch up with
(lora_log.py), errors carried as data (messages.py) and the several-model dispatcher's helpers
(dispatch.py). Runs without Ray installed."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from diffserve.cli.main import main
from diffserve.configs.demo_model import demo_model_path
from diffserve.deploy import spec
from diffserve.deploy.cli_args import RayServeArgs, app_args_from
from diffserve.deploy.dispatch import body_model, labelled_metrics, read_bounded
from diffserve.deploy.lora_log import LoraLog, plan_catch_up
from diffserve.deploy.messages import ReplicaFailure
from diffserve.errors import UserError
from diffserve.server import protocol as msg
from diffserve.server.args import ServerArgs
from diffserve.server.engine_client import (
    EngineDiedError,
    EngineUnavailableError,
    JobCancelledError,
    JobFailedError,
    JobRejectedError,
    QueueFullError,
)
from diffserve.server.lora_client import LoraOpError

MODEL = {"model_path": "/models/FLUX.1-dev"}


def problems(args: dict) -> str:
    with pytest.raises(spec.AppArgsError) as info:
        spec.parse_app_args(args)
    return str(info.value)


# -- the builder's args ----------------------------------------------------------------------------
def test_valid_args_make_each_models_server_args_and_deployment_options() -> None:
    app = spec.parse_app_args(
        {
            "models": [
                {**MODEL, "name": "flux", "num_replicas": 2, "engine_args": {"quantization": "int8"}},
                {"model_path": "/models/wan", "min_replicas": 1, "max_replicas": 4, "upscale_delay_s": 5},
            ],
            "server": {"output_path": "/data/out", "max_queue_size": 8},
        }
    )
    flux, wan = (app.server_args(model) for model in app.models)
    assert (flux.model_id, flux.served_model_names, flux.max_queue_size) == ("flux", ["flux"], 8)
    assert flux.engine_args.quantization == "int8" and flux.output_dir.as_posix() == "/data/out/flux"
    assert (wan.model_id, wan.output_dir.as_posix()) == ("wan", "/data/out/wan")  # a folder per model
    assert app.models[0].deployment_options() == {"ray_actor_options": {"num_cpus": 1}, "num_replicas": 2}
    scaling = app.models[1].deployment_options()["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["max_replicas"], scaling["upscale_delay_s"]) == (1, 4, 5)
    assert scaling["target_ongoing_requests"] == 2 and scaling["downscale_delay_s"] == 600
    assert spec.deployment_name("FLUX.1 dev/x") == "EngineReplica-FLUX.1-dev-x"


def test_one_model_keeps_the_output_folder_and_the_folder_name() -> None:
    app = spec.parse_app_args({"models": [MODEL], "server": {"output_path": "/data/out"}})
    server = app.server_args(app.models[0])
    assert (server.model_id, server.output_dir.as_posix()) == ("FLUX.1-dev", "/data/out")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ({}, "models: Field required"),
        ({"models": []}, "models: List should have at least 1 item"),
        ({"models": [{**MODEL, "engine_args": {"quantisation": "int8"}}]}, "did you mean 'quantization'"),
        ({"models": [{**MODEL, "engine_args": {"num_gpus": 0}}]}, "num_gpus must be >= 1, got 0"),
        ({"models": [{**MODEL, "engine_args": {"model_path": "/x"}}]}, "must not hold model_path"),
        ({"models": [{**MODEL, "num_replicas": 2, "max_replicas": 4}]}, "num_replicas (a fixed count) or"),
        ({"models": [{**MODEL, "min_replicas": 3, "max_replicas": 2}]}, "min_replicas 3 > max_replicas 2"),
        ({"models": [{**MODEL, "min_replicas": 0, "max_replicas": 2}]}, "models.0.min_replicas"),
        ({"models": [{**MODEL, "replicas": 2}]}, "models.0.replicas: Extra inputs are not permitted"),
        ({"models": [MODEL], "server": {"port": 8000}}, "port (the port is Ray Serve's"),
        ({"models": [MODEL], "server": {"dp_size": 2}}, "replicas are Ray Serve's"),
        ({"models": [MODEL], "server": {"max_queue": 2}}, "did you mean 'max_queue_size'"),
        ({"models": [MODEL, {"model_path": "/other/FLUX.1-dev"}]}, "several are served as FLUX.1-dev"),
    ],
)
def test_invalid_args_say_where_and_what(args: dict, expected: str) -> None:
    assert expected in problems(args)


def test_the_api_keys_come_from_the_environment_as_serve_reads_them(monkeypatch) -> None:
    monkeypatch.setenv("DIFFSERVE_API_KEY", "k1,k2")
    app = spec.parse_app_args({"models": [MODEL]})
    assert app.server_args(app.models[0]).api_keys == ["k1", "k2"]
    app = spec.parse_app_args({"models": [MODEL], "server": {"api_key": "given"}})
    assert app.server_args(app.models[0]).api_key == "given"


def test_loras_from_json_become_lora_specs() -> None:
    app = spec.parse_app_args(
        {"models": [{**MODEL, "engine_args": {"loras": [{"name": "ink", "path": "/l/ink.st"}]}}]}
    )
    (lora,) = app.server_args(app.models[0]).engine_args.loras
    assert (lora.name, lora.path, lora.scale) == ("ink", "/l/ink.st", 1.0)


# -- serve --ray's flags ---------------------------------------------------------------------------
def test_ray_flags_need_ray_and_one_way_to_count_replicas() -> None:
    with pytest.raises(UserError, match="--num-replicas needs --ray"):
        RayServeArgs(num_replicas=2).check()
    with pytest.raises(UserError, match="not both"):
        RayServeArgs(ray=True, num_replicas=2, min_replicas=1, max_replicas=3).check()
    with pytest.raises(UserError, match="both --min-replicas and --max-replicas"):
        RayServeArgs(ray=True, min_replicas=1).check()
    scaled = RayServeArgs(ray=True, min_replicas=1, max_replicas=3, target_ongoing_requests=4)
    scaled.check()
    assert scaled.replicas() == {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 4}


def test_the_flags_make_one_model_per_path_with_the_same_engine_flags(tmp_path) -> None:
    from diffserve.configs.engine_args import EngineArgs

    engine = EngineArgs(model_path="a", max_running_requests=2, output_path=str(tmp_path / "out"))
    server = ServerArgs(engine, max_queue_size=5, port=9000)
    args = app_args_from(RayServeArgs(ray=True, num_replicas=3), server, ["/m/a", "/m/b"])
    assert [m["model_path"] for m in args["models"]] == ["/m/a", "/m/b"]
    assert all(
        m["num_replicas"] == 3 and m["engine_args"] == {"max_running_requests": 2} for m in args["models"]
    )
    assert args["server"] == {"max_queue_size": 5, "output_path": str(tmp_path / "out")}  # port: Ray's
    spec.parse_app_args(args)  # what the flags make, the builder takes
    with pytest.raises(UserError, match="--max-connections does not apply with --ray"):
        app_args_from(RayServeArgs(ray=True), ServerArgs(engine, max_connections=5), ["/m/a"])


def test_serve_flags_without_ray_are_one_error_line(capsys) -> None:
    assert main(["serve", "--num-replicas", "2"]) == 2
    assert capsys.readouterr().err.strip() == "error: --num-replicas needs --ray"
    assert main(["serve", "--model-path", "/a", "--model-path", "/b"]) == 2
    assert "several --model-path need --ray" in capsys.readouterr().err


def test_ray_without_the_extra_names_what_to_install(monkeypatch, capsys) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name.startswith("ray") else real(name, *a)
    )
    assert main(["serve", "--ray", "--model-path", str(demo_model_path())]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ['error: --ray needs Ray Serve, which is not installed: pip install "diffserve[ray]"']


# -- the LoRA log ----------------------------------------------------------------------------------
def test_the_lora_log_keeps_what_a_replica_must_replay() -> None:
    log = LoraLog()
    log = log.recorded(msg.LoadLora("1", "ink", "ink.safetensors"))
    log = log.recorded(msg.LoadLora("2", "oil", "oil.safetensors"))
    log = log.recorded(msg.UnloadLora("3", "ink"))  # drops the load of ink
    log = log.recorded(msg.UnloadLora("4", "start"))  # a --lora adapter: the unload stays
    assert log.version == 4 and [(type(c).__name__, c.name) for c in log.changes] == [
        ("LoadLora", "oil"),
        ("UnloadLora", "start"),
    ]
    applied = [msg.LoadLora("x", "ink", "ink.safetensors"), msg.LoadLora("y", "oil", "oil.safetensors")]
    undo, missing = plan_catch_up(log, applied)
    assert [(type(c).__name__, c.name) for c in undo] == [("UnloadLora", "ink")]
    assert [(type(c).__name__, c.name) for c in missing] == [("UnloadLora", "start")]
    assert plan_catch_up(log, list(log.changes)) == ([], [])


# -- errors as data --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "error",
    [
        EngineDiedError("gone", started=True),
        JobCancelledError(at_step=3),
        EngineUnavailableError("restarting", "engine_restarting"),
        QueueFullError("full"),
        JobRejectedError("too big", "height", 413),
        JobFailedError("bad lora", user_error=True, param="loras"),
        LoraOpError("in use", 409, "name", "lora_in_use"),
    ],
)
def test_replica_failures_rebuild_the_engine_clients_errors(error: Exception) -> None:
    again = ReplicaFailure.of(error).error()
    assert type(again) is type(error) and str(again) == str(error)
    assert vars(again) == vars(error)


# -- the dispatcher's helpers ----------------------------------------------------------------------
def test_metrics_of_several_models_are_labelled_by_model() -> None:
    text = '# HELP x_total things\n# TYPE x_total counter\nx_total{kind="a"} 2.0\n'
    merged = labelled_metrics({"m1": text, "m2": text}).decode()
    assert 'x_total{kind="a",model="m1"} 2.0' in merged and 'x_total{kind="a",model="m2"} 2.0' in merged
    assert merged.count("# TYPE x_total counter") == 1


def scope(content_type: str) -> dict:
    return {
        "type": "http",
        "headers": [(b"content-type", content_type.encode())],
        "method": "POST",
        "path": "/",
    }


def test_the_model_is_read_from_json_and_multipart_bodies() -> None:
    multipart = (
        b'--B\r\nContent-Disposition: form-data; name="prompt"\r\n\r\nhi\r\n'
        b'--B\r\nContent-Disposition: form-data; name="model"\r\n\r\nwan\r\n--B--\r\n'
    )
    cases = [
        (scope("application/json"), b'{"model": "flux", "prompt": "x"}', "flux"),
        (scope("application/json"), b'{"prompt": "x"}', None),
        (scope("application/json"), b"not json", None),
        (scope("multipart/form-data; boundary=B"), multipart, "wan"),
    ]
    for request, body, expected in cases:
        assert asyncio.run(body_model(request, body)) == expected


def test_a_body_is_read_up_to_its_limit() -> None:
    async def read(limit: int) -> bytes | None:
        messages = iter(
            [
                {"type": "http.request", "body": b"abc", "more_body": True},
                {"type": "http.request", "body": b"de"},
            ]
        )

        async def receive() -> dict:
            return next(messages)

        return await read_bounded(receive, limit)

    assert asyncio.run(read(5)) == b"abcde"
    assert asyncio.run(read(4)) is None


def test_serve_run_gives_models_and_server_as_json_text() -> None:
    app = spec.parse_app_args({"models": '[{"model_path": "/m/flux", "num_replicas": 2}]', "server": "{}"})
    assert app.models[0].num_replicas == 2
    assert "must be JSON" in problems({"models": "[{nope"})
