"""Shared fixtures: tiny FLUX checkpoints built once per test session (random weights, Diffusers layout);
the order that hands the longest test files to `make test`'s two workers first; byte-code caching for the
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

#: About how many seconds the longest test files take on an idle 2-core machine (a run on a loaded machine,
#: scaled down; what matters is the ranking). `make test` (`--dist loadfile`) hands whole files to its two
#: workers in collection order: these first, longest first, then the others in their order, so the last
#: files to start are short ones and both workers finish together. A new long file belongs here.
FILE_SECONDS = {
    "tests/e2e/test_docs_examples.py": 200,  # every document; its servers are shared between them
    "tests/unit/test_compile.py": 300,  # four cold inductor compiles (plain, Z-Image, LoRA batches, int8)
    "tests/tools/test_gpu_check.py": 60,  # tools/gpu/check.sh --dry-run: GPU tests on the CPU, the bench
    "tests/e2e/test_quality_tiers_zimage_wan.py": 155,
    "tests/unit/test_step_scheduler.py": 145,
    "tests/integrations/test_comfyui_nodes.py": 115,
    "tests/e2e/test_component_offload.py": 110,
    "tests/browser/test_webui.py": 100,  # with Chromium installed (`make test` as root)
    "tests/e2e/test_lora_parity_flux_sd3.py": 95,
    "tests/e2e/test_hunyuan_video15_pipeline_parity.py": 80,
    "tests/deploy/test_ray_serve.py": 120,  # a two-node Ray cluster, two models, a fault, autoscaling
    "tests/e2e/test_demo_model.py": 60,
    "tests/benchmarks/test_bench_cache_vs_cachedit.py": 45,  # benchmarks/bench_cache_vs_cachedit.py --quick
    "tests/distributed/test_tensor_parallel.py": 35,  # three whole generations under TP
    "tests/distributed/test_dit_tensor_parallel.py": 25,  # one TP run per mesh for every family
    "tests/server/test_shutdown.py": 55,
    "tests/server/test_streaming.py": 50,
    "tests/e2e/test_img2img_inpaint_parity_other.py": 50,
    "tests/server/test_replicas.py": 45,
    "tests/e2e/test_wan_pipeline_parity.py": 45,
    "tests/e2e/test_lora_parity_qwen_zimage_wan.py": 45,
    "tests/e2e/test_sd3_skip_layer_guidance.py": 45,
    "tests/e2e/test_diffusers_backend.py": 45,
    "tests/server/test_images_edits_qwen.py": 40,
    "tests/e2e/test_cli_generate.py": 35,
    "tests/models/test_qwen_image_vae_parity.py": 35,
    "tests/e2e/test_flux_kontext_pipeline_parity.py": 35,
    "tests/e2e/test_quantization.py": 35,
    "tests/server/test_videos.py": 30,
    "tests/models/test_ltx2_dit_parity.py": 30,
    "tests/server/test_images_edits.py": 30,
    "tests/distributed/test_sequence_parallel.py": 30,
    "tests/e2e/test_wan22_pipeline_parity.py": 30,
    "tests/unit/test_layerwise_offload.py": 25,
    "tests/server/test_multi_rank_server.py": 20,
    "tests/e2e/test_sd3_pipeline_parity.py": 20,
    "tests/deploy/test_ray_cli.py": 30,
}


def pytest_configure(config: pytest.Config) -> None:
    # xdist sorts files by their number of tests before handing them out (`--loadscope-reorder`, its
    # default), which put the few-test long files (documents, compiles) last: keep the order below instead.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The items of `FILE_SECONDS`' files first, longest file first; the rest keep their order."""

    def key(item: pytest.Item) -> float:
        return -FILE_SECONDS.get(item.nodeid.split("::", 1)[0], 0)

    items.sort(key=key)  # stable: order within a file and among the other files is kept


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
