"""`diffserve serve`: the OpenAI-compatible HTTP server.

Front end (this process, asyncio):  app.py routes -> schemas.py -> engine_client.py
Engine (its own process):           engine_process.py -> runtime/scheduler.py (StepScheduler) -> pipeline phases
Link: one ZeroMQ PUSH/PULL pair each way over IPC, messages in protocol.py.
Around them: errors.py (OpenAI error shape), middleware.py (request id, access log, API key, body
limit), metrics.py (Prometheus), image_files.py (the files behind url outputs), runner.py (uvicorn,
graceful shutdown), args.py (server settings), video_routes.py + video_jobs.py (the /v1/videos job API:
routes, SQLite job records, progress, retention). Images and videos are encoded by `diffserve.outputs`,
shared with the CLI. See docs/serving.md.
"""
