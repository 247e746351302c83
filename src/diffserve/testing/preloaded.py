"""Processes forked from a preloaded interpreter (tests, benchmarks): gloo ranks, and `diffserve` commands
such as `diffserve serve`.

Starting a Python process that imports torch and transformers costs about 4.5 s of one core on a small
machine, and the suite starts hundreds (servers, their engines, rank processes): most of a tiny test's time.
multiprocessing's fork server is a fresh interpreter, started once per calling process, that imports
`PRELOAD` once and then forks every process asked of it: nothing leaks from the caller (as with 'spawn'),
and a child starts in a fraction of a second. A child sees the environment the fork server started with;
`start_command` hands it the caller's.

`start_command(main, argv, env=..., stdio=...)` runs `diffserve <argv>` (`main`: the CLI's) in such a
child, on the caller's standard streams (`start_logged_command`: its output appended to a log file), with
`DIFFSERVE_START_METHOD=fork` (`diffserve.process_start`) so that the engine and rank processes the
command starts are forks of it too, and returns a `PreloadedCommand`: the part of
`subprocess.Popen`'s interface the tests use (`pid`, `poll`, `wait`, `returncode`, `send_signal`,
`terminate`, `kill`). A command still running when the calling process exits is terminated, then killed.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from multiprocessing import reduction
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Protocol

from diffserve.process_start import FORKSERVER_PRELOAD, START_METHOD_ENV

#: Modules the fork server imports once, before it forks: the heavy imports of the rank code, of the
#: `diffserve` commands (CLI, server front end) and of the engine. The OpenMP wait policy goes first
#: (`diffserve.openmp_env`: it must be set before torch loads).
PRELOAD = (
    *FORKSERVER_PRELOAD,  # the same fork server serves DIFFSERVE_START_METHOD=forkserver in this process
    "torch.distributed",
    "transformers",
    "diffusers",
    "diffserve.testing.distributed",
    "diffserve.cli.main",
    "diffserve.server.runner",
    "diffserve.api",
)
#: A command's entry point: its arguments in, its exit code out.
CommandMain = Callable[[list[str]], int]


class DupFdHandle(Protocol):
    """What multiprocessing's `reduction.DupFd` gives a child: the descriptor, once detached."""

    def detach(self) -> int: ...


#: Seconds a command still running at exit gets to stop after SIGTERM, before SIGKILL.
EXIT_TERMINATE_S = 10.0


def preloaded_context() -> BaseContext:
    """multiprocessing's fork-server context, its server importing `PRELOAD` (one per calling process: the
    first start fixes the list, so every caller passes the same one)."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))
    return context


class PreloadedCommand:
    """A `diffserve` command running in a fork of the preloaded fork server, seen as `subprocess.Popen`
    sees its child: `returncode` None while it runs, else its exit code (-N: killed by signal N)."""

    def __init__(self, process: BaseProcess, args: Sequence[str]) -> None:
        self._process = process
        self.args = list(args)

    @property
    def pid(self) -> int:
        pid = self._process.pid
        assert pid is not None, "started in __init__'s caller"
        return pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    @property
    def sentinel(self) -> int:
        """A descriptor that becomes readable when the command exits (`multiprocessing.connection.wait`)."""
        return self._process.sentinel

    def wait(self, timeout: float | None = None) -> int:
        """The exit code, once the command has exited; `subprocess.TimeoutExpired` after `timeout` s."""
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, number: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, number)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def stop(self, timeout: float) -> int:
        """SIGTERM (a server drains and exits), SIGKILL if the command has not exited `timeout` s later;
        its exit code."""
        self.terminate()
        return self.wait_or_kill(timeout)

    def wait_or_kill(self, timeout: float) -> int:
        """Its exit code, within `timeout` s, else after SIGKILL. For a command already signalled: a second
        SIGTERM would make a server abort instead of draining."""
        try:
            return self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.wait()


_running: weakref.WeakSet[PreloadedCommand] = weakref.WeakSet()


def _stop_running_commands() -> None:
    """At exit: multiprocessing would wait for every child still running; stop them instead (all signalled
    first, so their drains overlap)."""
    left = [command for command in _running if command.poll() is None]
    for command in left:
        command.terminate()
    for command in left:
        command.wait_or_kill(EXIT_TERMINATE_S)


atexit.register(_stop_running_commands)


class _PassedFd:
    """A file descriptor given to a child of the fork server: pickled, it travels as the child's own
    duplicate (how multiprocessing passes sockets and connections), and unpickles to its number there."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Callable[[DupFdHandle], int], tuple[DupFdHandle]]:
        return _received_fd, (reduction.DupFd(self.fd),)


def _received_fd(handle: DupFdHandle) -> int:
    return handle.detach()


def start_command(
    main: CommandMain,
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    stdio: tuple[int, int, int],
    cwd: Path | str | None = None,
) -> PreloadedCommand:
    """`main(argv)` (`diffserve.cli.main.main`: `diffserve <argv>`; a module-level function, which travels
    by name) in a fork of the preloaded fork server, with `env` as its whole environment (plus
    `DIFFSERVE_START_METHOD=fork`), `stdio` (file descriptors of this process) as its standard input,
    output and error, and `cwd` (default: the caller's) as its working directory. The caller keeps its
    descriptors: the child has its own copies once this returns."""
    child_env = {**env, START_METHOD_ENV: "fork"}
    process = preloaded_context().Process(
        target=run_command,
        args=(main, list(argv), child_env, str(cwd or Path.cwd()), tuple(_PassedFd(fd) for fd in stdio)),
        name=f"diffserve-{argv[0] if argv else 'command'}",
    )
    process.start()
    command = PreloadedCommand(process, ["diffserve", *argv])
    _running.add(command)
    return command


def start_logged_command(
    main: CommandMain, argv: Sequence[str], *, env: Mapping[str, str], log_path: Path
) -> PreloadedCommand:
    """`start_command` with no standard input and the output and errors appended to `log_path`."""
    with open(os.devnull, "rb") as empty, open(log_path, "ab") as log:
        return start_command(main, argv, env=env, stdio=(empty.fileno(), log.fileno(), log.fileno()))


def run_command(
    main: CommandMain, argv: list[str], env: dict[str, str], cwd: str, stdio: tuple[int, int, int]
) -> None:
    """In the forked child: become the process a shell would have started for `diffserve <argv>` (its
    environment, working directory, standard streams, torch threads from OMP_NUM_THREADS, warning filters
    from PYTHONWARNINGS), then run the command; its exit code is this process's."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for target, fd in enumerate(stdio):
        os.dup2(fd, target)
    for fd in set(stdio) - {0, 1, 2}:
        os.close(fd)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 (multiprocessing left sys.stdin on /dev/null)
    if threads := env.get("OMP_NUM_THREADS"):
        import torch

        torch.set_num_threads(int(threads))  # torch read the fork server's environment when it loaded
    for option in filter(None, env.get("PYTHONWARNINGS", "").split(",")):
        if option != "ignore":
            raise ValueError(f"PYTHONWARNINGS={option!r}: only 'ignore' is applied to a preloaded command")
        warnings.simplefilter("ignore")
    sys.argv = ["diffserve", *argv]
    sys.exit(main(argv))
