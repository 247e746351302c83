"""How diffserve starts its engine and rank processes (`diffserve.process_start`), and the suite's preloaded
launcher (`diffserve.testing.preloaded`): the start method is 'spawn' unless DIFFSERVE_START_METHOD says
'fork', a bad value is a clear error, a forked child drops its parent's signal handlers, and a command
forked from the preloaded server reports its exit code and output as a subprocess would."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import stat
import subprocess

import pytest

from diffserve.cli.main import main
from diffserve.errors import UserError
from diffserve.process_start import START_METHOD_ENV, forget_parent, process_context, start_method
from diffserve.testing.ports import unassigned_port
from diffserve.testing.preloaded import PRELOAD, start_logged_command


def test_spawn_is_the_default_and_fork_is_taken_when_named(monkeypatch) -> None:
    monkeypatch.delenv(START_METHOD_ENV, raising=False)
    assert start_method() == "spawn" and process_context().get_start_method() == "spawn"
    monkeypatch.setenv(START_METHOD_ENV, "fork")
    assert process_context().get_start_method() == "fork"
    monkeypatch.setenv(START_METHOD_ENV, "forkserver")
    assert process_context().get_start_method() == "forkserver"


def test_an_unknown_start_method_is_a_user_error_naming_the_variable(monkeypatch) -> None:
    monkeypatch.setenv(START_METHOD_ENV, "fork-server")
    with pytest.raises(
        UserError, match=r"DIFFSERVE_START_METHOD must be 'spawn', 'forkserver' or 'fork', got 'fork-server'"
    ):
        process_context()


def test_the_cli_refuses_an_unknown_start_method_in_one_error_line(monkeypatch, capsys) -> None:
    monkeypatch.setenv(START_METHOD_ENV, "threads")
    assert main(["make-tiny", "flux", "/nonexistent/never-written"]) == 2
    err = capsys.readouterr().err
    assert (
        err.strip() == "error: DIFFSERVE_START_METHOD must be 'spawn', 'forkserver' or 'fork', got 'threads'"
    )


def test_a_forked_child_drops_its_parents_handlers_and_sockets() -> None:
    """In a fork of a process with Python SIGTERM and SIGINT handlers, SIGUSR1 ignored, a socket and a pipe
    open: after `forget_parent`, SIGTERM is back to the default, SIGINT to Python's KeyboardInterrupt,
    SIGUSR1 still ignored, the socket's number points at /dev/null (a client of the parent's would otherwise
    never see its connection end) and the pipe is still the pipe. The test sets every handler it checks:
    what earlier tests of this worker left (Ray's driver installs its own) must not decide it."""
    checked = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
    previous = {number: signal.getsignal(number) for number in checked}
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.signal(signal.SIGINT, lambda *_: None)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    inherited, peer = socket.socketpair()
    read_end, write_end = os.pipe()
    try:
        pid = os.fork()
        if pid == 0:
            failed = 0b11111  # a bit per check below, cleared as each passes
            try:
                forget_parent()
                checks = (
                    signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
                    signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN,
                    signal.getsignal(signal.SIGINT) is signal.default_int_handler,
                    stat.S_ISCHR(os.fstat(inherited.fileno()).st_mode),
                    stat.S_ISFIFO(os.fstat(write_end).st_mode),
                )
                failed = sum(1 << i for i, ok in enumerate(checks) if not ok)
            finally:
                os._exit(failed)
        _, status = os.waitpid(pid, 0)
        failed = os.waitstatus_to_exitcode(status)
        names = (
            "SIGTERM default",
            "SIGUSR1 ignored",
            "SIGINT KeyboardInterrupt",
            "socket -> /dev/null",
            "pipe kept",
        )
        assert failed == 0, (
            f"the child's failed checks: {[n for i, n in enumerate(names) if failed >> i & 1]} ({failed})"
        )
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        for end in (inherited, peer):
            end.close()
        for fd in (read_end, write_end):
            os.close(fd)


def test_every_preloaded_module_exists() -> None:
    """multiprocessing's fork server skips a preload module it cannot import, without a word."""
    assert [name for name in PRELOAD if importlib.util.find_spec(name) is None] == []


def test_a_preloaded_command_exits_as_a_subprocess_would(tmp_path) -> None:
    """A bad flag: exit code 2 and one `error:` line in the log; `wait` with a timeout on a finished command
    returns its code."""
    log = tmp_path / "log"
    command = start_logged_command(main, ["generate", "--no-such-flag"], env=dict(os.environ), log_path=log)
    assert command.wait(60) == 2 and command.returncode == 2 and command.poll() == 2
    assert "error:" in log.read_text()


def test_waiting_on_a_running_command_times_out_and_a_signal_ends_it(tiny_flux_dir, tmp_path) -> None:
    """A server (it runs until stopped): `wait(0.01)` raises TimeoutExpired, and SIGKILL ends it with -9, as
    `subprocess.Popen` reports it."""
    argv = ["serve", "--model-path", str(tiny_flux_dir), "--port", str(unassigned_port()), "--no-warmup"]
    command = start_logged_command(main, argv, env=dict(os.environ), log_path=tmp_path / "log")
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            command.wait(0.01)
        assert command.poll() is None
    finally:
        command.kill()
    assert command.wait(60) == -signal.SIGKILL
