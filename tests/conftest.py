"""Shared fixtures: tiny FLUX checkpoints built once per test session (random weights, Diffusers layout);
the order that hands the longest test files to `make test`'s workers first; byte-code caching for the
suite's many Python processes."""

from __future__ import annotations

import os
import sys

import pytest

# Byte code is cached (`__pycache__/`, git-ignored) even where the environment asks Python not to write it
# (PYTHONDONTWRITEBYTECODE): the suite starts hundreds of Python processes (servers and their engines, CLI
# runs, rank processes), and without a cache each one compiles the diffserve modules it imports again (a
# quarter of a second of CPU apiece), and each run rewrites every test module's asserts again. Set here,
# before the test modules are imported, so the workers' imports and every subprocess inherit it.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# OpenMP reads its wait policy once, when torch loads: diffserve's passive policy (diffserve.openmp_env) must
# be in place before any test module imports torch, or each worker's threads spin while they wait and, with
# the other worker, the servers and the ranks the suite starts on the same cores, steps run 4-30x slower
# (two runs of tests/e2e/test_calibrate_cache.py side by side: 47.6 s spinning, 10.9 s passive).
import diffserve.openmp_env  # noqa: E402, F401  (before any test module imports torch)

# One compute thread per test process unless the environment says otherwise: `make test` runs one worker
# per core, and every server, engine and rank it starts shares those cores. The suite's models are tiny, so
# a second OpenMP thread mostly pays for waking and parking itself around each small op (passive waiting
# makes that a futex round trip): a set of parity, cache and tier files ran in 73-74 s on one thread
# against 81-85 s on two (`-n 2`, same machine, alternating). Set before torch loads, which reads it once;
# the CPU platform keeps the count OMP_NUM_THREADS gives (platforms/cpu.py), and the subprocesses inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _share_httpx_default_ssl_context() -> None:
    """httpx builds a new SSL context for every `httpx.get(...)` / `httpx.Client()` (a CA bundle parsed
    again: about 30 ms of CPU), though the suite only talks plain HTTP to the loopback: its polling loops (a
    starting server's /health every 0.1 s, a job's status, ...) spent a third of a core on it while they
    waited. The default context (verify=True, no client certificate) is built once per test process for
    each CA bundle the environment names (SSL_CERT_FILE / SSL_CERT_DIR, which httpx reads) and shared; any
    other arguments build theirs as before."""
    try:
        from httpx._transports import default as transports
    except ImportError:  # another httpx layout: every client builds its own, as before
        return
    build = getattr(transports, "create_ssl_context", None)
    if build is None:
        return
    shared: dict[tuple[object, ...], object] = {}

    def create_ssl_context(verify=True, cert=None, trust_env=True):
        if verify is not True or cert is not None:
            return build(verify=verify, cert=cert, trust_env=trust_env)
        bundle = (os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR")) if trust_env else None
        if bundle not in shared:
            shared[bundle] = build(verify=verify, cert=cert, trust_env=trust_env)
        return shared[bundle]

    transports.create_ssl_context = create_ssl_context


_share_httpx_default_ssl_context()

#: About how many seconds of one worker's time the longest test files take (what matters is the ranking;
#: files under 20 s are not listed). `make test` (`--dist loadfile`) hands whole files (or `SHARED_UNITS`)
#: to its workers in collection order: these first, longest first, then the others in their order, so the
#: last files to start are short ones and the workers finish together. A new long file belongs here.
FILE_SECONDS = {
    # From `--durations=0` of `make test`'s pytest in a warm tree (2026-12-05, an idle machine; test_compile's
    # cold figure, as in a fresh clone).
    # test_compile: 130 s scaled by a cold run without the FLUX graph break (158 s -> 126 s, empty inductor cache).
    "tests/unit/test_compile.py": 105,  # four cold inductor compiles (plain, Z-Image, LoRA batches, int8)
    # A unit of two files (`SHARED_UNITS`): one two-node Ray cluster, three applications, a fault, autoscaling.
    "tests/deploy/test_ray_serve.py": 130,
    "tests/e2e/test_docs_examples.py": 73,  # every document; its servers are shared between them
    "tests/distributed/test_multi_rank_engine.py": 35,
    "tests/tools/test_gpu_check.py": 34,  # tools/gpu/check.sh --dry-run: GPU tests on the CPU, the bench
    "tests/e2e/test_cache_methods_families.py": 33,
    "tests/integrations/test_comfyui_nodes.py": 27,
    "tests/e2e/test_flux_kontext_pipeline_parity.py": 25,
    "tests/e2e/test_quality_tiers_wave3.py": 25,
    "tests/server/test_images_edits_qwen.py": 24,
    "tests/deploy/test_ray_cli.py": 23,
    "tests/benchmarks/test_bench_cache_vs_cachedit.py": 22,  # benchmarks/bench_cache_vs_cachedit.py --quick
    "tests/distributed/test_rank_interrupts.py": 22,
    "tests/server/test_security_matrix.py": 22,
    "tests/server/test_video_family_servers.py": 20,
    "tests/distributed/test_dit_sequence_parallel_images_wave3.py": 19,
    "tests/e2e/test_quantization.py": 19,
    "tests/server/test_load_with_faults.py": 19,
    "tests/distributed/test_controlnet_parallel.py": 18,
    "tests/distributed/test_tensor_parallel.py": 17,  # three whole generations under TP
}


#: Files run as one unit by one worker, one after the other (the first named is the unit's name and place in
#: the order): they share what tests/deploy/conftest.py starts once for them, a two-node Ray cluster.
SHARED_UNITS = {
    "tests/deploy/test_ray_serve.py": (
        "tests/deploy/test_ray_serve.py",
        "tests/deploy/test_ray_disaggregated.py",
    ),
}
UNIT_OF = {file: unit for unit, files in SHARED_UNITS.items() for file in files}


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its file, or the `SHARED_UNITS` entry that names the file."""
    file = nodeid.split("::", 1)[0]
    return UNIT_OF.get(file, file)


def pytest_configure(config: pytest.Config) -> None:
    # xdist sorts files by their number of tests before handing them out (`--loadscope-reorder`, its
    # default), which put the few-test long files (documents, compiles) last: keep the order below instead.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`--dist loadfile`, with the files of a `SHARED_UNITS` entry handed out together as one unit."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedUnitScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return SharedUnitScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The items of `FILE_SECONDS`' files first, longest file first; the rest keep their order. The files of
    a `SHARED_UNITS` entry follow each other, at their unit's place."""
    first_seen: dict[str, int] = {}
    for index, item in enumerate(items):
        first_seen.setdefault(unit_of(item.nodeid), index)

    def key(item: pytest.Item) -> tuple[float, int]:
        unit = unit_of(item.nodeid)
        return -FILE_SECONDS.get(unit, 0), first_seen[unit]

    items.sort(key=key)  # stable: order within a unit is kept, and so is the order of the other files


@pytest.fixture(scope="session")
def tiny_flux_dir(tmp_path_factory: pytest.TempPathFactory):
    """FLUX.1-dev style: guidance embedding on."""
    from diffserve.families.flux.tiny import TinyFluxSpec, build_tiny_flux

    return build_tiny_flux(tmp_path_factory.mktemp("tiny-flux"), TinyFluxSpec(seed=0, guidance_embeds=True))


@pytest.fixture(scope="session")
def tiny_flux_schnell_dir(tmp_path_factory: pytest.TempPathFactory):
    """FLUX.1-schnell style: no guidance embedding."""
    from diffserve.families.flux.tiny import TinyFluxSpec, build_tiny_flux

    return build_tiny_flux(
        tmp_path_factory.mktemp("tiny-flux-schnell"), TinyFluxSpec(seed=1, guidance_embeds=False)
    )
