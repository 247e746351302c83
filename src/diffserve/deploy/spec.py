"""The arguments of the Ray Serve application builder, `diffserve.deploy.app:build_app(args)`, validated.

One shape for the three ways in: `diffserve serve --ray` builds it from its flags, `serve run
diffserve.deploy.app:build_app` and a RayService's `serveConfigV2` give it as YAML/JSON:

    {"models": [                                  # one Ray Serve deployment (`EngineReplica`) each
        {"model_path": "/models/FLUX.1-dev",      # required: a Diffusers folder or a Hugging Face repo id
         "name": "flux-dev",                      # the OpenAI `model` id (default: the folder's name)
         "num_replicas": 2,                       # a fixed count, or autoscaling between
         "min_replicas": 1, "max_replicas": 4,    #   these two (default 1 and 1), on
         "target_ongoing_requests": 2,            #   requests waiting or running per replica (default 2),
         "upscale_delay_s": 30,                   #   with Ray Serve's delays (defaults: Ray's, 30 and
         "downscale_delay_s": 600,                #   600 s) and the load averaged over
         "look_back_period_s": 30,                #   this long (Ray's default, 30 s)
         "engine_args": {"num_gpus": 1, "quantization": "int8"},   # EngineArgs fields (the engine flags)
         "ray_actor_options": {"num_cpus": 2, "num_gpus": 1},      # Ray's per replica (default 1 CPU)
         "disaggregate": {                        # optional: encode, denoise, decode as three deployments
             "encoder": {"num_replicas": 1,       #   each stage: a fixed replica count (default 1; the
                         "ray_actor_options": {"num_gpus": 0.25},  #  denoiser's: the model's own),
                         "engine_args": {"dit_cpu_offload": True}},  # Ray's resources, engine flags over
             "denoiser": {"ray_actor_options": {"num_gpus": 1}},   #   the model's `engine_args`
             "decoder": {"num_replicas": 2}}},
        ...],
     "server": {"api_key": "...", "output_path": "/data/out", ...}}   # ServerArgs fields

On `serve run`'s command line, where every value is text, `models` and `server` are given as JSON
(`serve run diffserve.deploy.app:build_app models='[{"model_path": "/models/flux"}]'`).

`engine_args` takes EngineArgs' field names with the values the flags make (`"loras"`: a list of
`{"name", "path", "scale"}`; sizes such as `"max_memory": "20GiB"` as the flags read them); `server`
takes ServerArgs' field names, and `output_path` (the engine flag, which holds the url images and the
video jobs; it belongs to the ingress, so it is a server setting here). The API keys, when `server` has
none, come from $DIFFSERVE_API_KEY and $DIFFSERVE_ADMIN_API_KEY, as `diffserve serve` reads them.
Every key is checked against the declarations (configs/option.py): an unknown one is an error naming
the closest ones, a value out of its bounds an error naming the rule. The settings Ray Serve owns are
refused with the reason: `host` and `port` (Ray Serve's `http_options`), `dp_size` (the replicas are
Ray's), the connection limits of uvicorn's server (Ray's proxy serves the connections) and
`served_model_names` (each model's `name`).

With several models each one's url images and video jobs live in `<output_path>/<model id>`.

`disaggregate` (deploy/disaggregated.py) runs the model's requests in three deployments: the encoder
(text and image encoding, latents, timesteps), the denoiser (the DiT's steps, batched; the deployment the
ingress routes to, by waiting steps, and which autoscales with the model's replica fields) and the decoder
(the VAE). The denoiser's replica count and `ray_actor_options` are given once: in `disaggregate.denoiser`
or as the model's own. Each stage's engine runs on one device (`num_gpus` 1) with the native backend.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from diffserve.configs.engine_args import EngineArgs, LoraSpec
from diffserve.configs.option import keyword_values, options
from diffserve.errors import UserError
from diffserve.phases import Phase
from diffserve.server.args import ServerArgs

#: ServerArgs fields Ray Serve owns, and why each is refused in `server`.
RAY_OWNED_SERVER_FIELDS = {
    "host": "the address is Ray Serve's (http_options.host; `diffserve serve --ray --host`)",
    "port": "the port is Ray Serve's (http_options.port; `diffserve serve --ray --port`)",
    "dp_size": "replicas are Ray Serve's (each model's num_replicas or min/max_replicas)",
    "served_model_names": "each model's id is its `name` in `models`",
    "header_timeout": "Ray Serve's proxy holds the connections, not uvicorn's server",
    "keep_alive_timeout": "Ray Serve's proxy holds the connections (its keep_alive_timeout_s)",
    "max_connections": "Ray Serve's proxy holds the connections, not uvicorn's server",
    "max_connections_per_client": "Ray Serve's proxy holds the connections, not uvicorn's server",
}
#: The autoscaling fields of a model; any of them set means autoscaling, which `num_replicas` excludes.
AUTOSCALING_FIELDS = (
    "min_replicas",
    "max_replicas",
    "target_ongoing_requests",
    "upscale_delay_s",
    "downscale_delay_s",
    "look_back_period_s",
)


class AppArgsError(UserError):
    """The builder's arguments are invalid; the message lists each problem with where it is."""


