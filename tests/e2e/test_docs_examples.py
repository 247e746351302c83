"""The README's and docs/'s ```bash and ```python blocks run as written, in order, one document at a time.

A reader pastes a document's commands into a shell started at the repository root and its snippets into one
Python session; this test does the same in a temporary directory that looks like a fresh clone (the repo's
top-level entries and `.venv`'s symlinked, `.venv/bin` first on PATH), so nothing is written into the repo.
Its `.venv/bin/diffserve` runs each command forked from this test process's preloaded interpreter
(`diffserve.testing.command_launcher`): to the shell it is the command, started in a fraction of a second.
Two rewrites keep parallel runs apart, applied to every block and marker of a document alike: the port 30000
becomes a free port, and `/tmp/` becomes a folder inside the temporary directory.

A bash block that runs `diffserve serve` is started in the background (the document's previous server is
released), and the next block waits for `/health`. An HTML comment right above a block changes that:

- `<!-- docs-test: skip: REASON -->`: not run (it needs what a test machine cannot have); REASON is printed.
- `<!-- docs-test: server: ARGS -->`: first start `diffserve serve ARGS` (the block is a client of it).

Untagged, ```text, ```json and other blocks are listings, never run.

Servers are shared between documents (one file, so one test worker runs them all): a server block whose
last line is one plain `diffserve serve` command runs its other lines as a bash block, then reuses a running
server of the same command (the documented `/tmp/` paths, with the files and folders they name byte for
byte the same) instead of starting another; the document's blocks then talk to that server's port. Such a
server runs in a clone-like directory of its own (its default `--output-path` is its own), and is stopped
once no later block of any document starts its command.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import threading
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from markdown_it import MarkdownIt

from diffserve.cli.main import main as cli_main
from diffserve.testing.command_launcher import CommandLauncher
from diffserve.testing.ports import unassigned_port

REPO = Path(__file__).resolve().parents[2]
DOCUMENTS = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))
RUN_LANGUAGES = ("bash", "python")
DOCS_PORT = "30000"
MARKER = re.compile(r"<!--\s*docs-test:\s*(?P<kind>[a-z-]+):\s*(?P<value>.*?)\s*-->", re.DOTALL)
MARKER_KINDS = ("skip", "server")
SERVE_LINE = re.compile(r"^[^#]*\bdiffserve\s+serve\b", re.MULTILINE)
TMP_PATH = re.compile(r"(?<![\w./-])/tmp/")
#: A line that changes the shell's state for the lines after it (directory, variables, options, functions).
SHELL_STATE = re.compile(
    r"^\s*(cd|pushd|popd|export|source|\.|set|shopt|alias|unset|declare|[A-Za-z_]\w*=|\w+\s*\(\))",
    re.MULTILINE,
)
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


def marker_server_block(server_args: str) -> str:
    """The `diffserve serve` command a server marker asks for, as documented (before the rewrites)."""
    return f"diffserve serve {server_args} --port {DOCS_PORT}"


def marker_server_command(server_args: str, port: int, tmp_root: Path) -> str:
    """The `diffserve serve` command a server marker asks for, rewritten as the document's blocks are."""
    return rewrite(marker_server_block(server_args), port, tmp_root)


