"""One server per --output-path: the folder is locked for as long as the server runs.

Two servers on one folder would destroy each other's work: at start a server fails the jobs a previous
server left unfinished (`server_restarted`), deletes the files no completed job owns (the other's
`.partial` files included) and applies its --job-ttl to every file. So `serve` takes an exclusive
`fcntl` lock on `<output path>/.diffserve-server.lock` before anything touches the folder, writes its
pid into it, and holds it until the process exits (the kernel releases it even after SIGKILL). A second
server finds it locked and stops with one error naming the first one's pid.

The lock file is never deleted: deleting it would let a server that opened the old file and a server
that created a new one both hold "the" lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from pathlib import Path

from diffserve.errors import UserError

LOCK_NAME = ".diffserve-server.lock"


class OutputDirLock:
    """The lock of one output folder, held by this process from `acquire` until `release` (or exit)."""

    def __init__(self, folder: Path, fd: int) -> None:
        self.folder, self._fd = folder, fd

    @property
    def path(self) -> Path:
        return self.folder / LOCK_NAME

    @classmethod
    def acquire(cls, folder: Path) -> OutputDirLock:
        """Create `folder` if needed and lock it; UserError when it cannot be created or written, or when
        another server holds it (naming that server's pid)."""
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise UserError(f"--output-path {str(folder)!r} cannot be used: {exc.strerror or exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_pid(fd)
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise UserError(
                    f"--output-path {str(folder)!r} cannot be locked: {exc.strerror or exc}"
                ) from None
            who = f"another diffserve server (pid {holder})" if holder else "another diffserve server"
            raise UserError(
                f"--output-path {str(folder)!r} is in use by {who}: two servers on one folder would delete "
                "each other's jobs and files; give this server its own --output-path, or stop the other one"
            ) from None
        pid = f"{os.getpid()}\n".encode()
        os.pwrite(fd, pid, 0)  # then cut what a longer pid left: a reader never sees an empty file
        os.ftruncate(fd, len(pid))
        return cls(folder, fd)

    def release(self) -> None:
        """Unlock (the file stays; see the module docstring). Idempotent."""
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = -1


def _read_pid(fd: int) -> int | None:
    """The pid the holder wrote, if it is readable."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
