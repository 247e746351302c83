"""Issue 31, item 20: a front end killed with SIGKILL left `/tmp/diffserve-0-XXXX` with its sockets; a later
start removes the folders of front ends that are gone, and never a running one's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from diffserve.server.ipc_dirs import OWNER_FILE, remove_stale_ipc_dirs


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_folders_of_dead_front_ends_are_removed_and_live_ones_kept(tmp_path: Path) -> None:
    stale, live, unmarked = (
        tmp_path / "diffserve-0-aaaa",
        tmp_path / "diffserve-1-bbbb",
        tmp_path / "diffserve-0-cc",
    )
    for directory in (stale, live, unmarked):
        directory.mkdir()
        (directory / "to_engine").write_text("")
    (stale / OWNER_FILE).write_text(str(_dead_pid()))
    (live / OWNER_FILE).write_text(str(os.getpid()))
    assert remove_stale_ipc_dirs(tmp_path) == [stale]
    assert not stale.exists() and live.exists() and unmarked.exists()
