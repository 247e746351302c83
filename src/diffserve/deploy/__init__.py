"""diffserve on Ray Serve (`diffserve serve --ray`, `serve run diffserve.deploy.app:build_app`, RayService).

Ray is optional (`pip install "diffserve[ray]"`): only this package imports it, and only in the modules
that run on Ray (spec.py, cli_args.py, lora_log.py, messages.py and dispatch.py need no Ray). Each
module's job:

- spec.py: the application builder's arguments (`build_app(args)`), validated, as ServerArgs per model;
- app.py: `build_app`, the Ray Serve application: one `EngineReplica` deployment per model, one ingress;
- replica.py: `EngineReplica`, a replica owning one diffserve engine (server/engine_client.py);
- disaggregated.py: a model's encode, denoise and decode phases as three deployments (`--disaggregate`),
  its `DenoiserReplica`s calling the other two for each job;
- router.py (+ router_registry.py): Ray Serve's request router for the replicas: fewest waiting steps;
- engines.py: `RayEngines`, the server's `Engines` over one model's replicas (as server/replicas.py);
- remote_job.py: one job's stream from its replica, resent when a replica is lost before it started,
  and the files it brings back (url images, MP4s) written where the ingress serves them;
- lora_log.py: the /v1/loras changes every replica must serve, those started later included;
- messages.py: what replicas send the ingress besides the engine's own messages (errors as data);
- ingress.py and dispatch.py: the ingress deployment serving diffserve's FastAPI app, one per model,
  several behind a dispatcher that routes by the request's `model`;
- cli_args.py and run.py: `diffserve serve --ray`'s flags, and running the application until a signal.
"""
