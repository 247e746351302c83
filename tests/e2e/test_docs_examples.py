"""The README's and docs/'s ```bash and ```python blocks run as written, in order, one document at a time.

A reader pastes a document's commands into a shell started at the repository root and its snippets into one
Python session; this test does the same in a temporary directory that looks like a fresh clone (the repo's
top-level entries and `.venv` symlinked, `.venv/bin` first on PATH), so nothing is written into the repo.
Two rewrites keep parallel runs apart, applied to every block and marker of a document alike: the port 30000
becomes a free port, and `/tmp/` becomes a folder inside the temporary directory.

A bash block that runs `diffserve serve` is started in the background (stopping the document's previous
server), and the next block waits for `/health`. An HTML comment right above a block changes that:

- `<!-- docs-test: skip: REASON -->`: not run (it needs what a test machine cannot have); REASON is printed.
- `<!-- docs-test: server: ARGS -->`: first start `diffserve serve ARGS` (the block is a client of it).

Untagged, ```text, ```json and other blocks are listings, never run.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from markdown_it import MarkdownIt

REPO = Path(__file__).resolve().parents[2]
DOCUMENTS = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))
RUN_LANGUAGES = ("bash", "python")
DOCS_PORT = "30000"
MARKER = re.compile(r"<!--\s*docs-test:\s*(?P<kind>[a-z-]+):\s*(?P<value>.*?)\s*-->", re.DOTALL)
MARKER_KINDS = ("skip", "server")
SERVE_LINE = re.compile(r"^[^#]*\bdiffserve\s+serve\b", re.MULTILINE)
TMP_PATH = re.compile(r"(?<![\w./-])/tmp/")
BLOCK_TIMEOUT_S = 300.0
SERVER_READY_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Block:
    """One fenced code block of a document, and what its docs-test marker (if any) asks for."""

    document: str
    line: int
    language: str
    code: str
    skip: str | None = None
    server_args: str | None = None

    @property
    def where(self) -> str:
        return f"{self.document}:{self.line}"

    @property
    def starts_server(self) -> bool:
        return self.language == "bash" and SERVE_LINE.search(self.code) is not None


def parse_blocks(text: str, document: str) -> list[Block]:
    """Every fenced ```bash / ```python block of `text` in order, with the marker right above it.

    A docs-test marker anywhere else, one of an unknown kind, or one above a block that is never run is a
    ValueError: a typo must not silently turn a check off.
    """
    blocks: list[Block] = []
    marker: tuple[str, str, int] | None = None  # kind, value, line
    for token in MarkdownIt("commonmark").parse(text):
        line = token.map[0] + 1 if token.map else 0
        if token.type == "html_block" and "docs-test" in token.content:
            _refuse_dangling(marker, document)
            marker = (*_read_marker(token.content, f"{document}:{line}"), line)
            continue
        language = token.info.strip().split(" ")[0] if token.type == "fence" else ""
        if language in RUN_LANGUAGES:
            kind, value = marker[:2] if marker else (None, None)
            skip, server_args = (value if kind == "skip" else None), (value if kind == "server" else None)
            blocks.append(Block(document, line, language, token.content, skip, server_args))
            marker = None
            continue
        _refuse_dangling(marker, document)
    _refuse_dangling(marker, document)
    return blocks


def _refuse_dangling(marker: tuple[str, str, int] | None, document: str) -> None:
    if marker is not None:
        raise ValueError(
            f"{document}:{marker[2]}: a docs-test marker must be right above a bash/python block"
        )


def _read_marker(comment: str, where: str) -> tuple[str, str]:
    match = MARKER.fullmatch(comment.strip())
    if match is None or match["kind"] not in MARKER_KINDS or not match["value"]:
        raise ValueError(
            f"{where}: malformed docs-test marker {comment.strip()!r}; expected "
            "<!-- docs-test: skip: REASON --> or <!-- docs-test: server: ARGS -->"
        )
    return match["kind"], match["value"]


def rewrite(code: str, port: int, tmp_root: Path) -> str:
    """`code` with the documented port replaced by `port` and `/tmp/` paths moved under `tmp_root`."""
    code = re.sub(rf"\b{DOCS_PORT}\b", str(port), code)
    return TMP_PATH.sub(lambda _: f"{tmp_root}/", code)


def marker_server_command(server_args: str, port: int, tmp_root: Path) -> str:
    """The `diffserve serve` command a server marker asks for, rewritten as the document's blocks are."""
    return rewrite(f"diffserve serve {server_args} --port {DOCS_PORT}", port, tmp_root)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Reader:
    """Runs one document's blocks the way a reader would, in a clone-like temporary directory."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.tmp_root = workdir / "tmp"
        self.tmp_root.mkdir()
        self.port = free_port()
        # As a reader running the snippets as a script (`if __name__ == "__main__":` blocks run).
        self.namespace: dict[str, object] = {"__name__": "__main__"}
        self.server: subprocess.Popen[bytes] | None = None
        self.server_log = workdir / "server.log"
        self.env = _reader_env(workdir)
        _make_clone_like(workdir)

    def run(self, block: Block) -> None:
        if block.skip is not None:
            print(f"SKIP {block.where}: {block.skip}")
            return
        if block.server_args is not None:
            self._start_server(
                marker_server_command(block.server_args, self.port, self.tmp_root), block.where
            )
        code = rewrite(block.code, self.port, self.tmp_root)
        print(f"RUN {block.where} ({block.language})")
        if block.starts_server:
            self._start_server(code, block.where)
        elif block.language == "bash":
            self._run_bash(code, block)
        else:
            self._run_python(code, block)

    def _run_bash(self, code: str, block: Block) -> None:
        _refuse_stale_install(code, self.workdir, self.env)
        result = subprocess.run(
            ["bash", "-e", "-o", "pipefail", "-c", code], cwd=self.workdir, env=self.env,
            capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S,
        )  # fmt: skip
        if result.returncode != 0:
            pytest.fail(
                f"{block.where}: bash block exited {result.returncode}\n--- block\n{code}\n--- stdout\n"
                f"{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}{self._server_tail()}",
                pytrace=False,
            )

    def _run_python(self, code: str, block: Block) -> None:
        try:
            exec(compile(code, block.where, "exec"), self.namespace)  # noqa: S102 - the documented snippet
        except Exception:
            pytest.fail(
                f"{block.where}: python block raised\n--- block\n{code}\n--- traceback\n"
                f"{traceback.format_exc()[-4000:]}{self._server_tail()}",
                pytrace=False,
            )

    def _start_server(self, code: str, where: str) -> None:
        """Start `code` (a rewritten bash script ending in `diffserve serve`) in the background; wait for
        /health."""
        self.stop_server()
        print(f"SERVE {where}: {code.strip()}")
        with self.server_log.open("ab") as log:
            self.server = subprocess.Popen(
                ["bash", "-e", "-c", code], cwd=self.workdir, env=self.env, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + SERVER_READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.server.poll() is not None:
                pytest.fail(
                    f"{where}: the server exited {self.server.returncode}{self._server_tail()}", pytrace=False
                )
            if _healthy(self.port):
                return
            time.sleep(0.5)
        pytest.fail(
            f"{where}: the server was not ready in {SERVER_READY_TIMEOUT_S:.0f} s{self._server_tail()}"
        )

    def stop_server(self) -> None:
        """SIGTERM the server's process group (started by this reader), SIGKILL it if it does not exit."""
        if self.server is None or self.server.poll() is not None:
            self.server = None
            return
        os.killpg(self.server.pid, signal.SIGTERM)
        try:
            self.server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.server.pid, signal.SIGKILL)
            self.server.wait()
        self.server = None

    def _server_tail(self) -> str:
        if not self.server_log.exists():
            return ""
        return "\n--- server log (tail)\n" + self.server_log.read_text(errors="replace")[-4000:]


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def _reader_env(workdir: Path) -> dict[str, str]:
    """The environment of a reader's shell at the clone's root: `.venv/bin` first, no API key set, offline."""
    env = {k: v for k, v in os.environ.items() if k not in ("DIFFSERVE_API_KEY", "OPENAI_BASE_URL")}
    env["PATH"] = f"{workdir / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["HF_HUB_OFFLINE"] = "1"
    return env


