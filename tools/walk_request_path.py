"""Walk a request's path through diffserve, file by file, as the calls really go.

docs/architecture.md's section "A request's path: `POST /v1/images/generations` to PNG bytes" lists the
files one image request runs, in the order of their first call, and counts them (issue 30: walk it, count
it, and make the count small by design rather than by leaving files out). This script re-makes that walk,
so that the list can be checked (tests/unit/test_request_path_walk.py) and re-made when the code moves:

- ``--path server``: builds a tiny FLUX.1 folder (`build_tiny_flux`, what `diffserve make-tiny flux`
  writes), starts `diffserve serve --model-path <it> --no-warmup` with a profiling hook in *both* of its
  processes (the front end and the engine process it spawns), sends one request,
  ``{"prompt": "a red fox", "size": "32x32", "num_inference_steps": 2}`` (b64_json, not streamed, no LoRA,
  default quality), and prints, per process, every file of ``src/diffserve`` called while the request ran,
  in the order of its first call. The hook is a ``sitecustomize`` on the server's ``PYTHONPATH`` (spawned
  processes import it too), enabled by an environment variable: it installs ``sys.setprofile`` and
  ``threading.setprofile``, and a thread of its own polls a folder for the marks that open and close a
  recording window, so that neither the marks nor the dump call into ``src/diffserve``. A first window
  with no request records what the server runs idle (its serve loop's wake-ups); a file of the request
  window all of whose functions that ran also run idle is flagged ``idle``: no part of the request. The
  files of both processes are also printed merged, in the order of their first call in either.
- ``--path generate``: the in-process path `diffserve generate` (and a Python caller) takes: the CLI's
  `run` on the same folder and request (``--height 32 --width 32 --num-inference-steps 2``), recorded from
  the call of `DiffGenerator.generate_many` to the return of `cli/generate.py: run` (loading the model is
  no part of a request), in this process.

Each file is printed with the thread and the function of its first call, and ``model`` where that call
ran inside a ``torch.nn.Module``'s call: a hint for the page's model-code list, which also counts the
DiT's and the VAE's own methods that the stages call directly (``AutoencoderKL.decode``, the DiT's RoPE
tables) and the VAE's helpers they call. ``--functions`` adds every function each file ran; ``--json``
prints one JSON object instead (``server``: the request's files of both processes merged, idle ones left
out; ``server_processes``: each process's own; ``generate``), what the test reads.

Run: ``.venv/bin/python tools/walk_request_path.py [--path server|generate|both] [--json] [--functions]``.
Only the standard library is imported at module level: the server's processes import this file from
their ``sitecustomize`` before anything else.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

#: The folder whose files are recorded (the package itself, wherever it is installed from).
SRC_ENV = "DIFFSERVE_WALK_SRC"
#: The folder the server's hooks watch for marks and write their records to; the hook is off without it.
DIR_ENV = "DIFFSERVE_WALK_DIR"
PROMPT = "a red fox"
SIZE = 32
STEPS = 2
#: How often the hook's own thread looks for a mark (seconds).
POLL_S = 0.02
#: How long the front end is given after the answer arrives (its middleware's log line, the metrics).
SETTLE_S = 0.5
#: torch's `Module._call_impl` (and `_wrapped_call_impl`): a call under one of these is model code.
_MODULE_CALLS = ("_call_impl", "_wrapped_call_impl")


@dataclass
class FileCall:
    """A file's first call in a recording window."""

    file: str  # relative to src/diffserve
    function: str
    thread: str
    model: bool  # the call ran inside a torch.nn.Module's call
    at: float  # when (time.time(): comparable across the server's processes)
    #: Everything the file ran in the request window also ran in the idle one (server path only).
    idle: bool = False
    #: Every function of the file that ran in the window, in the order of its first call.
    functions: list[str] = field(default_factory=list)


