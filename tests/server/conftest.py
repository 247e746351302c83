"""The module-scoped `diffserve serve` subprocess serving the session's tiny FLUX checkpoint, and the
`openai` client of a module's `server`."""

from __future__ import annotations

import openai
import pytest
from server_process import API_KEY, MODEL_NAME, serving


@pytest.fixture(scope="module")
def server(tiny_flux_dir, tmp_path_factory):
    with serving(
        tiny_flux_dir,
        tmp_path_factory.mktemp("server"),
        "--served-model-name",
        MODEL_NAME,
        "flux-alias",
        "--max-queue-size",
        "8",
        "--max-body-bytes",
        "65536",
        # test_server.py's SIGTERM test lets its 150-step request finish within this (about 0.6 s on an idle
        # machine, far more on a loaded one); the request waiting behind it gets the rest of the window (a
        # drain runs accepted requests while it lasts) and is then cancelled, so the test lasts this long.
        "--shutdown-timeout",
        "10",
        # One request at a time: test_server.py's queue, cancel and drain tests count 1 running + N waiting.
        # Step-level batching has its own server in test_batching.py.
        "--max-running-requests",
        "1",
        # test_server.py's long requests (20,000 steps) are above the default --max-inference-steps.
        "--max-inference-steps",
        "100000",
        api_key=API_KEY,
    ) as srv:
        srv.model_name = MODEL_NAME
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    """The `openai` SDK's client of the module's `server` (a module may define its own)."""
    return server.openai_client(timeout=300)
