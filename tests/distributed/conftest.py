"""The rank processes a test's multi-device engine starts (`DiffGenerator(num_gpus=...)` here, or a command
run from here) come from multiprocessing's fork server (`DIFFSERVE_START_METHOD=forkserver`): in a test
worker that is the preloaded one the gloo tests already use (`diffserve.testing.preloaded`), so a rank
starts in a fraction of a second instead of importing torch and transformers again. The server tests
fork theirs (tests/server/server_process.py); the default, 'spawn', is what the CLI tests, the documents'
Python blocks and the Ray replicas run."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from multiprocessing import forkserver

import pytest

from diffserve.process_start import START_METHOD_ENV
from diffserve.testing.preloaded import preloaded_context
from diffserve.testing.threads import one_torch_thread


@pytest.fixture(scope="module", autouse=True)
def ranks_from_the_fork_server() -> Iterator[None]:
    preloaded_context()
    forkserver.ensure_running()  # with `PRELOAD`: the list of the first start is the one that holds
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(START_METHOD_ENV, "forkserver")
        yield


@pytest.fixture(scope="module")
def controlnet_one_thread() -> Iterator[None]:
    """One torch thread in the test process for a ControlNet case module (controlnet_cases.py): the rank
    processes take the parent's count."""
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def controlnet_one_rank(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple]:
    """A ControlNet case module's cases and one-rank images by family, built on first use
    (`controlnet_cases.one_rank_cache`, a `OneRank`)."""
    from controlnet_cases import one_rank_cache

    return one_rank_cache(tmp_path_factory.mktemp("controlnet-cases"))
