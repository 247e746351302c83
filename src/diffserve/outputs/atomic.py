"""Atomic file writes: content goes to a hidden `.{name}.partial` sibling, renamed onto the final name only
once complete, so a watcher of the output directory (or an HTTP client fetching a url) never sees a
truncated file, and a failed write leaves nothing behind."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def partial_path(path: Path) -> Path:
    """The hidden sibling `path` is written to before it is complete (cleanup code deletes it too)."""
    return path.with_name(f".{path.name}.partial")


def write_atomically(path: Path, write: Callable[[Path], None]) -> Path:
    """Call `write(partial)` to produce the file, then move it onto `path`; returns `path`.

    Creates the parent directory. Any failure, including an interrupt or a failed rename, deletes the
    partial file (an existing file at `path` is then left as it was) and re-raises.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = partial_path(path)
    try:
        write(partial)
        os.replace(partial, path)
    except BaseException:
        # BaseException too: a cancelled or interrupted write must not leave a partial file either.
        partial.unlink(missing_ok=True)
        raise
    return path


def write_bytes_atomically(path: Path, data: bytes) -> Path:
    """Write `data` to `path` through a partial file (see `write_atomically`); returns `path`."""
    return write_atomically(path, lambda partial: partial.write_bytes(data))