def engine_args_of(model_path: str, values: dict[str, Any], output_path: str | None = None) -> EngineArgs:
    """EngineArgs for `model_path` from `values` (field names; checked as the flags are), raising
    UserError/TypeError naming the field. `loras` may hold `{"name", "path", "scale"}` mappings (JSON)."""
    if "model_path" in values:
        raise UserError("engine_args must not hold model_path: it is the model's own `model_path`")
    checked = keyword_values(EngineArgs, values, "engine_args")
    if "loras" in checked:
        checked["loras"] = [
            spec if isinstance(spec, LoraSpec) else LoraSpec(**spec) for spec in checked["loras"]
        ]  # type: ignore[union-attr]
    if "warmup_resolutions" in checked:
        checked["warmup_resolutions"] = [tuple(pair) for pair in checked["warmup_resolutions"]]  # type: ignore[union-attr]
    if output_path is not None:
        checked["output_path"] = output_path
    engine_args = EngineArgs(model_path=model_path, **checked)  # type: ignore[arg-type]
    engine_args.parallel_config()  # degrees that do not multiply to num_gpus: the flags' error
    return engine_args


#: The stages of a disaggregated model, as `disaggregate` names them, and the phase each runs.
STAGE_PHASES: dict[str, Phase] = {"encoder": "encode", "denoiser": "denoise", "decoder": "decode"}
#: The Ray Serve deployment class of a stage, in its deployment's name (`deployment_name`).
STAGE_KINDS = {"encoder": "Encoder", "denoiser": "Denoiser", "decoder": "Decoder"}


class StageSpec(BaseModel):
    """One stage of a disaggregated model: its replicas, their Ray resources, and engine flags over the
    model's `engine_args` (e.g. the DiT kept in host memory on an encoder's small GPU)."""

    model_config = ConfigDict(extra="forbid")

    num_replicas: int | None = Field(None, ge=1)  # None: 1 (the denoiser: the model's replica fields)
    ray_actor_options: dict[str, Any] = Field(default_factory=dict)
    engine_args: dict[str, Any] = Field(default_factory=dict)


class DisaggregateSpec(BaseModel):
    """A model served in three deployments, one per phase of its requests (module docstring)."""

    model_config = ConfigDict(extra="forbid")

    encoder: StageSpec = Field(default_factory=StageSpec)
    denoiser: StageSpec = Field(default_factory=StageSpec)
    decoder: StageSpec = Field(default_factory=StageSpec)

    def stage(self, name: str) -> StageSpec:
        if name not in STAGE_PHASES:
            raise ValueError(f"unknown stage {name!r}; the stages are {', '.join(STAGE_PHASES)}")
        return getattr(self, name)


