"""The ingress deployment: diffserve's own FastAPI app (server/app.py), served through Ray Serve's proxy.

Each model gets the app the single server runs, built in the ingress replica with `RayEngines` (its
replicas behind the deployment handle, engines.py) as its engine side; with several models a
`ModelDispatcher` (dispatch.py) sits in front and routes by the request's `model`. Ray Serve runs the
app's lifespan (the image sweeper, the video job store, the watch of the replicas) in the replica.

One ingress replica holds the video job records and the url files it wrote (its output folder): every
request for them reaches it, whichever node's proxy the client came in by.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from ray.serve.handle import DeploymentHandle

from diffserve.deploy.dispatch import ModelDispatcher
from diffserve.deploy.engines import RayEngines
from diffserve.deploy.replica import log_to_stderr
from diffserve.deploy.spec import AppSpec, entry_deployment_name, model_id
from diffserve.server.app import create_app
from diffserve.server.args import ServerArgs
from diffserve.server.metrics import ServerMetrics


class Ingress:
    """Ray Serve's ingress class (`serve.ingress()` with `__serve_build_asgi_app__`): `spec` is the
    validated builder args, `handles` each model's `EngineReplica` deployment by model id."""

    def __init__(self, spec: AppSpec, handles: dict[str, DeploymentHandle]) -> None:
        self.spec, self.handles = spec, handles
        log_to_stderr(str(spec.server.get("log_level", "info")))

    def model_app(self, server_args: ServerArgs, handle: DeploymentHandle, deployment: str) -> FastAPI:
        """The single server's app for one model, its engine side that model's replicas (`deployment`:
        their deployment's name, or a disaggregated model's denoiser's)."""

        def engines(metrics: ServerMetrics) -> RayEngines:
            return RayEngines(handle, deployment, server_args, metrics)

        return create_app(server_args, engines=engines)

    def __serve_build_asgi_app__(self) -> Any:
        apps = {}
        for model in self.spec.models:
            apps[model_id(model)] = self.model_app(
                self.spec.server_args(model), self.handles[model_id(model)], entry_deployment_name(model)
            )
        return next(iter(apps.values())) if len(apps) == 1 else ModelDispatcher(apps)
