"""One two-node Ray cluster on the loopback for the Ray Serve test files (`RAY_CLUSTER_FILES`), started once
and shared by them: tests/conftest.py hands those files to one test worker as one unit, one after the other,
and the cluster is shut down right after the last of their tests (not at the end of the session: the next
files of that worker get their CPU back, and `diffserve serve --ray` in test_ray_cli.py starts a Ray of its
own). Each file deploys its application(s) on it and deletes them when it is done.

The nodes: a head and a worker of 1 CPU each, Serve's proxy on the head. The head carries the custom
resource "small" (2), the worker "big" (1): test_ray_disaggregated.py places its stages with them, and
test_ray_serve.py's replicas (1 CPU each) land one per node whatever the custom resources say. Both files
also load the demo model's LoRA folder (`lora_dir`, one per module)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from diffserve.testing.ports import unassigned_port

#: The files that use the shared cluster (the `cluster` fixture), which tests/conftest.py's `SHARED_UNITS`
#: groups: a test of any other file tears the cluster down first.
RAY_CLUSTER_FILES = tuple(
    Path(__file__).parent / name for name in ("test_ray_serve.py", "test_ray_disaggregated.py")
)
#: test_ray_serve.py's autoscaling test needs its load to reach Ray Serve's autoscaler within a second
#: (default: every 10 s); set in the environment the nodes' processes inherit.
FAST_AUTOSCALING_METRICS = {
    f"RAY_SERVE_{who}_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5" for who in ("HANDLE", "REPLICA")
}


class SharedCluster:
    """The cluster, started on first use and stopped by `stop` (again on a later use, if any)."""

    def __init__(self) -> None:
        self.current: SimpleNamespace | None = None
        self._saved_env: dict[str, str | None] = {}

    def get(self) -> SimpleNamespace:
        if self.current is None:
            self.current = self._start()
        return self.current

    def _start(self) -> SimpleNamespace:
        import ray
        from ray import serve
        from ray.cluster_utils import Cluster

        self._saved_env = {name: os.environ.get(name) for name in FAST_AUTOSCALING_METRICS}
        os.environ.update(FAST_AUTOSCALING_METRICS)
        memory = 80 * 2**20
        nodes = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 1, "resources": {"small": 2}, "object_store_memory": memory, "include_dashboard": False
            },
        )  # fmt: skip
        try:
            nodes.add_node(num_cpus=1, resources={"big": 1}, object_store_memory=memory)
            ray.init(address=nodes.address, log_to_driver=False)
            port = unassigned_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        except BaseException:
            ray.shutdown()
            nodes.shutdown()
            self._restore_env()
            raise
        return SimpleNamespace(nodes=nodes, base_url=f"http://127.0.0.1:{port}")

    def stop(self) -> None:
        if self.current is None:
            return
        import ray
        from ray import serve

        nodes, self.current = self.current.nodes, None
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            nodes.shutdown()
            self._restore_env()

    def _restore_env(self) -> None:
        for name, value in self._saved_env.items():
            os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)
        self._saved_env = {}


SHARED = SharedCluster()


def _uses_cluster(item: pytest.Item | None) -> bool:
    return item is not None and item.path in RAY_CLUSTER_FILES


@pytest.fixture(scope="module")
def cluster():
    """The shared cluster (started by the first module that asks for it)."""
    pytest.importorskip(
        "ray.serve", reason='the Ray Serve tests need the extra: pip install "diffserve[ray]"'
    )
    return SHARED.get()


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with one LoRA for the demo model (`diffserve make-lora`), one per test module (the Ray Serve
    files load it through /v1/loras)."""
    from diffserve.cli.main import main
    from diffserve.configs.demo_model import demo_model_path

    folder = tmp_path_factory.mktemp("loras")
    code = main(
        ["make-lora", str(folder / "ink.safetensors"), "--model-path", str(demo_model_path()), "--rank", "2"]
    )
    assert code == 0
    return folder


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    yield  # the item's fixtures are torn down first (the last test of a module: its applications)
    if SHARED.current is not None and not _uses_cluster(nextitem):
        SHARED.stop()


def pytest_sessionfinish(session: pytest.Session) -> None:
    SHARED.stop()