class Recorder:
    """A profile function that, while armed, records each file of `src`'s first call."""

    def __init__(self, src: str) -> None:
        self.src = src.rstrip(os.sep) + os.sep
        self.armed = False
        self.seen: set[CodeType] = set()
        self.files: dict[str, FileCall] = {}
        self.on_call: Callable[[FrameType], None] | None = None

    def arm(self) -> None:
        self.seen, self.files = set(), {}
        self.armed = True

    def disarm(self) -> list[FileCall]:
        self.armed = False
        return list(self.files.values())  # in the order of their first call

    def profile(self, frame: FrameType, event: str, arg: object) -> None:
        if event != "call":
            return
        if self.on_call is not None:
            self.on_call(frame)
        if not self.armed:
            return
        code = frame.f_code
        if code in self.seen:
            return
        self.seen.add(code)
        if not code.co_filename.startswith(self.src):
            return
        function = getattr(code, "co_qualname", code.co_name)
        file = code.co_filename[len(self.src) :].replace(os.sep, "/")
        known = self.files.get(file)
        if known is None:
            thread = threading.current_thread().name
            self.files[file] = FileCall(
                file, function, thread, _inside_module_call(frame), time.time(), functions=[function]
            )
        elif function not in known.functions:
            known.functions.append(function)

    def install(self) -> None:
        sys.setprofile(self.profile)
        threading.setprofile(self.profile)

    @staticmethod
    def uninstall() -> None:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]


def _inside_module_call(frame: FrameType | None) -> bool:
    while frame is not None:
        code = frame.f_code
        if code.co_name in _MODULE_CALLS and code.co_filename.endswith(
            os.path.join("nn", "modules", "module.py")
        ):
            return True
        frame = frame.f_back
    return False


# --- the server's hook: imported by the sitecustomize this script writes -------------------------------


def install_from_env() -> None:
    """In a server process (front end, engine, or a helper process multiprocessing starts): when
    `DIR_ENV` is set, install the profile hook and start the thread that watches for marks. Window `n`
    opens when the file ``arm-<n>`` appears (answered by ``armed-<n>-<pid>``) and closes when ``dump-<n>``
    does (answered by ``files-<n>-<pid>.json``)."""
    folder = os.environ.get(DIR_ENV)
    src = os.environ.get(SRC_ENV)
    if not folder or not src:
        return
    recorder = Recorder(src)
    recorder.install()
    thread = threading.Thread(target=_watch, args=(recorder, Path(folder)), name="walk-hook", daemon=True)
    thread.start()


def _watch(recorder: Recorder, folder: Path) -> None:
    sys.setprofile(None)  # this thread's own calls are not the request's
    pid = os.getpid()
    window = 1
    while True:
        if not recorder.armed and (folder / f"arm-{window}").exists():
            recorder.arm()
            (folder / f"armed-{window}-{pid}").write_text("")
        elif recorder.armed and (folder / f"dump-{window}").exists():
            calls = recorder.disarm()
            import multiprocessing  # the process's name, set by whoever started it

            record = {
                "pid": pid,
                "process": multiprocessing.current_process().name,
                "argv": sys.argv,
                "calls": [asdict(call) for call in calls],
            }
            path = folder / f"files-{window}-{pid}.json"
            path.with_suffix(".tmp").write_text(json.dumps(record))
            path.with_suffix(".tmp").rename(path)
            window += 1
        time.sleep(POLL_S)


# --- the server path --------------------------------------------------------------------------------


