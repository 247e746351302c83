"""The module-scoped `diffserve serve` subprocess serving the session's tiny FLUX checkpoint."""

from __future__ import annotations

import pytest
from server_process import API_KEY, MODEL_NAME, start_server


@pytest.fixture(scope="module")
def server(tiny_flux_dir, tmp_path_factory):
    srv = start_server(
        tiny_flux_dir,
        tmp_path_factory.mktemp("server"),
        "--api-key",
        API_KEY,
        "--served-model-name",
        MODEL_NAME,
        "flux-alias",
        "--max-queue-size",
        "8",
        "--max-body-bytes",
        "65536",
        "--shutdown-timeout",
        "4",
        # One request at a time: test_server.py's queue, cancel and drain tests count 1 running + N waiting.
        # Step-level batching has its own server in test_batching.py.
        "--max-running-requests",
        "1",
        # test_server.py's long requests (20,000 steps) are above the default --max-inference-steps.
        "--max-inference-steps",
        "100000",
    )
    srv.api_key, srv.model_name = API_KEY, MODEL_NAME
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()
