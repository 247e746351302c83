"""Issue 17 item 17: `--model-path owner/name` resolves a Hugging Face repo id from the local HF cache
(offline first), `--revision` picks the snapshot, and a repo neither cached nor reachable is one clear
error. No test reaches the network: the Hub is offline (HF_HUB_OFFLINE=1, set in the environment and in
huggingface_hub's constants, which it reads at import), or, for the one download attempt, a closed port
on this machine.

The cache is laid out as huggingface_hub writes it (content-addressed blobs, snapshot folders of
relative symlinks, refs naming commits), and `huggingface_hub.scan_cache_dir` reads it back as such."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from huggingface_hub import constants, scan_cache_dir
from huggingface_hub.utils import filter_repo_objects
from PIL import Image

from diffserve.api import DiffGenerator
from diffserve.cli.main import main
from diffserve.errors import InvalidRequestError, ModelLoadError, UserError
from diffserve.loader.hub import DOWNLOAD_PATTERNS, SKIPPED_PATTERNS, is_repo_id, resolve_model_path
from diffserve.loader.model_index import read_model_index

REPO = "tiny-org/tiny-flux"
MAIN_COMMIT = "a" * 40
V2_COMMIT = "b" * 40


def add_snapshot(cache: Path, repo_id: str, commit: str, source: Path, refs: tuple[str, ...]) -> Path:
    """Put the files of `source` in the HF cache `cache` as commit `commit` of model repo `repo_id`, with
    each of `refs` (branches or tags) pointing at it, the way huggingface_hub's downloads leave them."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    for file in sorted(p for p in source.rglob("*") if p.is_file()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / file.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory: pytest.TempPathFactory, tiny_flux_dir: Path) -> Path:
    """An HF cache holding REPO at two commits: `main` (the tiny FLUX as built) and tag `v2` (the same
    model with a diffserve.json of sampling defaults, so the two snapshots differ)."""
    cache = tmp_path_factory.mktemp("hf-cache")
    add_snapshot(cache, REPO, MAIN_COMMIT, tiny_flux_dir, refs=("main",))
    v2 = tmp_path_factory.mktemp("tiny-flux-v2") / "model"
    shutil.copytree(tiny_flux_dir, v2)
    (v2 / "diffserve.json").write_text(json.dumps({"sampling_defaults": {"num_inference_steps": 2}}))
    add_snapshot(cache, REPO, V2_COMMIT, v2, refs=("v2",))
    return cache


def snapshot_of(cache: Path, commit: str) -> Path:
    return cache / ("models--" + REPO.replace("/", "--")) / "snapshots" / commit


@pytest.fixture
def offline_hub(monkeypatch: pytest.MonkeyPatch, hf_cache: Path) -> Path:
    """HF_HUB_CACHE at the test cache and HF_HUB_OFFLINE=1, in the environment (for subprocesses) and in
    huggingface_hub's constants (which it reads from the environment once, at import)."""
    monkeypatch.setenv("HF_HUB_CACHE", str(hf_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hf_cache


def test_the_test_cache_is_one_huggingface_hub_reads(hf_cache: Path) -> None:
    info = scan_cache_dir(hf_cache)
    assert not info.warnings, info.warnings
    (repo,) = info.repos
    assert repo.repo_id == REPO and repo.repo_type == "model"
    assert {r.commit_hash: set(r.refs) for r in repo.revisions} == {MAIN_COMMIT: {"main"}, V2_COMMIT: {"v2"}}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("black-forest-labs/FLUX.1-dev", True),
        ("owner/name", True),
        ("name", False),  # a bare name is taken for a (missing) folder
        ("/abs/path", False),
        ("./rel", False),
        ("a/b/c", False),
        ("~/models", False),
        ("owner/na--me", False),
    ],
)
def test_what_reads_as_a_repo_id(text: str, expected: bool) -> None:
    assert is_repo_id(text) is expected