def _make_clone_like(workdir: Path) -> None:
    """Symlink the repo's top-level entries (and .venv) into `workdir`; what the blocks write stays there."""
    for entry in REPO.iterdir():
        if (entry.name.startswith(".") and entry.name != ".venv") or entry.name == "outputs":
            continue
        (workdir / entry.name).symlink_to(entry)


def _refuse_stale_install(code: str, workdir: Path, env: dict[str, str]) -> None:
    """`make` would reinstall from the temporary clone (breaking the shared .venv) when its stamp is stale."""
    if not re.search(r"^\s*make\b", code, re.MULTILINE):
        return
    stale = subprocess.run(["make", "-q", ".venv/.diffserve-runtime"], cwd=workdir, env=env).returncode != 0
    if stale:
        pytest.skip("the .venv's install stamp is older than pyproject.toml: run `make install` first")


@pytest.fixture
def reader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Reader]:
    monkeypatch.chdir(tmp_path)  # python blocks open relative paths, as in the reader's session
    for name in ("DIFFSERVE_API_KEY", "OPENAI_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    reader = Reader(tmp_path)
    try:
        yield reader
    finally:
        reader.stop_server()


def documents_with_blocks(documents: tuple[Path, ...]) -> list[Path]:
    return [doc for doc in documents if parse_blocks(doc.read_text(), doc.name)]


def run_document(document: Path, reader: Reader) -> None:
    blocks = parse_blocks(document.read_text(), str(document.relative_to(REPO)))
    for block in blocks:
        reader.run(block)


# The README here, docs/ in test_docs_pages.py: two files, so parallel test workers take one each.
@pytest.mark.parametrize("document", documents_with_blocks(DOCUMENTS[:1]), ids=lambda doc: doc.name)
def test_document_runs_as_written(document: Path, reader: Reader) -> None:
    run_document(document, reader)


# --- the harness itself --------------------------------------------------------------------------------


def test_every_document_parses_and_names_a_model_for_its_servers() -> None:
    """Every marker is well formed, and every client of a server has one: a serve block or a server marker."""
    for document in DOCUMENTS:
        serving = False
        for block in parse_blocks(document.read_text(), document.name):
            serving = serving or block.starts_server or block.server_args is not None
            uses_server = DOCS_PORT in block.code
            assert not uses_server or serving or block.skip, f"{block.where} talks to a server nobody started"


def test_parse_reads_markers_and_ignores_listings() -> None:
    text = (
        "```\ndiffserve serve\n```\n\n```text\nls\n```\n\n<!-- docs-test: skip: needs a GPU -->\n```bash\nnvidia-smi\n```\n\n"
        "<!-- docs-test: server: --model-path /tmp/m -->\n```python\nprint(1)\n```\n\n```bash\ndiffserve serve --port 30000\n```\n"
    )
    blocks = parse_blocks(text, "t.md")
    assert [(b.language, b.skip, b.server_args, b.starts_server) for b in blocks] == [
        ("bash", "needs a GPU", None, False),
        ("python", None, "--model-path /tmp/m", False),
        ("bash", None, None, True),
    ]
    assert [b.line for b in blocks] == [10, 15, 19]


@pytest.mark.parametrize(
    "text",
    [
        "<!-- docs-test: skipp: typo -->\n```bash\nls\n```\n",  # unknown kind
        "<!-- docs-test: skip: -->\n```bash\nls\n```\n",  # no reason
        "<!-- docs-test: skip: listing -->\n```text\nls\n```\n",  # above a block that never runs
        "<!-- docs-test: skip: stray -->\n\nsome prose\n",  # above no block at all
    ],
)
def test_parse_refuses_misplaced_or_malformed_markers(text: str) -> None:
    with pytest.raises(ValueError, match="docs-test marker"):
        parse_blocks(text, "t.md")


def test_rewrite_moves_port_and_tmp_paths_consistently(tmp_path: Path) -> None:
    code = (
        'diffserve serve --model-path /tmp/tiny --port 30000\nOpenAI(base_url="http://127.0.0.1:30000/v1")\n'
    )
    out = rewrite(code, 4321, tmp_path)
    assert out == (
        f'diffserve serve --model-path {tmp_path}/tiny --port 4321\nOpenAI(base_url="http://127.0.0.1:4321/v1")\n'
    )
    assert rewrite("x=300001 /var/tmp/a", 1, tmp_path) == "x=300001 /var/tmp/a"


def test_marker_server_command_is_rewritten_once(tmp_path: Path) -> None:
    command = marker_server_command("--model-path /tmp/tiny-qwen-edit --served-model-name Q", 4321, tmp_path)
    assert (
        command == f"diffserve serve --model-path {tmp_path}/tiny-qwen-edit --served-model-name Q --port 4321"
    )
