"""The private folders of the front end's ZeroMQ IPC sockets (`/tmp/diffserve-<replica>-XXXX`): each records
the pid of the front end that made it, so that a later start removes the folders of front ends that died
without cleaning up (SIGKILL), and never one whose front end still runs."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger("diffserve.server")

PREFIX = "diffserve-"
OWNER_FILE = "owner.pid"


def make_ipc_dir(replica: int) -> Path:
    """A new private (0700) folder for one replica's sockets, marked with this process's pid."""
    directory = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{replica}-"))
    (directory / OWNER_FILE).write_text(str(os.getpid()))
    return directory


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive, not ours to judge
    return True


def remove_stale_ipc_dirs(root: Path | None = None) -> list[Path]:
    """Remove this user's socket folders under `root` (the temp folder) whose recorded front end is no
    longer running; folders without a pid record or of other users are left alone. Returns what it removed."""
    root = Path(tempfile.gettempdir()) if root is None else root
    removed = []
    for directory in root.glob(f"{PREFIX}*-*"):
        owner = directory / OWNER_FILE
        try:
            if not directory.is_dir() or directory.stat().st_uid != os.getuid() or not owner.is_file():
                continue
            pid = int(owner.read_text().strip() or "0")
        except (OSError, ValueError):
            continue
        if pid > 0 and not _alive(pid):
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(directory)
    if removed:
        logger.info("Removed %d socket folder(s) left by front ends that died: %s", len(removed), removed)
    return removed
