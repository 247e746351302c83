"""deploy/'s manifests are valid as written, and agree with the server they run.

- Every Kubernetes object under deploy/ validates against the Kubernetes API schema of `KUBERNETES_VERSION`
  (kubernetes-validate, strict: an unknown or misspelled field is an error).
- A KubeRay RayService is a custom resource, outside those schemas: its head and worker pod templates
  validate as Kubernetes PodTemplates, its cluster settings are checked (autoscaling, GPU groups with room
  for every model's max_replicas, the Ray version of the image), its `serveConfigV2` parses with Ray
  Serve's own schema (`ray.serve.schema.ServeDeploySchema`), and the diffserve application's `args`
  follow the contract of `diffserve.deploy.app:build_app`: `engine_args` and `server` are EngineArgs and
  ServerArgs options with valid values (checked here from their declarations), and the args pass
  build_app's own validation (`diffserve.deploy.spec`), whose servers take the API key from the Secret
  ($DIFFSERVE_API_KEY) as `diffserve serve` does.
- The plain Deployment's command line parses with `diffserve serve`'s own parser and passes the checks
  `serve` makes before it loads a model; its DIFFSERVE_* variables are declared options.
- Probes and the Prometheus scrape hit routes the server answers without the API key; the HPA's metrics
  are prometheus-adapter rules over metrics the server exports; names that objects use to refer to each
  other (claims, secrets, the HPA's target, the Service's selector) resolve.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from diffserve.configs.engine_args import EngineArgs
from diffserve.configs.option import keyword_values, namespace_values, options
from diffserve.server.args import ServerArgs

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
MANIFESTS = sorted(DEPLOY.rglob("*.yaml"))
#: The oldest Kubernetes whose schemas kubernetes-validate bundles: what validates here validates on newer.
KUBERNETES_VERSION = "1.33"
BUILD_APP = "diffserve.deploy.app:build_app"
#: The keys of one `models` entry of build_app's args (docs/scale-out.md).
MODEL_KEYS = {
    "model_path", "name", "num_replicas", "min_replicas", "max_replicas", "target_ongoing_requests",
    "upscale_delay_s", "downscale_delay_s", "engine_args", "ray_actor_options",
}  # fmt: skip
ACTOR_OPTION_KEYS = {"num_cpus", "num_gpus", "memory", "resources", "accelerator_type"}
GPU = "nvidia.com/gpu"


def _documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _objects() -> list[tuple[str, dict[str, Any]]]:
    return [
        (f"{path.relative_to(REPO)}#{index}", doc)
        for path in MANIFESTS
        for index, doc in enumerate(_documents(path))
    ]


OBJECTS = _objects()


def _of_kind(kind: str) -> list[tuple[str, dict[str, Any]]]:
    return [(where, doc) for where, doc in OBJECTS if doc.get("kind") == kind]


RAY_SERVICES = _of_kind("RayService")
[(DEPLOYMENT_AT, DEPLOYMENT)] = _of_kind("Deployment")


def _ids(items: list[tuple[str, dict[str, Any]]]) -> list[str]:
    return [where for where, _ in items]


def _containers(pod_spec: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield from pod_spec.get("initContainers", [])
    yield from pod_spec["containers"]


def _pod_templates(ray_service: dict[str, Any]) -> dict[str, dict[str, Any]]:
    cluster = ray_service["spec"]["rayClusterConfig"]
    templates = {"head": cluster["headGroupSpec"]["template"]}
    for group in cluster.get("workerGroupSpecs", []):
        templates[f"worker group {group['groupName']}"] = group["template"]
    return templates


def _serve_config(ray_service: dict[str, Any]) -> dict[str, Any]:
    config = yaml.safe_load(ray_service["spec"]["serveConfigV2"])  # KubeRay takes it as a YAML string
    assert isinstance(config, dict), "serveConfigV2 must be a YAML mapping"
    return config


def _diffserve_args(ray_service: dict[str, Any]) -> list[dict[str, Any]]:
    apps = [app for app in _serve_config(ray_service)["applications"] if app["import_path"] == BUILD_APP]
    assert apps, f"no application imports {BUILD_APP}"
    return [app.get("args", {}) for app in apps]


def _gpus(container: dict[str, Any]) -> int:
    return int(container.get("resources", {}).get("limits", {}).get(GPU, 0))


# --- Kubernetes' own kinds -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kubernetes_validate():
    return pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate is not installed (pip install kubernetes-validate)"
    )


def test_deploy_has_the_documented_manifests() -> None:
    kinds = sorted(doc["kind"] for _, doc in OBJECTS)
    assert kinds == sorted(
        ["ConfigMap", "Deployment", "HorizontalPodAutoscaler", "Job", "PersistentVolumeClaim", "RayService",
         "RayService", "Secret", "Service"]
    )  # fmt: skip


@pytest.mark.parametrize("where, doc", OBJECTS, ids=_ids(OBJECTS))
def test_every_object_validates(where: str, doc: dict[str, Any], kubernetes_validate) -> None:
    """Kubernetes kinds against the API schema (strict); RayService, the one custom resource here, has its
    pod templates validated by the next test and its serve config by the ones after."""
    if doc["apiVersion"].startswith("ray.io/"):
        assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayService"), where
        return
    _validate(kubernetes_validate, doc, where)


@pytest.mark.parametrize("where, ray_service", RAY_SERVICES, ids=_ids(RAY_SERVICES))
def test_ray_service_pod_templates_validate(
    where: str, ray_service: dict[str, Any], kubernetes_validate
) -> None:
    for group, template in _pod_templates(ray_service).items():
        pod_template = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": "t"},
            "template": template,
        }
        _validate(kubernetes_validate, pod_template, f"{where} {group}")


def _validate(kubernetes_validate, doc: dict[str, Any], where: str) -> None:
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = ".".join(str(part) for part in exc.path)
        pytest.fail(f"{where}: {doc['kind']} invalid at {path}: {exc.message}", pytrace=False)
    except kubernetes_validate.SchemaNotFoundError as exc:
        pytest.fail(f"{where}: {exc.message}", pytrace=False)


# --- the RayServices -------------------------------------------------------------------------------------


@pytest.mark.parametrize("where, ray_service", RAY_SERVICES, ids=_ids(RAY_SERVICES))
def test_ray_service_cluster_scales_gpu_workers_for_every_model(
    where: str, ray_service: dict[str, Any]
) -> None:
    cluster = ray_service["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True, "the Ray autoscaler adds the pods replicas wait for"
    gpu_capacity = 0
    for group in cluster["workerGroupSpecs"]:
        low, high = group["minReplicas"], group["maxReplicas"]
        start = group.get("replicas", low)
        assert 0 <= low <= start <= high, f"{group['groupName']}: minReplicas <= replicas <= maxReplicas"
        gpu_capacity += high * sum(_gpus(c) for c in group["template"]["spec"]["containers"])
    assert all(_gpus(c) == 0 for c in cluster["headGroupSpec"]["template"]["spec"]["containers"])
    needed = 0
    for args in _diffserve_args(ray_service):
        for model in args["models"]:
            replicas = model.get("num_replicas") or model.get("max_replicas", 1)
            needed += replicas * model.get("ray_actor_options", {}).get("num_gpus", 0)
    assert 0 < needed <= gpu_capacity, (
        f"the models' replicas need {needed} GPUs, the worker groups have {gpu_capacity}"
    )


@pytest.mark.parametrize("where, ray_service", RAY_SERVICES, ids=_ids(RAY_SERVICES))
def test_ray_service_ray_version_is_the_images(where: str, ray_service: dict[str, Any]) -> None:
    """rayVersion must match Ray in the containers: the image deploy/kuberay/Dockerfile builds on."""
    base = re.search(r"^FROM rayproject/ray:(\S+?)-", (DEPLOY / "kuberay" / "Dockerfile").read_text(), re.M)
    assert base is not None
    assert ray_service["spec"]["rayClusterConfig"]["rayVersion"] == base[1]


@pytest.mark.parametrize("where, ray_service", RAY_SERVICES, ids=_ids(RAY_SERVICES))
def test_serve_config_parses_with_ray_serves_schema(where: str, ray_service: dict[str, Any]) -> None:
    schema = pytest.importorskip(
        "ray.serve.schema", reason="Ray Serve is not installed (pip install 'ray[serve]')"
    )
    config = _serve_config(ray_service)
    parse = getattr(schema.ServeDeploySchema, "model_validate", None) or schema.ServeDeploySchema.parse_obj
    parsed = parse(config)
    assert [app.import_path for app in parsed.applications] == [BUILD_APP]
    assert parsed.applications[0].route_prefix == "/"


@pytest.mark.parametrize("where, ray_service", RAY_SERVICES, ids=_ids(RAY_SERVICES))
def test_serve_config_args_follow_the_build_app_contract(where: str, ray_service: dict[str, Any]) -> None:
    """Checked here from the declarations of EngineArgs and ServerArgs (what the CLI's flags are made from),
    whether or not diffserve.deploy is installed."""
    for args in _diffserve_args(ray_service):
        assert set(args) <= {"models", "server"}, f"unknown args {set(args) - {'models', 'server'}}"
        names = [model.get("name") or Path(model["model_path"]).name for model in args["models"]]
        assert len(set(names)) == len(names), f"two models are served under one name: {names}"
        for model in args["models"]:
            assert set(model) <= MODEL_KEYS, f"unknown keys {set(model) - MODEL_KEYS}"
            assert isinstance(model["model_path"], str)
            if model.get("num_replicas") is None:
                assert 0 <= model.get("min_replicas", 1) <= model.get("max_replicas", 1)
            assert model.get("target_ongoing_requests", 2) > 0
            engine = keyword_values(EngineArgs, model.get("engine_args", {}), "engine_args")
            actor = model.get("ray_actor_options", {})
            assert set(actor) <= ACTOR_OPTION_KEYS, (
                f"unknown ray_actor_options {set(actor) - ACTOR_OPTION_KEYS}"
            )
            # Every rank of a replica has its own device: a replica reserves as many GPUs as it runs ranks.
            assert actor.get("num_gpus", 0) in (0, engine.get("num_gpus", 1)), model["model_path"]
        # output_path: the engine's flag, a server setting under Ray (the ingress keeps the files).
        keyword_values(ServerArgs, args.get("server", {}), "server", accepted=("output_path",))


def _deploy_spec() -> Any:
    """diffserve.deploy.spec, which validates build_app's args (importable without Ray), or a skip."""
    try:
        return importlib.import_module("diffserve.deploy.spec")
    except ImportError as exc:
        pytest.skip(f"diffserve.deploy.spec cannot be imported ({exc}): build_app's own validation not run")


@pytest.mark.parametrize("where, ray_service", RAY_SERVICES, ids=_ids(RAY_SERVICES))
def test_serve_config_args_validate_with_diffserve_deploy(where: str, ray_service: dict[str, Any]) -> None:
    """The very validation build_app runs (spec.parse_app_args), and the ServerArgs each model's replicas
    get from it."""
    spec = _deploy_spec()
    for args in _diffserve_args(ray_service):
        app = spec.parse_app_args(args)
        for model in app.models:
            server = app.server_args(model)
            assert server.engine_args.output_path.startswith(args["server"]["output_path"])


@pytest.mark.parametrize("where, ray_service", RAY_SERVICES, ids=_ids(RAY_SERVICES))
def test_ray_service_api_key_from_the_secret_reaches_the_servers(
    where: str, ray_service: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The RayServices hand the API key over as $DIFFSERVE_API_KEY (from a Secret: never in the serve
    config, which anyone who may read the RayService reads): the servers built from the args take it, as
    `diffserve serve` does."""
    spec = _deploy_spec()
    env_names = {
        env["name"]
        for template in _pod_templates(ray_service).values()
        for container in template["spec"]["containers"]
        for env in container.get("env", [])
    }
    assert "DIFFSERVE_API_KEY" in env_names
    monkeypatch.setenv("DIFFSERVE_API_KEY", "k-from-the-secret")
    for args in _diffserve_args(ray_service):
        assert "api_key" not in args["server"], "the key belongs in a Secret, not in the serve config"
        app = spec.parse_app_args(args)
        for model in app.models:
            assert app.server_args(model).api_key == "k-from-the-secret", (
                "build_app's servers do not read $DIFFSERVE_API_KEY when `server` has no api_key"
            )


# --- the plain Deployment --------------------------------------------------------------------------------


def _server_container() -> dict[str, Any]:
    [container] = DEPLOYMENT["spec"]["template"]["spec"]["containers"]
    return container


def test_deployment_command_line_parses_with_diffserve_serve() -> None:
    """Each flag exists (an unknown one would stop the pod at start) and its value passes the checks `serve`
    makes before it reads the model: types, choices, bounds, the parallel degrees."""
    from diffserve.cli.engine_flags import engine_args_from
    from diffserve.cli.main import build_parser

    container = _server_container()
    assert container["command"] == ["diffserve", "serve"]
    argv = ["serve", *container["args"]]
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            parsed = build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(
            f"{DEPLOYMENT_AT}: `diffserve {' '.join(argv)}` is refused: {stderr.getvalue()}", pytrace=False
        )
    assert isinstance(parsed, argparse.Namespace)
    namespace_values(ServerArgs, parsed)
    engine = engine_args_from(parsed)
    assert engine.model_path.startswith("/models/"), "the model comes from the models volume"
    assert parsed.host == "0.0.0.0", "a server on the loopback only is unreachable from the Service"
    [port] = container["ports"]
    assert parsed.port == port["containerPort"]
    mounts = {mount["mountPath"]: mount for mount in container["volumeMounts"]}
    assert mounts["/models"].get("readOnly") is True
    assert engine.output_path in mounts, "--output-path is the pod's own volume"


def test_server_environment_variables_are_declared_options() -> None:
    declared = {o.spec.env for cls in (ServerArgs, EngineArgs) for o in options(cls) if o.spec.env}
    used = set()
    for _, doc in OBJECTS:
        for template in _templates(doc):
            for container in _containers(template["spec"]):
                used |= {
                    env["name"] for env in container.get("env", []) if env["name"].startswith("DIFFSERVE_")
                }
    assert used, "the API key reaches the servers through $DIFFSERVE_API_KEY"
    assert used <= declared, f"not read by diffserve: {sorted(used - declared)}"


def _templates(doc: dict[str, Any]) -> list[dict[str, Any]]:
    if doc["kind"] == "RayService":
        return list(_pod_templates(doc).values())
    if doc["kind"] in ("Deployment", "Job"):
        return [doc["spec"]["template"]]
    return []


def test_probes_and_scrape_use_open_server_routes() -> None:
    """/health and /metrics answer without the API key (a probe or Prometheus sending none would get 401)."""
    from diffserve.server.middleware import OPEN_PATHS
    from diffserve.server.status_routes import router

    container = _server_container()
    probes = [container[name] for name in ("startupProbe", "readinessProbe", "livenessProbe")]
    routes = {route.path for route in router.routes}
    for probe in probes:
        assert probe["httpGet"]["path"] == "/health" and "/health" in routes and "/health" in OPEN_PATHS
        assert probe["httpGet"]["port"] in ("http", container["ports"][0]["containerPort"])
    annotations = DEPLOYMENT["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/path"] in OPEN_PATHS
    assert int(annotations["prometheus.io/port"]) == container["ports"][0]["containerPort"]
    # The server gets the whole shutdown window: preStop's pause, then --shutdown-timeout, within the grace.
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    shutdown = float(_flag(container["args"], "--shutdown-timeout"))
    assert pre_stop + shutdown < DEPLOYMENT["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]


def _flag(args: list[str], flag: str) -> str:
    return next(arg.split("=", 1)[1] for arg in args if arg.startswith(f"{flag}="))


def test_hpa_scales_on_metrics_the_server_exports() -> None:
    """Each of the HPA's metrics is a prometheus-adapter rule's name, and each rule reads only metrics the
    server's registry has."""
    from diffserve.server.metrics import ServerMetrics

    exported = {metric.name for metric in ServerMetrics().registry.collect()}
    [(_, adapter)] = _of_kind("ConfigMap")
    rules = yaml.safe_load(adapter["data"]["config.yaml"])["rules"]
    served = {}
    for rule in rules:
        read = set(re.findall(r"\bdiffserve_\w+", rule["seriesQuery"] + rule["metricsQuery"]))
        assert read <= exported, f"not exported by the server: {sorted(read - exported)}"
        served[rule["name"]["as"]] = rule
        assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}  # what a Pods metric needs
    [(_, hpa)] = _of_kind("HorizontalPodAutoscaler")
    metrics = [metric["pods"]["metric"]["name"] for metric in hpa["spec"]["metrics"]]
    assert "diffserve_queue_depth" in metrics
    assert set(metrics) <= set(served), f"no adapter rule for {sorted(set(metrics) - set(served))}"
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", DEPLOYMENT["metadata"]["name"])
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    assert "replicas" not in DEPLOYMENT["spec"], "the HPA owns the replica count"


def test_references_between_objects_resolve() -> None:
    claims = {doc["metadata"]["name"] for _, doc in _of_kind("PersistentVolumeClaim")}
    secrets = {doc["metadata"]["name"] for _, doc in _of_kind("Secret")}
    for where, doc in OBJECTS:
        for template in _templates(doc):
            for volume in template["spec"].get("volumes", []):
                if "persistentVolumeClaim" in volume:
                    assert volume["persistentVolumeClaim"]["claimName"] in claims, where
            for container in _containers(template["spec"]):
                for env in container.get("env", []):
                    ref = env.get("valueFrom", {}).get("secretKeyRef")
                    # Secrets the user creates (hf-token) are optional or documented in the manifest.
                    if ref and ref["name"] not in secrets:
                        assert ref.get("optional") is True or ref["name"] in _comments(where), (where, ref)
    [(_, service)] = _of_kind("Service")
    pod_labels = DEPLOYMENT["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert DEPLOYMENT["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    [container_port] = _server_container()["ports"]
    assert service["spec"]["ports"][0]["targetPort"] in (
        container_port["name"],
        container_port["containerPort"],
    )


def _comments(where: str) -> str:
    return (REPO / where.split("#")[0]).read_text()
