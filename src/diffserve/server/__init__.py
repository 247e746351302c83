"""`diffserve serve`: the OpenAI-compatible HTTP server (see docs/serving.md).

Front end (asyncio): routes in app.py and video_routes.py over engine_client.py. Engine process:
engine_process.py, a thin transport around `runtime.Engine`. Link: ZeroMQ over IPC, messages in protocol.py.
"""
