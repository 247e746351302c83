"""diffserve on Ray Serve (`diffserve serve --ray`, `serve run diffserve.deploy.app:build_app`, RayService).

Ray is optional (`pip install "diffserve[ray]"`): only the modules of this package import it, and only
where they run on Ray. What each module does:

- spec.py: the application builder's arguments (`build_app(args)`), validated, as ServerArgs per model;
- app.py: `build_app`, the Ray Serve application: one `EngineReplica` deployment per model, one ingress;
- replica.py: `EngineReplica`, a replica owning one diffserve engine (server/engine_client.py);
- router.py: the request router sending each job to the replica with the fewest waiting steps;
- engines.py: `RayEngines`, the server's `Engines` over one model's replicas (server/replicas.py);
- remote_job.py: one job's event stream from its replica, and the files it brings back (url images, MP4s);
- messages.py: what replicas send the ingress besides the engine's own messages (errors as data);
- ingress.py and dispatch.py: the ingress deployment serving diffserve's FastAPI app, one per model,
  several behind a dispatcher that routes by the request's `model`;
- cli_args.py and run.py: `diffserve serve --ray`'s flags, and running the application until a signal.
"""
