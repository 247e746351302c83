"""A `diffserve` executable for shells a test starts (the documents' bash blocks) that runs each command
forked from the test process's preloaded fork server (`diffserve.testing.preloaded`) instead of in a new
interpreter: a command starts in a fraction of a second instead of importing torch and transformers again.

`CommandLauncher` listens on a Unix socket in a private folder; `install(bin_dir)` writes the small
`diffserve` script there (standard library only, no site packages). The script sends the launcher its
arguments, environment, working directory and standard streams (the descriptors themselves, SCM_RIGHTS),
and the launcher starts `diffserve.cli.main.main` with them in a fork (`preloaded.start_command`),
answers the command's pid, and its exit code once it has exited. The script forwards SIGTERM, SIGINT,
SIGHUP and SIGQUIT to the command and exits as the command did (killed by the same signal, or with its
code); if the script itself dies (SIGKILL), the launcher stops the command. To the shell, the script is
the command.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing.connection
import os
import shutil
import socket
import sys
import tempfile
import threading
from pathlib import Path
from types import TracebackType

from diffserve.testing.preloaded import CommandMain, start_command

#: The variable that tells the script where the launcher listens.
ADDRESS_ENV = "DIFFSERVE_TEST_LAUNCHER"
#: Largest request (arguments, environment, working directory) the launcher reads.
MAX_REQUEST_BYTES = 1 << 20
#: Seconds a command whose script died gets to exit after SIGTERM, before SIGKILL.
ORPHAN_TERMINATE_S = 10.0

SCRIPT = """#!{python} -S
# diffserve, as run by {module}: the command runs in a fork of the test's preloaded interpreter.
import json, os, signal, socket, sys

link = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
link.connect(os.environ["{address_env}"])
request = {{"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd()}}
socket.send_fds(link, [json.dumps(request).encode()], [0, 1, 2])
pid = json.loads(link.recv(4096))["pid"]
for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
    signal.signal(number, lambda number, frame: os.kill(pid, number))
code = json.loads(link.recv(4096))["exit"]
if code < 0:
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
"""


class CommandLauncher:
    """The launcher's socket and the threads that serve it; a context manager (`close` on leaving: no new
    command starts, the running ones finish or are stopped by their scripts)."""

    def __init__(self, main: CommandMain) -> None:
        self.main = main
        self._folder = Path(tempfile.mkdtemp(prefix="diffserve-launcher-"))  # 0700: only this user connects
        self.address = str(self._folder / "socket")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._listener.bind(self.address)
        self._listener.listen(16)
        threading.Thread(target=self._accept, name="diffserve-launcher", daemon=True).start()

    def install(self, bin_dir: Path) -> Path:
        """Write the `diffserve` script into `bin_dir` (it must not exist there yet); its path."""
        script = bin_dir / "diffserve"
        text = SCRIPT.format(python=sys.executable, module=__name__, address_env=ADDRESS_ENV)
        with open(script, "x") as file:
            file.write(text)
        script.chmod(0o755)
        return script

    def environment(self) -> dict[str, str]:
        """What the script's environment must add."""
        return {ADDRESS_ENV: self.address}

    def close(self) -> None:
        self._listener.close()
        shutil.rmtree(self._folder, ignore_errors=True)

    def __enter__(self) -> CommandLauncher:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    def _accept(self) -> None:
        while True:
            try:
                link, _ = self._listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(link,), name="diffserve-launched", daemon=True).start()

    def _serve(self, link: socket.socket) -> None:
        """One script: start its command, answer the pid, then its exit code (or stop the command when
        the script is gone first)."""
        with link:
            message, fds, _, _ = socket.recv_fds(link, MAX_REQUEST_BYTES, 3)
            try:
                request = json.loads(message)
                command = start_command(
                    self.main, request["argv"], env=request["env"], stdio=(fds[0], fds[1], fds[2]),
                    cwd=request["cwd"],
                )  # fmt: skip
            finally:
                for fd in fds:
                    os.close(fd)
            link.sendall(json.dumps({"pid": command.pid}).encode())
            sentinel = command.sentinel
            ready = multiprocessing.connection.wait([sentinel, link])
            if sentinel not in ready:  # the script ended (it never sends again): its command follows
                command.stop(ORPHAN_TERMINATE_S)
            with contextlib.suppress(OSError):  # the script is gone
                link.sendall(json.dumps({"exit": command.wait()}).encode())
