"""The Ray Serve application builder: `diffserve.deploy.app:build_app(args) -> ray.serve.Application`.

`args` is the dict spec.py documents (`{"models": [...], "server": {...}}`); the same builder serves
`serve run diffserve.deploy.app:build_app models='[...]'`, a RayService's `serveConfigV2`
(`import_path: diffserve.deploy.app:build_app` with `args:`) and `diffserve serve --ray`.

The application: per model, an `EngineReplica` deployment named `EngineReplica-<model id>` (replica.py:
one diffserve engine per replica; its replica count fixed or autoscaled on ongoing requests; routed by
router.py's fewest waiting steps), or for a model with `disaggregate` three deployments, `Encoder-`,
`Denoiser-` and `Decoder-<model id>` (disaggregated.py: the denoiser in the engine replicas' place, the
other two called by it); and one `Ingress` deployment (ingress.py: diffserve's FastAPI app, all routes,
served at `/` by Ray Serve's proxy).
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from diffserve.deploy.disaggregated import DenoiserReplica
from diffserve.deploy.ingress import Ingress
from diffserve.deploy.replica import EngineReplica
from diffserve.deploy.router import STATS_PERIOD_S, WaitingStepsRouter
from diffserve.deploy.spec import (
    AppSpec,
    ModelSpec,
    deployment_name,
    model_id,
    parse_app_args,
    stage_deployment_name,
)
from diffserve.server.args import ServerArgs

INGRESS_NAME = "Ingress"
#: Calls one replica takes beyond its engine's running slots and queue: the control calls (cancel, LoRA
#: ops, info) that must reach a busy replica.
CONTROL_CALLS = 16
#: HTTP requests the ingress serves at once (long generations and streams: as `--max-connections`).
INGRESS_MAX_ONGOING = 1024


def max_ongoing(server_args: ServerArgs) -> int:
    """The calls one replica takes at once: its engine queues and refuses (429) as the single server's,
    so Ray Serve hands it every job, and the control calls besides."""
    return server_args.engine_args.max_running_requests + server_args.max_queue_size + CONTROL_CALLS


def waiting_steps_router() -> RequestRouterConfig:
    """Ray Serve's router config for the deployments the ingress sends jobs to (router.py)."""
    return RequestRouterConfig(
        request_router_class=WaitingStepsRouter, request_routing_stats_period_s=STATS_PERIOD_S
    )


def replica_deployment(spec: AppSpec, index: int) -> Application:
    """Model `index`'s deployment the ingress calls, bound: its `EngineReplica`s with their ServerArgs,
    or for a disaggregated model its stages (`stage_deployments`)."""
    model = spec.models[index]
    if model.disaggregate is not None:
        return stage_deployments(spec, model)
    server_args = spec.server_args(model)
    deployment = serve.deployment(
        EngineReplica,
        name=deployment_name(model_id(model)),
        max_ongoing_requests=max_ongoing(server_args),
        request_router_config=waiting_steps_router(),
        **model.deployment_options(),
    )
    return deployment.bind(server_args)


def stage_deployments(spec: AppSpec, model: ModelSpec) -> Application:
    """A disaggregated model's three deployments (disaggregated.py), each with its stage's ServerArgs and
    options: the encoder's and decoder's `EngineReplica`s (routed by Ray's default router: their calls
    come from the denoisers), bound into the `DenoiserReplica` deployment, which the ingress calls."""
    stages = {}
    for stage in ("encoder", "decoder"):
        server_args = spec.server_args(model, stage)
        deployment = serve.deployment(
            EngineReplica,
            name=stage_deployment_name(model, stage),
            max_ongoing_requests=max_ongoing(server_args),
            **model.stage_deployment_options(stage),
        )
        stages[stage] = deployment.bind(server_args)
    server_args = spec.server_args(model, "denoiser")
    denoiser = serve.deployment(
        DenoiserReplica,
        name=stage_deployment_name(model, "denoiser"),
        max_ongoing_requests=max_ongoing(server_args),
        request_router_config=waiting_steps_router(),
        **model.stage_deployment_options("denoiser"),
    )
    return denoiser.bind(server_args, stages["encoder"], stages["decoder"])


def build_app(args: dict[str, Any]) -> Application:
    """The Ray Serve application for `args` (spec.py; AppArgsError lists what is wrong with them)."""
    spec = parse_app_args(args)
    handles = {model_id(model): replica_deployment(spec, i) for i, model in enumerate(spec.models)}
    ingress = serve.deployment(
        serve.ingress()(Ingress),
        name=INGRESS_NAME,
        num_replicas=1,  # it holds the video job records and the url files (ingress.py)
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=INGRESS_MAX_ONGOING,
    )
    return ingress.bind(spec, handles)