def test_repo_id_resolves_to_the_main_snapshot(offline_hub: Path) -> None:
    assert resolve_model_path(REPO) == snapshot_of(offline_hub, MAIN_COMMIT)
    index = read_model_index(REPO)
    assert index.root == snapshot_of(offline_hub, MAIN_COMMIT)
    assert index.name == REPO  # shown and served as the repo id, loaded from the snapshot
    assert index.pipeline_class_name == "FluxPipeline"
    assert index.components["transformer"].path == snapshot_of(offline_hub, MAIN_COMMIT) / "transformer"


@pytest.mark.parametrize(
    ("revision", "commit"), [("v2", V2_COMMIT), (V2_COMMIT, V2_COMMIT), ("main", MAIN_COMMIT)]
)
def test_revision_selects_the_snapshot(offline_hub: Path, revision: str, commit: str) -> None:
    assert resolve_model_path(REPO, revision) == snapshot_of(offline_hub, commit)
    index = read_model_index(REPO, revision)
    assert index.root == snapshot_of(offline_hub, commit) and index.name == REPO


def test_local_folder_is_used_as_is_and_refuses_a_revision(offline_hub: Path, tiny_flux_dir: Path) -> None:
    assert resolve_model_path(tiny_flux_dir) == tiny_flux_dir
    assert read_model_index(tiny_flux_dir).name == str(tiny_flux_dir)
    with pytest.raises(UserError, match="applies to Hugging Face repo ids only"):
        resolve_model_path(tiny_flux_dir, "v2")


@pytest.mark.parametrize(
    ("repo", "revision", "at"),
    [("nobody/missing", None, ""), (REPO, "no-such-branch", " at revision 'no-such-branch'")],
)
def test_not_cached_and_offline_is_one_clear_error(offline_hub: Path, repo: str, revision, at: str) -> None:
    with pytest.raises(ModelLoadError) as exc:
        read_model_index(repo, revision)
    message = str(exc.value)
    assert message.startswith(
        f"model {repo!r}{at} is not a local folder, not in the Hugging Face cache (HF_HUB_CACHE={offline_hub})"
    )
    assert "could not be downloaded: HF_HUB_OFFLINE is set" in message