class PortForward:
    """A document's port (its 30000), forwarded to the server the document started last.

    A document uses one port for every server it starts: a client made in an earlier block talks to the
    next server too. Servers shared between documents keep ports of their own; switching the target
    closes the connections to the previous one, as stopping it did."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.target: int | None = None
        self.lock = threading.Lock()
        self.open: set[socket.socket] = set()
        threading.Thread(target=self._accept, name=f"docs-port-{self.port}", daemon=True).start()

    def retarget(self, port: int | None) -> None:
        with self.lock:
            self.target = port
            for sock in self.open:
                _close(sock)
            self.open.clear()

    def close(self) -> None:
        self.retarget(None)
        _close(self.listener)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            try:
                with self.lock:
                    if self.target is None:
                        raise OSError("no server")
                    upstream = socket.create_connection(("127.0.0.1", self.target), timeout=10)
                    upstream.settimeout(None)
                    self.open |= {client, upstream}
            except OSError:
                _close(client)
                continue
            pumps = [
                threading.Thread(target=self._pump, args=(src, dst), daemon=True)
                for src, dst in ((client, upstream), (upstream, client))
            ]
            for pump in pumps:
                pump.start()
            threading.Thread(target=self._reap, args=(pumps, client, upstream), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        """Copy `src` to `dst` until `src` ends (then end `dst`'s writing side) or either fails."""
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            _close(src)
            _close(dst)

    def _reap(self, pumps: list[threading.Thread], *socks: socket.socket) -> None:
        for pump in pumps:
            pump.join()
        with self.lock:
            for sock in socks:
                _close(sock)
                self.open.discard(sock)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


# --- servers shared between documents ------------------------------------------------------------------


def split_serve(code: str) -> tuple[str, str] | None:
    """(the lines before, the serve line) of a server block whose last command is one plain, one-line
    `diffserve serve` command (no `&&`, pipe, redirection, continuation or expansion) that the lines before
    do not set up (no `cd`, variable or shell option): run apart, the two do what the block does. None for
    any other block."""
    lines = code.rstrip().split("\n")
    while lines and lines[-1].lstrip().startswith("#"):
        lines.pop()
    if not lines or not SERVE_LINE.search(lines[-1]):
        return None
    prelude, line = "\n".join(lines[:-1]), lines[-1]
    if SERVE_LINE.search(prelude) or prelude.rstrip().endswith("\\") or SHELL_STATE.search(prelude):
        return None
    if "$" in line or "`" in line or serve_argv(line) is None:
        return None
    return prelude, line


def serve_argv(line: str) -> list[str] | None:
    """The words of a plain `[NAME=VALUE ...] PROGRAM serve ARGS` line (comments dropped), without its
    `--port`; None when the line is more than one simple command."""
    try:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split, lexer.commenters = True, "#"
        words = list(lexer)
    except ValueError:
        return None
    if any(word and set(word) <= set("();<>|&") for word in words):
        return None
    argv: list[str] = []
    skip_next = False
    for word in words:
        if skip_next:
            skip_next = False
        elif word == "--port":
            skip_next = True
        elif not word.startswith("--port="):
            argv.append(word)
    serve = next((i for i, word in enumerate(argv) if "=" not in word), None)
    if serve is None or serve + 1 >= len(argv) or argv[serve + 1] != "serve":
        return None
    argv[serve] = Path(argv[serve]).name  # `.venv/bin/diffserve` is `diffserve`: .venv/bin is first on PATH
    return argv


def canonical_serve_command(code: str) -> str | None:
    """What a server block starts, as documented (before the rewrites): its serve line's words without
    the port; None for a block whose server is never shared (see `split_serve`)."""
    split = split_serve(code)
    return None if split is None else shlex.join(serve_argv(split[1]) or [])


def _fingerprint(path: Path) -> str:
    """The bytes of a file, or of every file in a folder (symlinks not followed) with its relative name."""
    digest = hashlib.sha256()
    if path.is_file():
        digest.update(path.read_bytes())
        return digest.hexdigest()
    for folder, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            file = Path(folder) / name
            digest.update(str(file.relative_to(path)).encode() + b"\0")
            digest.update(file.read_bytes() if file.is_file() else os.readlink(file).encode())
    return digest.hexdigest()


@dataclass
class Server:
    """One `diffserve serve` started by a reader: a background `bash -e -c CODE` in its own process group."""

    process: subprocess.Popen[bytes]
    port: int
    log: Path
    where: str
    #: What a later server block must match to reuse it (None: never reused); `canonical`: the documented
    #: command, counted down in `ServerPool.uses`.
    key: tuple[object, ...] | None = None
    canonical: str | None = None

    def alive(self) -> bool:
        return self.process.poll() is None and _healthy(self.port)

    def stop(self) -> None:
        """SIGTERM the server's process group, SIGKILL it if it does not exit."""
        if self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def tail(self) -> str:
        if not self.log.exists():
            return ""
        return "\n--- server log (tail)\n" + self.log.read_text(errors="replace")[-4000:]


@dataclass
class ServerPool:
    """The servers the documents' readers started, for reuse by later server blocks of the same command.

    `uses` counts, per documented serve command, the server blocks of all documents not yet run: a released
    server whose count is down to 0 is stopped (no later block can reuse it)."""

    logs: Path
    uses: Counter[str]
    #: What every clone's `diffserve` runs its commands with (`_make_clone_like`).
    launcher: CommandLauncher
    servers: list[Server] = field(default_factory=list)

    @classmethod
    def for_documents(cls, documents: tuple[Path, ...], logs: Path, launcher: CommandLauncher) -> ServerPool:
        uses: Counter[str] = Counter()
        for document in documents:
            for block in parse_blocks(document.read_text(), document.name):
                for code in _server_codes(block):
                    if (canonical := canonical_serve_command(code)) is not None:
                        uses[canonical] += 1
        return cls(logs, uses, launcher)

    def find(self, key: tuple[object, ...]) -> Server | None:
        return next((s for s in self.servers if s.key == key and s.alive()), None)

    def start(self, code: str, port: int, reader: Reader, where: str, key, canonical) -> Server:
        """Start `code` (a rewritten bash script ending in `diffserve serve`) in the background; wait for
        /health. A server for reuse (`key` set) runs in a clone-like directory of its own, not the
        reader's: servers that outlive their document must not share a working directory (nor so the
        default `--output-path`, which a server keeps to itself)."""
        log = self.logs / f"server-{port}.log"
        cwd, env = reader.workdir, reader.env
        if key is not None:
            cwd = self.logs / f"server-{port}"
            cwd.mkdir()
            _make_clone_like(cwd, self.launcher)
            env = _reader_env(cwd, self.launcher)
        print(f"SERVE {where}: {code.strip()}")
        with log.open("ab") as out:
            process = subprocess.Popen(
                ["bash", "-e", "-c", code], cwd=cwd, env=env, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        server = Server(process, port, log, where, key, canonical)
        self.servers.append(server)
        deadline = time.monotonic() + SERVER_READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if process.poll() is not None:
                pytest.fail(f"{where}: the server exited {process.returncode}{server.tail()}", pytrace=False)
            if _healthy(port):
                return server
            time.sleep(0.1)
        pytest.fail(f"{where}: the server was not ready in {SERVER_READY_TIMEOUT_S:.0f} s{server.tail()}")

    def used(self, canonical: str | None) -> None:
        if canonical is not None:
            self.uses[canonical] -= 1

    def release(self, server: Server) -> None:
        """A reader is done with `server`: stop it unless a later server block may reuse it."""
        if server.key is None or self.uses[server.canonical] <= 0 or server.process.poll() is not None:
            server.stop()
            self.servers.remove(server)

    def stop_all(self) -> None:
        for server in self.servers:
            server.stop()
        self.servers.clear()


def _server_codes(block: Block) -> list[str]:
    """The bash scripts a block starts servers with, as documented (before the rewrites)."""
    if block.skip is not None:
        return []
    codes = [marker_server_block(block.server_args)] if block.server_args is not None else []
    return codes + ([block.code] if block.starts_server else [])


class Reader:
    """Runs one document's blocks the way a reader would, in a clone-like temporary directory."""

    def __init__(self, workdir: Path, servers: ServerPool) -> None:
        self.workdir = workdir
        self.tmp_root = workdir / "tmp"
        self.tmp_root.mkdir()
        # The port blocks talk to (the document's 30000): forwarded to the server it started last.
        self.forward = PortForward()
        self.port = self.forward.port
        # As a reader running the snippets as a script (`if __name__ == "__main__":` blocks run).
        self.namespace: dict[str, object] = {"__name__": "__main__"}
        self.servers = servers
        self.server: Server | None = None
        self.env = _reader_env(workdir, servers.launcher)
        _make_clone_like(workdir, servers.launcher)

    def run(self, block: Block) -> None:
        if block.skip is not None:
            print(f"SKIP {block.where}: {block.skip}")
            return
        if block.server_args is not None:
            self._serve(marker_server_block(block.server_args), block.where)
        started = time.monotonic()
        if block.starts_server:
            self._serve(block.code, block.where)
        elif block.language == "bash":
            self._run_bash(rewrite(block.code, self.port, self.tmp_root), block.where)
        else:
            self._run_python(rewrite(block.code, self.port, self.tmp_root), block.where)
        print(f"RAN {block.where} ({block.language}) in {time.monotonic() - started:.1f} s")

    def _run_bash(self, code: str, where: str) -> None:
        _refuse_stale_install(code, self.workdir, self.env)
        result = subprocess.run(
            ["bash", "-e", "-o", "pipefail", "-c", code], cwd=self.workdir, env=self.env,
            capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S,
        )  # fmt: skip
        if result.returncode != 0:
            pytest.fail(
                f"{where}: bash block exited {result.returncode}\n--- block\n{code}\n--- stdout\n"
                f"{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}{self._server_tail()}",
                pytrace=False,
            )

    def _run_python(self, code: str, where: str) -> None:
        try:
            exec(compile(code, where, "exec"), self.namespace)  # noqa: S102 - the documented snippet
        except Exception:
            pytest.fail(
                f"{where}: python block raised\n--- block\n{code}\n--- traceback\n"
                f"{traceback.format_exc()[-4000:]}{self._server_tail()}",
                pytrace=False,
            )

    def _serve(self, documented: str, where: str) -> None:
        """Run a server block (`documented`, before the rewrites): reuse a running server of the same
        command and files, or start one; the document's next blocks talk to its port."""
        self.release_server()
        canonical = canonical_serve_command(documented)
        self.servers.used(canonical)
        port = unassigned_port()
        code = rewrite(documented, port, self.tmp_root)
        split = split_serve(code) if canonical is not None and code.count(str(port)) == 1 else None
        if split is None:  # not a plain serve line: start the whole block, never shared
            self.server = self.servers.start(code, port, self, where, None, None)
        else:
            prelude, line = split
            if prelude.strip():
                self._run_bash(prelude, where)
            key = self._server_key(line)
            self.server = None if key is None else self.servers.find(key)
            if self.server is not None:
                print(f"REUSE {where}: {line.strip()} (the server {self.server.where} started)")
            else:
                self.server = self.servers.start(
                    line, port, self, where, key, None if key is None else canonical
                )
        self.forward.retarget(self.server.port)

    def _server_key(self, line: str) -> tuple[object, ...] | None:
        """The serve line's words with this reader's temporary folder back at `/tmp/`, the bytes of the
        program they run, and the bytes of the files and folders they name that this reader wrote (the
        repo's own files are the same for every reader). None when a relative path names one of those: the
        server must run in this reader's directory, and is not shared."""
        argv = serve_argv(line) or []
        words, files = [], []
        home = self.workdir.resolve()
        for word in argv:
            words.append(word.replace(f"{self.tmp_root}/", "/tmp/"))
            for part in {word, word.rpartition("=")[2]} - {""}:
                path = (self.workdir / part).resolve()  # an absolute `part` stays itself
                if path.exists() and path != home and path.is_relative_to(home):
                    if not Path(part).is_absolute():
                        return None
                    files.append((part.replace(f"{self.tmp_root}/", "/tmp/"), _fingerprint(path)))
        program = next((word for word in argv if "=" not in word), "")
        found = shutil.which(program, path=self.env["PATH"]) if program else None
        # The program by its bytes: every clone's `.venv/bin/diffserve` is a launcher script of its own.
        return (tuple(words), _fingerprint(Path(found)) if found else program, tuple(sorted(files)))

    def release_server(self) -> None:
        self.forward.retarget(None)
        if self.server is not None:
            self.servers.release(self.server)
            self.server = None

    def close(self) -> None:
        self.release_server()
        self.forward.close()

    def _server_tail(self) -> str:
        return "" if self.server is None else self.server.tail()


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def _reader_env(workdir: Path, launcher: CommandLauncher) -> dict[str, str]:
    """The environment of a reader's shell at the clone's root: `.venv/bin` first, no API key set, offline,
    and the launcher the clone's `diffserve` runs its commands with."""
    env = {k: v for k, v in os.environ.items() if k not in ("DIFFSERVE_API_KEY", "OPENAI_BASE_URL")}
    env["PATH"] = f"{workdir / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["HF_HUB_OFFLINE"] = "1"
    return {**env, **launcher.environment()}


def _make_clone_like(workdir: Path, launcher: CommandLauncher) -> None:
    """Symlink the repo's top-level entries into `workdir`; what the blocks write stays there. `.venv` is a
    folder of links to the repo's, but for `.venv/bin/diffserve`: the launcher's script, which runs each
    command forked from this test process's preloaded interpreter (`diffserve.testing.command_launcher`;
    the installed entry point itself is run by tests/e2e/test_cli_generate.py)."""
    for entry in REPO.iterdir():
        if entry.name.startswith(".") or entry.name == "outputs":
            continue
        (workdir / entry.name).symlink_to(entry)
    venv, real_venv = workdir / ".venv", REPO / ".venv"
    (venv / "bin").mkdir(parents=True)
    for entry in real_venv.iterdir():
        if entry.name != "bin":
            (venv / entry.name).symlink_to(entry)
    for entry in (real_venv / "bin").iterdir():
        if entry.name != "diffserve":
            (venv / "bin" / entry.name).symlink_to(entry)
    launcher.install(venv / "bin")


def _refuse_stale_install(code: str, workdir: Path, env: dict[str, str]) -> None:
    """`make` would reinstall from the temporary clone (breaking the shared .venv) when its stamp is stale."""
    if not re.search(r"^\s*make\b", code, re.MULTILINE):
        return
    stale = subprocess.run(["make", "-q", ".venv/.diffserve-runtime"], cwd=workdir, env=env).returncode != 0
    if stale:
        pytest.skip("the .venv's install stamp is older than pyproject.toml: run `make install` first")


@pytest.fixture(scope="session")
def docs_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerPool]:
    with CommandLauncher(cli_main) as launcher:
        pool = ServerPool.for_documents(DOCUMENTS, tmp_path_factory.mktemp("docs-servers"), launcher)
        try:
            yield pool
        finally:
            pool.stop_all()


@pytest.fixture
def reader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, docs_servers: ServerPool) -> Iterator[Reader]:
    monkeypatch.chdir(tmp_path)  # python blocks open relative paths, as in the reader's session
    for name in ("DIFFSERVE_API_KEY", "OPENAI_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    reader = Reader(tmp_path, docs_servers)
    try:
        yield reader
    finally:
        reader.close()


def documents_with_blocks(documents: tuple[Path, ...]) -> list[Path]:
    return [doc for doc in documents if parse_blocks(doc.read_text(), doc.name)]


def run_document(document: Path, reader: Reader) -> None:
    blocks = parse_blocks(document.read_text(), str(document.relative_to(REPO)))
    for block in blocks:
        reader.run(block)


# Every document in one file, so that one test worker runs them all and their servers are shared.
@pytest.mark.parametrize("document", documents_with_blocks(DOCUMENTS), ids=lambda doc: doc.name)
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


def test_server_blocks_split_into_setup_and_one_shareable_serve_line() -> None:
    setup = "diffserve make-tiny wan-t2v /tmp/tiny-wan\n"
    serve = "diffserve serve --model-path /tmp/tiny-wan --port 30000     # a comment\n"
    assert split_serve(setup + serve + "# trailing comment\n") == (setup.rstrip(), serve.rstrip())
    assert split_serve(serve) == ("", serve.rstrip())
    for unshared in (
        "cd /tmp\ndiffserve serve --port 30000",  # the setup changes what the serve line sees
        "MODEL=/tmp/m\ndiffserve serve --model-path $MODEL",
        "diffserve serve --port 30000 > log",
        "make-tiny x && diffserve serve",
        "diffserve serve \\\n  --port 30000",
        "diffserve generate --prompt x",
    ):
        assert split_serve(unshared) is None, unshared


def test_the_same_documented_server_is_the_same_command() -> None:
    """README's `.venv/bin/diffserve` and docs/'s `diffserve` (.venv/bin comes first on PATH), any port."""
    assert canonical_serve_command(".venv/bin/diffserve serve --port 30000   # the demo") == "diffserve serve"
    assert canonical_serve_command("diffserve serve --port=30001") == "diffserve serve"
    assert canonical_serve_command("OMP_NUM_THREADS=1 diffserve serve --lora a=/tmp/a.safetensors") == (
        "OMP_NUM_THREADS=1 diffserve serve --lora a=/tmp/a.safetensors"
    )
    assert canonical_serve_command(marker_server_block("--model-path /tmp/q")) == (
        "diffserve serve --model-path /tmp/q"
    )


def test_a_reused_server_needs_the_same_files(tmp_path: Path) -> None:
    """Two readers' servers of one documented command share a key when the files it names are the same."""
    with CommandLauncher(cli_main) as launcher:
        pool = ServerPool(tmp_path, Counter(), launcher)
        readers = []
        for name, weights in (("a", b"1"), ("b", b"1"), ("c", b"2")):
            (tmp_path / name).mkdir()
            reader = Reader(tmp_path / name, pool)
            (reader.tmp_root / "tiny").mkdir()
            (reader.tmp_root / "tiny" / "weights").write_bytes(weights)
            readers.append(reader)
        keys = [
            r._server_key(rewrite("diffserve serve --model-path /tmp/tiny", 1, r.tmp_root)) for r in readers
        ]
        assert keys[0] == keys[1] != keys[2]
        # A relative path to what the reader wrote resolves in the reader's directory only: never shared.
        assert readers[0]._server_key("diffserve serve --model-path tmp/tiny") is None
