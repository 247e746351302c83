"""`disaggregate` in the Ray application's args (spec.py) and `serve --ray --disaggregate` (cli_args.py),
without Ray: each stage's deployment name, Ray Serve options and engine flags; the denoiser's replicas
and resources given once; stages on one device with the native backend; the flags' defaults and errors."""

from __future__ import annotations

import pytest

from diffserve.cli.main import main
from diffserve.configs.demo_model import demo_model_path
from diffserve.deploy import spec
from diffserve.deploy.cli_args import RayServeArgs
from diffserve.errors import UserError

MODEL = {"model_path": "/models/FLUX.1-dev", "name": "flux"}


def problems(model: dict) -> str:
    with pytest.raises(spec.AppArgsError) as info:
        spec.parse_app_args({"models": [{**MODEL, **model}]})
    return str(info.value)


def test_each_stage_has_its_deployment_options_and_engine_flags() -> None:
    app = spec.parse_app_args({"models": [{
        **MODEL, "min_replicas": 1, "max_replicas": 4, "engine_args": {"max_running_requests": 4},
        "disaggregate": {
            "encoder": {"num_replicas": 2, "ray_actor_options": {"num_gpus": 0.5},
                        "engine_args": {"dit_cpu_offload": True}},
            "denoiser": {"ray_actor_options": {"num_gpus": 1}},
        },
    }]})  # fmt: skip
    model = app.models[0]
    names = [spec.stage_deployment_name(model, stage) for stage in spec.STAGE_PHASES]
    assert names == ["Encoder-flux", "Denoiser-flux", "Decoder-flux"]
    assert spec.entry_deployment_name(model) == "Denoiser-flux"  # where the ingress sends the jobs
    assert model.stage_deployment_options("encoder") == {
        "ray_actor_options": {"num_cpus": 1, "num_gpus": 0.5}, "num_replicas": 2
    }  # fmt: skip
    assert model.stage_deployment_options("decoder") == {
        "ray_actor_options": {"num_cpus": 1},
        "num_replicas": 1,
    }
    denoiser = model.stage_deployment_options("denoiser")  # the model's replica fields: autoscaled
    assert denoiser["ray_actor_options"] == {"num_cpus": 1, "num_gpus": 1}
    assert (
        denoiser["autoscaling_config"]["min_replicas"],
        denoiser["autoscaling_config"]["max_replicas"],
    ) == (1, 4)
    encoder, decoder = (app.server_args(model, stage).engine_args for stage in ("encoder", "decoder"))
    assert encoder.dit_cpu_offload and not decoder.dit_cpu_offload  # a stage's flags over the model's
    assert encoder.max_running_requests == decoder.max_running_requests == 4


def test_a_model_without_stages_keeps_its_one_deployment() -> None:
    model = spec.parse_app_args({"models": [MODEL]}).models[0]
    assert spec.entry_deployment_name(model) == "EngineReplica-flux"
    with pytest.raises(ValueError, match="not disaggregated"):
        model.stage_deployment_options("encoder")


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ({"num_replicas": 2, "disaggregate": {"denoiser": {"num_replicas": 1}}},
         "the model's num_replicas both set the denoiser's replicas"),
        ({"max_replicas": 3, "disaggregate": {"denoiser": {"num_replicas": 1}}},
         "the model's max_replicas both set the denoiser's replicas"),
        ({"ray_actor_options": {"num_gpus": 1}, "disaggregate": {"denoiser": {"ray_actor_options": {"num_gpus": 1}}}},
         "both set the denoiser's resources"),
        ({"disaggregate": {"encoder": {"engine_args": {"num_gpus": 2}}}},
         "disaggregate.encoder: num_gpus 2: a disaggregated stage's engine runs on one device"),
        ({"disaggregate": {"decoder": {"engine_args": {"backend": "diffusers"}}}},
         "disaggregated stages need diffserve's native pipelines"),
        ({"disaggregate": {"decoder": {"engine_args": {"dit_offload": True}}}},
         "disaggregate.decoder.engine_args:"),
        ({"disaggregate": {"upscaler": {}}}, "models.0.disaggregate.upscaler: Extra inputs are not permitted"),
        ({"disaggregate": {"encoder": {"num_replicas": 0}}}, "models.0.disaggregate.encoder.num_replicas"),
    ],
)  # fmt: skip
def test_invalid_stages_say_where_and_what(model: dict, expected: str) -> None:
    assert expected in problems(model)


def test_the_flags_need_ray_and_disaggregate() -> None:
    with pytest.raises(UserError, match="--disaggregate needs --ray"):
        RayServeArgs(disaggregate=True).check()
    with pytest.raises(UserError, match="--encoder-replicas needs --disaggregate"):
        RayServeArgs(ray=True, encoder_replicas=2).check()
    assert RayServeArgs(ray=True).disaggregated() == {}
    assert RayServeArgs(ray=True, disaggregate=True).disaggregated() == {"disaggregate": {}}  # 1 and 1


def test_serve_ray_disaggregate_makes_the_stages(monkeypatch, tmp_path) -> None:
    """The command line's args, as `serve --ray` hands them to Ray Serve (not started here)."""
    import diffserve.deploy.run

    given: list[dict] = []
    monkeypatch.setattr(diffserve.deploy.run, "serve_on_ray", lambda args, *rest: given.append(args) or 0)
    command = ["serve", "--ray", "--disaggregate", "--decoder-replicas", "2", "--num-replicas", "3",
               "--model-path", str(demo_model_path()), "--output-path", str(tmp_path)]  # fmt: skip
    assert main(command) == 0
    model = spec.parse_app_args(given[0]).models[0]
    assert model.disaggregate is not None and model.disaggregate.decoder.num_replicas == 2
    assert model.stage_deployment_options("encoder")["num_replicas"] == 1
    assert model.stage_deployment_options("denoiser")["num_replicas"] == 3  # the replica flags: denoisers