class ModelSpec(BaseModel):
    """One served model: its deployment's replicas (fixed or autoscaled), engine and Ray resources; with
    `disaggregate`, its three stages' deployments."""

    model_config = ConfigDict(extra="forbid")

    model_path: str = Field(min_length=1)
    name: str | None = Field(None, min_length=1, pattern=r"^\S+$")
    num_replicas: int | None = Field(None, ge=1)
    min_replicas: int = Field(1, ge=1)  # 0 (scale to zero) would leave the ingress nothing to route to
    max_replicas: int = Field(1, ge=1)
    target_ongoing_requests: float = Field(2.0, gt=0)
    upscale_delay_s: float = Field(30.0, ge=0)
    downscale_delay_s: float = Field(600.0, ge=0)
    look_back_period_s: float = Field(30.0, gt=0)  # the load is averaged over this long (Ray's default)
    engine_args: dict[str, Any] = Field(default_factory=dict)
    ray_actor_options: dict[str, Any] = Field(default_factory=dict)
    disaggregate: DisaggregateSpec | None = None

    @model_validator(mode="after")
    def _consistent(self) -> ModelSpec:
        scaling = sorted(set(AUTOSCALING_FIELDS) & self.model_fields_set)
        if self.num_replicas is not None and scaling:
            raise ValueError(
                f"give num_replicas (a fixed count) or the autoscaling fields ({', '.join(scaling)}), not both"
            )
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} > max_replicas {self.max_replicas}")
        try:
            self.engine()
        except (UserError, TypeError) as exc:
            raise ValueError(f"engine_args: {exc}") from None
        if self.disaggregate is not None:
            self._check_stages(self.disaggregate, scaling)
        return self

    def _check_stages(self, stages: DisaggregateSpec, scaling: list[str]) -> None:
        """The denoiser's replicas and resources given once; every stage's engine on one device, native."""
        denoiser = stages.denoiser
        if denoiser.num_replicas is not None and (self.num_replicas is not None or scaling):
            given = "num_replicas" if self.num_replicas is not None else ", ".join(scaling)
            raise ValueError(
                f"disaggregate.denoiser.num_replicas and the model's {given} both set the denoiser's replicas: "
                "give one"
            )
        if denoiser.ray_actor_options and self.ray_actor_options:
            raise ValueError(
                "disaggregate.denoiser.ray_actor_options and the model's ray_actor_options both set the "
                "denoiser's resources: give one"
            )
        for name in STAGE_PHASES:
            try:
                engine = self.engine(stage=name)
            except (UserError, TypeError) as exc:
                raise ValueError(f"disaggregate.{name}.engine_args: {exc}") from None
            if engine.num_gpus != 1:
                raise ValueError(
                    f"disaggregate.{name}: num_gpus {engine.num_gpus}: a disaggregated stage's engine runs on "
                    "one device (its requests arrive and leave as hand-offs, which other ranks do not get)"
                )
            if engine.backend != "native":
                raise ValueError(
                    f"disaggregate.{name}: backend {engine.backend!r} runs each request whole in diffusers' "
                    "own loop; disaggregated stages need diffserve's native pipelines"
                )

    def engine(self, output_path: str | None = None, stage: str | None = None) -> EngineArgs:
        """The EngineArgs of the model's replicas, or of one stage's (`stage`: its flags over the model's)."""
        values = self.engine_args
        if stage is not None:
            if self.disaggregate is None:
                raise ValueError(f"model {self.model_path} is not disaggregated: it has no {stage} stage")
            values = {**values, **self.disaggregate.stage(stage).engine_args}
        return engine_args_of(self.model_path, values, output_path)

    @property
    def autoscaled(self) -> bool:
        return self.num_replicas is None and self.min_replicas != self.max_replicas

    def deployment_options(self) -> dict[str, Any]:
        """Ray Serve's options for this model's deployment (disaggregated: its denoiser's): its replica
        count or autoscaling config, and its actors' resources (one CPU unless `ray_actor_options` says
        otherwise)."""
        denoiser = self.disaggregate.denoiser if self.disaggregate is not None else StageSpec()
        actor = {"num_cpus": 1, **self.ray_actor_options, **denoiser.ray_actor_options}
        if denoiser.num_replicas is not None:
            return {"ray_actor_options": actor, "num_replicas": denoiser.num_replicas}
        options: dict[str, Any] = {"ray_actor_options": actor}
        if not self.autoscaled:
            options["num_replicas"] = self.num_replicas or self.min_replicas
            return options
        options["autoscaling_config"] = {
            "min_replicas": self.min_replicas,
            "initial_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            "target_ongoing_requests": self.target_ongoing_requests,
            "upscale_delay_s": self.upscale_delay_s,
            "downscale_delay_s": self.downscale_delay_s,
            "look_back_period_s": self.look_back_period_s,
        }
        return options

    def stage_deployment_options(self, stage: str) -> dict[str, Any]:
        """Ray Serve's options for one stage's deployment of a disaggregated model: the denoiser's are the
        model's (`deployment_options`); the encoder's and decoder's a fixed replica count (default 1) and
        their actors' resources (one CPU unless their `ray_actor_options` say otherwise)."""
        if self.disaggregate is None:
            raise ValueError(f"model {self.model_path} is not disaggregated: it has no {stage} stage")
        if stage == "denoiser":
            return self.deployment_options()
        spec = self.disaggregate.stage(stage)
        return {
            "ray_actor_options": {"num_cpus": 1, **spec.ray_actor_options},
            "num_replicas": spec.num_replicas or 1,
        }