@pytest.fixture
def closed_port() -> int:
    """A local TCP port nothing listens on (bound, then released): connecting to it is refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_unreachable_hub_is_one_clear_line(
    offline_hub: Path, monkeypatch: pytest.MonkeyPatch, closed_port: int
) -> None:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    url = f"http://127.0.0.1:{closed_port}"
    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}"
    )
    with pytest.raises(ModelLoadError) as exc:
        resolve_model_path("nobody/missing")
    message = str(exc.value)
    assert "is not a local folder, not in the Hugging Face cache" in message
    assert "could not be downloaded: " in message and "internet connection" in message
    assert "\n" not in message


REMOTE = "tiny-org/remote-flux"
REMOTE_COMMIT = "c" * 40
#: Files of the remote repo that diffserve never loads, so never downloads.
DECOYS = {
    "flux1-dev.safetensors": b"root single-file checkpoint",
    "text_encoder/pytorch_model.bin": b"pickled duplicate",
    "vae/diffusion_pytorch_model.fp16.safetensors": b"precision variant",
    "README.md": b"# tiny",
}


class FakeHubHandler(BaseHTTPRequestHandler):
    """Just enough of the Hub's HTTP API for `snapshot_download`, on this machine: the repo REMOTE (any
    revision is REMOTE_COMMIT) with the files `files`; any other repo answers RepoNotFound, as the Hub
    does for a missing repo or a private or gated one without a token."""

    files: dict[str, bytes] = {}
    requests: list[str] = []

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        self.requests.append(f"{self.command} {path}")
        resolve = f"/{REMOTE}/resolve/{REMOTE_COMMIT}/"
        if path.startswith(f"/api/models/{REMOTE}/revision/"):
            self._send(200, json.dumps({"id": REMOTE, "sha": REMOTE_COMMIT}).encode())
        elif path == f"/api/models/{REMOTE}/tree/{REMOTE_COMMIT}":
            tree = [
                {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                for name, data in self.files.items()
            ]
            self._send(200, json.dumps(tree).encode())
        elif path.startswith(resolve) and path[len(resolve) :] in self.files:
            data = self.files[path[len(resolve) :]]
            etag = hashlib.sha1(data).hexdigest()
            self._send(200, data, ("X-Repo-Commit", REMOTE_COMMIT), ("ETag", f'"{etag}"'))
        else:
            self._send(401, b"", ("X-Error-Code", "RepoNotFound"))

    def _send(self, status: int, body: bytes, *headers: tuple[str, str]) -> None:
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # keep the test output quiet
        pass


@pytest.fixture
def online_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_flux_dir: Path) -> Iterator[Path]:
    """An empty HF cache (returned), online, with the Hub's URLs pointing at a FakeHubHandler server that
    holds the tiny FLUX and DECOYS as REMOTE."""
    files = {
        str(f.relative_to(tiny_flux_dir)): f.read_bytes() for f in tiny_flux_dir.rglob("*") if f.is_file()
    }
    handler = type("Hub", (FakeHubHandler,), {"files": {**files, **DECOYS}, "requests": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    cache = tmp_path / "hf-cache"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}"
    )
    monkeypatch.setattr(FakeHubHandler, "requests", handler.requests)  # for the tests to read
    try:
        yield cache
    finally:
        server.shutdown()
        thread.join()
        server.server_close()


def test_download_fetches_what_diffserve_loads_then_works_offline(
    online_hub: Path, monkeypatch: pytest.MonkeyPatch, tiny_flux_dir: Path
) -> None:
    folder = resolve_model_path(REMOTE, "v1")
    repo = online_hub / ("models--" + REMOTE.replace("/", "--"))
    assert folder == repo / "snapshots" / REMOTE_COMMIT
    assert f"GET /api/models/{REMOTE}/revision/v1" in FakeHubHandler.requests
    assert (repo / "refs" / "v1").read_text() == REMOTE_COMMIT
    downloaded = sorted(str(f.relative_to(folder)) for f in folder.rglob("*") if f.is_file())
    built = {str(f.relative_to(tiny_flux_dir)) for f in tiny_flux_dir.rglob("*") if f.is_file()}
    # All but DECOYS and the test builder's record of its spec (a root file diffserve does not read).
    assert downloaded == sorted(built - {"diffserve_tiny_spec.json"})
    # Offline now: the cached snapshot is found without the Hub.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    FakeHubHandler.requests.clear()
    index = read_model_index(REMOTE, "v1")
    assert index.root == folder and index.name == REMOTE and not FakeHubHandler.requests


def test_repo_not_found_on_the_hub_hints_at_a_token(online_hub: Path) -> None:
    with pytest.raises(ModelLoadError) as exc:
        resolve_model_path("black-forest-labs/FLUX.1-dev")
    message = str(exc.value)
    assert "'black-forest-labs/FLUX.1-dev' is not a local folder" in message and "\n" not in message
    assert "could not be downloaded: 401 Client Error." in message
    assert message.endswith("(a gated or private repo needs a token: set HF_TOKEN or run `hf auth login`)")


def test_only_the_files_diffserve_loads_are_downloaded() -> None:
    """The patterns, applied by huggingface_hub's own filter to a FLUX.1-dev-like repo listing."""
    wanted = [
        "model_index.json", "diffserve.json", "scheduler/scheduler_config.json",
        "text_encoder/config.json", "text_encoder/model.safetensors",
        "text_encoder_2/model.safetensors.index.json", "text_encoder_2/model-00001-of-00002.safetensors",
        "tokenizer/vocab.json", "tokenizer/merges.txt", "tokenizer/special_tokens_map.json",
        "tokenizer_2/spiece.model", "tokenizer_2/tokenizer.json", "processor/chat_template.jinja",
        "transformer/diffusion_pytorch_model.safetensors.index.json",
        "transformer/diffusion_pytorch_model-00001-of-00003.safetensors",
        "vae/config.json", "vae/diffusion_pytorch_model.safetensors",
    ]  # fmt: skip
    skipped = [
        "README.md", "LICENSE.md", ".gitattributes", "dev_grid.jpg",
        "flux1-dev.safetensors", "ae.safetensors",  # root single-file checkpoints
        "text_encoder/pytorch_model.bin", "unet/diffusion_pytorch_model.ckpt",
        "vae/diffusion_pytorch_model.fp16.safetensors", "text_encoder_2/model.fp16-00001-of-00002.safetensors",
        "text_encoder_2/model.safetensors.index.fp16.json", "transformer/diffusion_pytorch_model.bf16.safetensors",
    ]  # fmt: skip
    kept = filter_repo_objects(
        wanted + skipped, allow_patterns=list(DOWNLOAD_PATTERNS), ignore_patterns=list(SKIPPED_PATTERNS)
    )
    assert sorted(kept) == sorted(wanted)


