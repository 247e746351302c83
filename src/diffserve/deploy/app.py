"""The Ray Serve application builder: `diffserve.deploy.app:build_app(args) -> ray.serve.Application`.

`args` is the dict spec.py documents (`{"models": [...], "server": {...}}`); the same builder serves
`serve run diffserve.deploy.app:build_app models='[...]'`, a RayService's `serveConfigV2`
(`import_path: diffserve.deploy.app:build_app` with `args:`) and `diffserve serve --ray`.

The application: per model, an `EngineReplica` deployment named `EngineReplica-<model id>` (replica.py:
one diffserve engine per replica; its replica count fixed or autoscaled on ongoing requests; routed by
router.py's fewest waiting steps), and one `Ingress` deployment (ingress.py: diffserve's FastAPI app,
all routes, served at `/` by Ray Serve's proxy).
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from diffserve.deploy.ingress import Ingress
from diffserve.deploy.replica import EngineReplica
from diffserve.deploy.router import STATS_PERIOD_S, WaitingStepsRouter
from diffserve.deploy.spec import AppSpec, deployment_name, model_id, parse_app_args

INGRESS_NAME = "Ingress"
#: Calls one replica takes beyond its engine's running slots and queue: the control calls (cancel, LoRA
#: ops, info) that must reach a busy replica.
CONTROL_CALLS = 16
#: HTTP requests the ingress serves at once (long generations and streams: as `--max-connections`).
INGRESS_MAX_ONGOING = 1024


def replica_deployment(spec: AppSpec, index: int) -> Application:
    """Model `index`'s `EngineReplica` deployment, bound to its ServerArgs."""
    model = spec.models[index]
    server_args = spec.server_args(model)
    engine = server_args.engine_args
    router = RequestRouterConfig(
        request_router_class=WaitingStepsRouter, request_routing_stats_period_s=STATS_PERIOD_S
    )
    deployment = serve.deployment(
        EngineReplica,
        name=deployment_name(model_id(model)),
        # The engine queues and refuses (429) as the single server's: Ray Serve hands it every job.
        max_ongoing_requests=engine.max_running_requests + server_args.max_queue_size + CONTROL_CALLS,
        request_router_config=router,
        **model.deployment_options(),
    )
    return deployment.bind(server_args)


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