class AppSpec(BaseModel):
    """The builder's whole argument: the models, and the server settings they share."""

    model_config = ConfigDict(extra="forbid")

    models: list[ModelSpec] = Field(min_length=1)
    server: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self) -> AppSpec:
        owned = [f"{key} ({why})" for key, why in RAY_OWNED_SERVER_FIELDS.items() if key in self.server]
        if owned:
            raise ValueError(f"server: set by Ray Serve, not here: {'; '.join(owned)}")
        try:
            keyword_values(ServerArgs, self._server_fields(), "server", accepted=("output_path",))
        except (UserError, TypeError) as exc:
            raise ValueError(f"server: {exc}") from None
        ids = [model_id(model) for model in self.models]
        slugs = [deployment_name(i) for i in ids]
        if len(set(slugs)) != len(slugs):
            repeated = sorted({i for i, s in zip(ids, slugs, strict=True) if slugs.count(s) > 1})
            raise ValueError(f"models: several are served as {', '.join(repeated)}: give each its own `name`")
        return self

    def _server_fields(self) -> dict[str, Any]:
        """`server`'s ServerArgs fields; an option declared with an environment variable (the API keys:
        $DIFFSERVE_API_KEY, $DIFFSERVE_ADMIN_API_KEY) and absent here is read from it, as `diffserve
        serve` reads it (a RayService hands the keys over from a Secret, never in its serve config)."""
        fields = {key: value for key, value in self.server.items() if key != "output_path"}
        for declared in options(ServerArgs):
            env = declared.spec.env
            if env is not None and declared.name not in fields and env in os.environ:
                fields[declared.name] = os.environ[env]
        return fields

    def server_args(self, model: ModelSpec, stage: str | None = None) -> ServerArgs:
        """The ServerArgs `model`'s app and replicas run with (its files in their own folder when several
        models share the server); `stage`: those of one stage's replicas of a disaggregated model (its
        engine flags over the model's)."""
        values = keyword_values(ServerArgs, self._server_fields(), "server")
        output = str(self.server.get("output_path") or model.engine().output_path)
        if len(self.models) > 1:
            output = str(Path(output) / model_id(model))
        names = [model.name] if model.name else []
        engine = model.engine(output, stage)
        return ServerArgs(engine, served_model_names=names, **values)  # type: ignore[arg-type]