def _wait_until(check: Callable[[], bool], timeout_s: float, what: str, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if server.poll() is not None:
            raise RuntimeError(f"the server exited ({server.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout_s:.0f} s")
        time.sleep(POLL_S)


def _http(url: str, body: dict[str, Any] | None = None, timeout_s: float = 120.0) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if body is not None else {}
    request = urllib.request.Request(
        url, data=data, headers=headers, method="GET" if body is None else "POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return 0, b""


def _record_window(
    folder: Path, window: int, server: subprocess.Popen, during: Callable[[], None]
) -> list[dict]:
    """Open window `window` in every hooked process, run `during`, close it; the processes' records."""
    _drop_exited(folder)
    hooked = lambda: {p.name.split("-", 1)[1] for p in folder.glob("alive-*")}  # noqa: E731
    (folder / f"arm-{window}").write_text("")
    armed = lambda: all((folder / f"armed-{window}-{pid}").exists() for pid in hooked())  # noqa: E731
    _wait_until(armed, 10, "the hooks' arm answers", server)
    during()
    (folder / f"dump-{window}").write_text("")
    dumped = lambda: all((folder / f"files-{window}-{pid}.json").exists() for pid in hooked())  # noqa: E731
    _wait_until(dumped, 10, "the hooks' records", server)
    return [json.loads((folder / f"files-{window}-{pid}.json").read_text()) for pid in sorted(hooked())]


SITECUSTOMIZE = """\
import importlib.util, os, pathlib, sys
_folder = os.environ.get({dir_env!r})
if _folder:
    _spec = importlib.util.spec_from_file_location("_diffserve_walk_hook", {tool!r})
    _module = sys.modules["_diffserve_walk_hook"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
    _module.install_from_env()
    pathlib.Path(_folder, "alive-%d" % os.getpid()).write_text("")
"""


def walk_server(work: Path, folder: Path, src: Path, timeout_s: float = 300.0) -> dict[str, list[FileCall]]:
    """The server walk: the files each of `diffserve serve`'s processes ran for one request, keyed by
    process ('front end', then each other process by its multiprocessing name)."""
    hook_dir, marks = work / "hook", work / "marks"
    hook_dir.mkdir()
    marks.mkdir()
    # Each process that imports the hook writes alive-<pid>; every one still running answers each mark.
    (hook_dir / "sitecustomize.py").write_text(
        SITECUSTOMIZE.format(dir_env=DIR_ENV, tool=str(Path(__file__)))
    )
    from diffserve.testing.ports import unassigned_port  # not at module level: see the module docstring

    port = unassigned_port()  # below the ephemeral range the suite's other listeners draw from
    env = dict(os.environ)
    env.update({DIR_ENV: str(marks), SRC_ENV: str(src), "DIFFSERVE_START_METHOD": "spawn"})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hook_dir), env.get("PYTHONPATH")]))
    command = [
        sys.executable, "-m", "diffserve.cli.main", "serve", "--model-path", str(folder), "--no-warmup",
        "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
    ]  # fmt: skip
    log = (work / "server.log").open("wb")
    server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=work)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_until(lambda: _http(f"{base}/health", timeout_s=5)[0] == 200, timeout_s, "ready server", server)
        idle = _record_window(marks, 1, server, lambda: time.sleep(1.0))
        answers: list[tuple[int, bytes]] = []

        def request() -> None:
            body = {"prompt": PROMPT, "size": f"{SIZE}x{SIZE}", "num_inference_steps": STEPS}
            answers.append(_http(f"{base}/v1/images/generations", body))
            time.sleep(SETTLE_S)

        records = _record_window(marks, 2, server, request)
        status, payload = answers[0]
        if status != 200 or not json.loads(payload)["data"][0].get("b64_json"):
            raise RuntimeError(f"the request failed: {status} {payload[:500]!r}")
    except BaseException:
        sys.stderr.write((work / "server.log").read_text(errors="replace")[-4000:])
        raise
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
    idle_functions: dict[str, set[str]] = {}
    for record in idle:
        for call in record["calls"]:
            idle_functions.setdefault(call["file"], set()).update(call["functions"])
    walked: dict[str, list[FileCall]] = {}
    for record in records:
        calls = [FileCall(**call) for call in record["calls"]]
        if not calls:
            continue
        for call in calls:
            call.idle = set(call.functions) <= idle_functions.get(call.file, set())
        name = "front end" if record["pid"] == server.pid else record["process"]
        walked[name] = calls
    return walked


def _drop_exited(marks: Path) -> None:
    for alive in marks.glob("alive-*"):
        pid = int(alive.name.split("-", 1)[1])
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            alive.unlink()


# --- the in-process path ----------------------------------------------------------------------------


