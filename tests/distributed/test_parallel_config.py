"""`ParallelConfig` validation, its defaults, the mesh groups, and the multi-device flags (no model loaded)."""

from __future__ import annotations

import json

import pytest

from diffserve.cli.main import main
from diffserve.configs.engine_args import EngineArgs
from diffserve.distributed.config import ParallelConfig, ParallelConfigError
from diffserve.distributed.state import mesh_groups
from diffserve.errors import UserError


def test_ulysses_defaults_to_what_num_gpus_leaves() -> None:
    assert ParallelConfig.resolve(num_gpus=4).ulysses_degree == 4
    config = ParallelConfig.resolve(num_gpus=8, enable_cfg_parallel=True, ring_degree=2)
    assert (config.cfg_degree, config.ring_degree, config.ulysses_degree, config.tp_size) == (2, 2, 2, 1)
    assert ParallelConfig.resolve().num_gpus == 1 and not ParallelConfig.resolve().is_distributed


def test_product_mismatch_names_the_product() -> None:
    with pytest.raises(ParallelConfigError) as info:
        ParallelConfig.resolve(num_gpus=4, ulysses_degree=1, enable_cfg_parallel=True)
    assert str(info.value) == "--num-gpus 4 but cfg 2 x tp 1 x ulysses 1 x ring 1 = 2"
    assert isinstance(info.value, UserError)


def test_num_gpus_not_divisible_by_the_given_degrees() -> None:
    with pytest.raises(
        ParallelConfigError, match=r"--num-gpus 3 is not divisible by cfg 2 x tp 1 x ring 1 = 2"
    ):
        ParallelConfig.resolve(num_gpus=3, enable_cfg_parallel=True)


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"num_gpus": 0}, "--num-gpus"),
        ({"num_gpus": 2, "ulysses_degree": 0}, "--ulysses-degree"),
        ({"ring_degree": -1}, "--ring-degree"),
        ({"tp_size": 1.5}, "--tp-size"),
        ({"num_gpus": 2, "nnodes": 0}, "--nnodes"),
    ],
)
def test_degrees_must_be_positive_integers(kwargs: dict, flag: str) -> None:
    with pytest.raises(ParallelConfigError, match=f"^{flag} must be an integer >= 1"):
        ParallelConfig.resolve(**kwargs)


def test_multi_node_checks() -> None:
    with pytest.raises(ParallelConfigError, match=r"--node-rank must be in \[0, 2\)"):
        ParallelConfig.resolve(num_gpus=4, nnodes=2, node_rank=2)
    with pytest.raises(ParallelConfigError, match="not a multiple of --nnodes 2"):
        ParallelConfig.resolve(num_gpus=3, nnodes=2)
    with pytest.raises(ParallelConfigError, match="--dist-init-addr must be HOST:PORT"):
        ParallelConfig.resolve(num_gpus=2, nnodes=2, dist_init_addr="10.0.0.1")
    config = ParallelConfig.resolve(num_gpus=4, nnodes=2, node_rank=1, dist_init_addr="10.0.0.1:29500")
    assert config.ranks_per_node == 2


def test_mesh_puts_ulysses_innermost() -> None:
    groups = mesh_groups(ParallelConfig.resolve(num_gpus=8, enable_cfg_parallel=True, ring_degree=2))
    assert groups["ulysses"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["ring"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["cfg"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["tp"] == [[r] for r in range(8)]
    assert groups["sp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_engine_args_validate_their_parallel_fields() -> None:
    args = EngineArgs(model_path="x", num_gpus=2, enable_cfg_parallel=True)
    assert args.parallel_config().cfg_degree == 2
    with pytest.raises(
        ParallelConfigError, match="--num-gpus 2 is not divisible by cfg 1 x tp 2 x ring 2 = 4"
    ):
        EngineArgs(model_path="x", num_gpus=2, tp_size=2, ring_degree=2).parallel_config()


def test_api_refuses_bad_degrees_before_loading(tmp_path) -> None:
    from diffserve.api import DiffGenerator

    with pytest.raises(ParallelConfigError, match="--num-gpus 3 but cfg 1 x tp 1 x ulysses 2 x ring 1 = 2"):
        DiffGenerator.from_pretrained(tmp_path / "no-such-model", num_gpus=3, ulysses_degree=2)


def test_cli_bad_degrees_is_one_error_line_before_model_load(tmp_path, capfd) -> None:
    code = main(
        ["generate", "--model-path", str(tmp_path / "no-such-model"), "--prompt", "x", "--num-gpus", "3",
         "--ulysses-degree", "2", "--output-path", str(tmp_path)]
    )  # fmt: skip
    err = capfd.readouterr().err.strip().splitlines()
    assert code == 2
    assert err == ["error: --num-gpus 3 but cfg 1 x tp 1 x ulysses 2 x ring 1 = 2"]


def test_help_documents_the_flags(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = capsys.readouterr().out
    for flag in ("--num-gpus", "--ulysses-degree", "--ring-degree", "--enable-cfg-parallel", "--tp-size",
                 "--nnodes", "--node-rank", "--dist-init-addr"):  # fmt: skip
        assert flag in out
    assert "N / (cfg x tp x ring)" in out


def test_compile_with_sequence_parallel_is_refused_naming_both() -> None:
    from diffserve.configs.engine_args import EngineArgs

    with pytest.raises(ParallelConfigError, match=r"--compile does not work with sequence parallelism"):
        EngineArgs(model_path="/m", num_gpus=2, compile=True).parallel_config()
    # CFG-parallel runs whole sequences: compile is fine there.
    config = EngineArgs(model_path="/m", num_gpus=2, enable_cfg_parallel=True, compile=True).parallel_config()
    assert config.cfg_degree == 2
    with pytest.raises(ParallelConfigError, match=r"--compile does not work with tensor parallelism yet"):
        EngineArgs(model_path="/m", num_gpus=2, tp_size=2, compile=True).parallel_config()


def test_tensor_parallel_takes_its_mesh_dimension() -> None:
    config = ParallelConfig.resolve(num_gpus=8, tp_size=2, enable_cfg_parallel=True)
    assert (config.cfg_degree, config.tp_size, config.ring_degree, config.ulysses_degree) == (2, 2, 1, 2)
    # mesh [cfg, tp, ring, ulysses], ulysses innermost: TP pairs are 2 apart
    assert mesh_groups(config)["tp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_cli_tensor_parallel_without_a_shardable_dit_is_one_error_line(tmp_path, capfd) -> None:
    """Every native DiT shards itself; a folder whose DiT is not one (here: none at all) is refused from
    model_index.json alone, before any rank starts or loads."""
    index = {"_class_name": "StableDiffusion3Pipeline", "vae": ["diffusers", "AutoencoderKL"]}
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    code = main(
        ["generate", "--model-path", str(tmp_path), "--prompt", "x", "--num-gpus", "2", "--tp-size", "2", "--seed", "1",
         "--output-path", str(tmp_path / "out")]
    )  # fmt: skip
    err = capfd.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1, err
    assert err[0].startswith(
        "error: --tp-size 2: tensor parallelism is implemented for the DiTs of flux, flux-kontext, flux-fill, sd3, "
    )
    assert err[0].endswith(
        "not for the sd3 family's DiT (no transformer component); split its requests with --ulysses-degree / "
        "--ring-degree / --enable-cfg-parallel instead"
    )
