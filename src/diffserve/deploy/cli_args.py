"""`diffserve serve --ray`'s own flags, declared once (configs/option.py), and the builder's args they
make. Imports no Ray: `serve --help` lists the flags without it, and `--ray` without Ray installed is one
`error:` line naming the extra to install.

    diffserve serve --ray [--ray-address auto|ray://HOST:10001] --model-path A [--model-path B ...]
                    (--num-replicas N | --min-replicas A --max-replicas B [--target-ongoing-requests T])
                    [--disaggregate [--encoder-replicas N] [--decoder-replicas N]]
                    [every engine flag: --num-gpus, --quantization, --lora ...] [server flags]

Every `--model-path` is one model (one Ray Serve deployment) with the same engine flags and replica
counts; `--disaggregate` makes each model three deployments (encoder, denoiser, decoder:
deploy/disaggregated.py), the replica flags then counting the denoisers. For models or stages with their
own settings (a stage's devices, its engine flags), write the builder's args (spec.py) and use `serve
run` or a RayService (docs/scale-out.md).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diffserve.configs.option import OptionGroup, option
from diffserve.errors import UserError
from diffserve.server.args import ServerArgs

RAY = OptionGroup(
    "Ray Serve (--ray)", "serve every --model-path as a Ray Serve deployment (docs/scale-out.md)"
)
INSTALL_HINT = 'pip install "diffserve[ray]"'


@dataclass
class RayServeArgs:
    """The flags of `serve --ray`; the engine's and the server's are the usual ones."""

    ray: bool = option(
        False, cli="--ray", group=RAY,
        help="serve on Ray Serve: each --model-path (repeatable) is a deployment of engine replicas behind "
        f"this one address, on this machine or a Ray cluster (needs {INSTALL_HINT})",
    )  # fmt: skip
    ray_address: str | None = option(
        None, cli="--ray-address", metavar="ADDRESS", group=RAY,
        help="with --ray: the Ray cluster to use, 'auto' (the one `ray start` runs here) or ray://HOST:10001 "
        "(default: start a local Ray instance for this server)",
    )  # fmt: skip
    num_replicas: int | None = option(
        None, cli="--num-replicas", min=1, metavar="N", group=RAY,
        help="with --ray: engine replicas per model, each with its own devices (default: 1)",
    )  # fmt: skip
    min_replicas: int | None = option(
        None, cli="--min-replicas", min=1, metavar="N", group=RAY,
        help="with --ray: autoscale each model between --min-replicas and --max-replicas on the requests "
        "waiting or running per replica (default: no autoscaling)",
    )  # fmt: skip
    max_replicas: int | None = option(
        None, cli="--max-replicas", min=1, metavar="N", group=RAY,
        help="with --ray: the most replicas autoscaling starts per model",
    )  # fmt: skip
    target_ongoing_requests: float | None = option(
        None, cli="--target-ongoing-requests", gt=0, metavar="T", group=RAY,
        help="with --ray and autoscaling: the requests waiting or running per replica the autoscaler aims at "
        "(default: 2)",
    )  # fmt: skip
    disaggregate: bool = option(
        False, cli="--disaggregate", group=RAY,
        help="with --ray: run each model's text encoding, denoising and decoding as three deployments with "
        "their own replicas, requests handed over through Ray's object store; the replica flags count the "
        "denoisers (default: off)",
    )  # fmt: skip
    encoder_replicas: int | None = option(
        None, cli="--encoder-replicas", min=1, metavar="N", group=RAY,
        help="with --disaggregate: encoder replicas per model (default: 1)",
    )  # fmt: skip
    decoder_replicas: int | None = option(
        None, cli="--decoder-replicas", min=1, metavar="N", group=RAY,
        help="with --disaggregate: decoder replicas per model (default: 1)",
    )  # fmt: skip

    def check(self) -> None:
        """The Ray flags only with --ray, the stages' replicas only with --disaggregate, and a fixed count
        or autoscaling bounds, not both."""
        given = [
            f.name
            for f in dataclasses.fields(self)
            if f.name != "ray" and getattr(self, f.name) not in (None, False)
        ]
        if not self.ray and given:
            raise UserError(f"--{given[0].replace('_', '-')} needs --ray")
        stages = [name for name in given if name in ("encoder_replicas", "decoder_replicas")]
        if stages and not self.disaggregate:
            raise UserError(f"--{stages[0].replace('_', '-')} needs --disaggregate")
        scaling = [
            name for name in given if name in ("min_replicas", "max_replicas", "target_ongoing_requests")
        ]
        if self.num_replicas is not None and scaling:
            raise UserError("give --num-replicas or --min-replicas/--max-replicas (autoscaling), not both")
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise UserError("autoscaling needs both --min-replicas and --max-replicas")

    def disaggregated(self) -> dict[str, Any]:
        """Each model's `disaggregate` field in the builder's args (empty without --disaggregate): the
        encoder's and decoder's replica counts; the denoisers' are the model's replica fields."""
        if not self.disaggregate:
            return {}
        counts = {"encoder": self.encoder_replicas, "decoder": self.decoder_replicas}
        return {"disaggregate": {stage: {"num_replicas": n} for stage, n in counts.items() if n is not None}}

    def replicas(self) -> dict[str, Any]:
        """The replica fields of each model in the builder's args."""
        if self.num_replicas is not None:
            return {"num_replicas": self.num_replicas}
        fields = ("min_replicas", "max_replicas", "target_ongoing_requests")
        return {name: getattr(self, name) for name in fields if getattr(self, name) is not None}


def check_ray_installed() -> None:
    """One clear error when Ray Serve is missing (the extra is optional)."""
    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.serve") is None:
        raise UserError(f"--ray needs Ray Serve, which is not installed: {INSTALL_HINT}")


def app_args_from(ray_args: RayServeArgs, server_args: ServerArgs, model_paths: list[str]) -> dict[str, Any]:
    """The builder's args (spec.py) of `serve --ray`: one model per path, each with the same engine
    flags and replicas; local paths made absolute (Ray's workers run in other directories)."""
    from diffserve.deploy.spec import engine_values_for_cli, server_values_for_cli  # pydantic: not for --help

    engine = server_args.engine_args
    engine_values = engine_values_for_cli(engine)
    paths = [str(Path(path).absolute()) if Path(path).exists() else path for path in model_paths]
    models = [
        {
            "model_path": path,
            **ray_args.replicas(),
            "engine_args": dict(engine_values),
            **ray_args.disaggregated(),
        }
        for path in paths
    ]
    if len(model_paths) == 1 and server_args.served_model_names:
        models[0]["name"] = server_args.served_model_names[0]
    elif server_args.served_model_names:
        raise UserError(
            "--served-model-name names one model; with several --model-path each is served by its folder name"
        )
    server = server_values_for_cli(server_args)
    server["output_path"] = str(Path(engine.output_path).absolute())
    return {"models": models, "server": server}