def walk_generate(work: Path, folder: Path, src: Path) -> list[FileCall]:
    """The in-process walk: `diffserve generate`'s `run` on `folder`, recorded from the call of
    `DiffGenerator.generate_many` to `run`'s return."""
    from diffserve.api import DiffGenerator
    from diffserve.cli import generate
    from diffserve.cli.main import main

    start, end = DiffGenerator.generate_many.__code__, generate.run.__code__
    recorder = Recorder(str(src))
    calls: list[FileCall] = []

    def mark(frame: FrameType) -> None:
        if frame.f_code is start and not recorder.armed and not calls:
            recorder.arm()

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event == "return" and frame.f_code is end and recorder.armed:
            calls.extend(recorder.disarm())
            return
        recorder.profile(frame, event, arg)

    recorder.on_call = mark
    argv = [
        "generate", "--model-path", str(folder), "--prompt", PROMPT, "--height", str(SIZE), "--width", str(SIZE),
        "--num-inference-steps", str(STEPS), "--seed", "0", "--output-path", str(work / "out"),
        "--log-level", "warning",
    ]  # fmt: skip
    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        code = main(argv)
    finally:
        Recorder.uninstall()
    if code != 0:
        raise RuntimeError(f"diffserve generate exited with {code}")
    if not list((work / "out").glob("*.png")):
        raise RuntimeError("diffserve generate wrote no PNG")
    return calls


# --- output -----------------------------------------------------------------------------------------


def request_files(server: dict[str, list[FileCall]]) -> list[FileCall]:
    """The server walk's files of the request, both processes merged: each file once, at its first call
    in either process (its thread named with its process), idle wake-ups left out."""
    first: dict[str, FileCall] = {}
    for process, calls in server.items():
        for call in calls:
            if call.idle:
                continue
            known = first.get(call.file)
            if known is None or call.at < known.at:
                first[call.file] = replace(call, thread=f"{process}: {call.thread}")
    return sorted(first.values(), key=lambda call: call.at)


def _print_calls(title: str, calls: list[FileCall], functions: bool) -> None:
    model = sum(call.model for call in calls)
    print(f"## {title}: {len(calls)} files ({model} of them first called inside a torch module)")
    for number, call in enumerate(calls):
        flags = " ".join(flag for flag, on in (("model", call.model), ("idle", call.idle)) if on)
        print(f"{number:3d}  {call.file:42s} {call.thread:36s} {call.function}  {flags}".rstrip())
        if functions:
            print(f"{'':5s}{', '.join(call.functions)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", choices=("server", "generate", "both"), default="both")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the lists")
    parser.add_argument("--functions", action="store_true", help="also print every function each file ran")
    args = parser.parse_args(argv)
    import diffserve
    from diffserve.families.flux.tiny import build_tiny_flux

    src = Path(diffserve.__file__).resolve().parent
    server: dict[str, list[FileCall]] | None = None
    generate: list[FileCall] | None = None
    with tempfile.TemporaryDirectory(prefix="diffserve-walk-") as tmp:
        work = Path(tmp)
        folder = build_tiny_flux(work / "tiny-flux")
        if args.path in ("server", "both"):
            (work / "server").mkdir()
            server = walk_server(work / "server", folder, src)
        if args.path in ("generate", "both"):
            (work / "generate").mkdir()
            generate = walk_generate(work / "generate", folder, src)
    if args.json:
        out: dict[str, Any] = {}
        if server is not None:
            out["server"] = [asdict(call) for call in request_files(server)]
            out["server_processes"] = {name: [asdict(c) for c in calls] for name, calls in server.items()}
        if generate is not None:
            out["generate"] = [asdict(call) for call in generate]
        print(json.dumps(out, indent=1))
        return 0
    if server is not None:
        for name, calls in server.items():
            _print_calls(f"server, process {name!r}", calls, args.functions)
        _print_calls(
            "server, the request's files (both processes, idle left out)", request_files(server), False
        )
    if generate is not None:
        _print_calls("generate_many (diffserve generate)", generate, args.functions)
    return 0


if __name__ == "__main__":
    sys.exit(main())