def model_id(model: ModelSpec) -> str:
    """The id /v1/models lists for `model`: its name, else its folder's (as the single server's)."""
    return model.name or Path(model.model_path).name or model.model_path


def deployment_name(model: str, kind: str = "EngineReplica") -> str:
    """The Ray Serve deployment of model id `model`: `EngineReplica-<id>`, in the characters Ray allows
    (`kind`: a disaggregated model's stage, `Encoder`, `Denoiser` or `Decoder`)."""
    return f"{kind}-" + re.sub(r"[^A-Za-z0-9._-]", "-", model)


def stage_deployment_name(model: ModelSpec, stage: str) -> str:
    """The deployment of one stage of a disaggregated model (`Encoder-<id>`, ...)."""
    return deployment_name(model_id(model), STAGE_KINDS[stage])


def entry_deployment_name(model: ModelSpec) -> str:
    """The deployment the ingress sends `model`'s jobs to: its replicas, or, disaggregated, its denoiser
    (which runs each job's encoder and decoder calls)."""
    return (
        deployment_name(model_id(model))
        if model.disaggregate is None
        else stage_deployment_name(model, "denoiser")
    )


def parse_app_args(args: dict[str, Any] | AppSpec) -> AppSpec:
    """Validate the builder's `args`; AppArgsError lists every problem, one a line, with its place."""
    if isinstance(args, AppSpec):
        return args
    try:
        args = {
            **args,
            **{key: json.loads(args[key]) for key in ("models", "server") if isinstance(args.get(key), str)},
        }
    except json.JSONDecodeError as exc:
        raise AppArgsError(f"invalid diffserve Ray application arguments: `models` and `server` given as text must be JSON ({exc})") from None  # fmt: skip
    try:
        return AppSpec.model_validate(args)
    except ValidationError as exc:
        lines = []
        for error in exc.errors():
            where = ".".join(str(part) for part in error["loc"]) or "args"
            message = str(error["msg"]).removeprefix("Value error, ")
            lines.append(f"{where}: {message}")
        raise AppArgsError("invalid diffserve Ray application arguments:\n  " + "\n  ".join(lines)) from None


def server_values_for_cli(server_args: ServerArgs) -> dict[str, Any]:
    """The `server` part of the builder's args from a ServerArgs: the fields that differ from their
    defaults. Of those Ray Serve owns, the CLI gives host and port to Ray Serve itself and the served
    name to the model; another one set is a UserError naming its flag."""
    default = ServerArgs(server_args.engine_args)
    changed = {
        f.name: getattr(server_args, f.name)
        for f in dataclasses.fields(ServerArgs)
        if f.name != "engine_args" and getattr(server_args, f.name) != getattr(default, f.name)
    }
    for name in set(changed) & set(RAY_OWNED_SERVER_FIELDS) - {"host", "port", "served_model_names"}:
        raise UserError(
            f"--{name.replace('_', '-')} does not apply with --ray: {RAY_OWNED_SERVER_FIELDS[name]}"
        )
    return {name: value for name, value in changed.items() if name not in RAY_OWNED_SERVER_FIELDS}


def engine_values_for_cli(engine_args: EngineArgs) -> dict[str, Any]:
    """The `engine_args` part from an EngineArgs: the fields that differ from their defaults, but the
    model path (each model's own) and the output path (a server setting under Ray)."""
    default = EngineArgs(model_path=engine_args.model_path)
    return {
        f.name: getattr(engine_args, f.name)
        for f in dataclasses.fields(EngineArgs)
        if f.name not in ("model_path", "output_path")
        and getattr(engine_args, f.name) != getattr(default, f.name)
    }