def test_cli_missing_repo_is_one_error_line_and_exit_2(
    offline_hub: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    code = main(
        ["generate", "--model-path", "nobody/missing", "--prompt", "x", "--seed", "1", "--no-save-output"]
    )
    err = capfd.readouterr().err
    assert code == 2, err
    error_lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert error_lines == [
        f"error: model 'nobody/missing' is not a local folder, not in the Hugging Face cache "
        f"(HF_HUB_CACHE={offline_hub}), and could not be downloaded: HF_HUB_OFFLINE is set, so the Hub was "
        "not contacted"
    ], err
    assert "Traceback" not in err


def test_cli_generate_from_the_cache_end_to_end(
    offline_hub: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """`diffserve generate --model-path owner/name --revision v2` loads the v2 snapshot (its diffserve.json
    sets 2 steps) from the cache, and the output names the repo id, not the cache folder."""
    code = main(
        ["generate", "--model-path", REPO, "--revision", "v2", "--prompt", "a red fox",
         "--height", "32", "--width", "32", "--seed", "5", "--output-path", str(tmp_path)]
    )  # fmt: skip
    err = capfd.readouterr().err
    assert code == 0, err
    assert f"commit {V2_COMMIT}" in err
    (png,) = tmp_path.glob("*.png")
    with Image.open(png) as image:
        params = json.loads(image.text["parameters"])
    assert params["model"] == REPO and params["num_inference_steps"] == 2 and params["seed"] == 5


@pytest.fixture(scope="module")
def generator_from_hub(hf_cache: Path) -> Iterator[DiffGenerator]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(constants, "HF_HUB_CACHE", str(hf_cache))
        patch.setattr(constants, "HF_HUB_OFFLINE", True)
        yield DiffGenerator.from_pretrained(REPO, revision=MAIN_COMMIT, show_progress=False)


def test_api_from_pretrained_takes_a_repo_id(generator_from_hub: DiffGenerator, hf_cache: Path) -> None:
    assert generator_from_hub.model_path == REPO
    assert generator_from_hub.model_folder == snapshot_of(hf_cache, MAIN_COMMIT)
    out = generator_from_hub.generate("a fox", height=32, width=32, num_inference_steps=1, seed=3)
    assert out.images[0].size == (32, 32)


def test_api_unknown_keyword_names_it_and_lists_the_valid_ones(generator_from_hub: DiffGenerator) -> None:
    with pytest.raises(InvalidRequestError) as exc:
        generator_from_hub.generate("a fox", bogus=1, num_inference_step=2)
    message = str(exc.value)
    assert message.startswith("generate() got unknown keyword argument(s) 'bogus', 'num_inference_step'")
    assert "valid ones: negative_prompt, height, width, num_inference_steps," in message
    assert "save_output" in message and "__init__" not in message
    assert exc.value.param == "bogus"
    with pytest.raises(
        InvalidRequestError, match=r"'num_inference_step' \(did you mean 'num_inference_steps'\?\)"
    ):
        generator_from_hub.generate("a fox", num_inference_step=2)
