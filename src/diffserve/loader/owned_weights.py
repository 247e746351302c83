"""Loaded weights live in memory the engine owns, never in the pages of their files (issue 31).

safetensors memory-maps the files it reads, and a tensor read from a mapping *is* the mapping: a
same-dtype `.to()` keeps it. A weight file overwritten in place (as `cp` does) would then change the
next image, and one truncated would kill the engine with SIGBUS on its next page fault. So:

- `open_safetensors` reads with `pread(2)` where safetensors can (>= 0.8: `backend="pread"`), into
  memory the process owns; older versions map the file, and `owned` copies what a cast did not;
- `detach_from_files` copies, after a load the engine does not drive itself (transformers'
  `from_pretrained`, which maps), every tensor of a module that still lies in a mapping of the files;
- `mapped_files` lists which of a set of files this process maps (/proc/self/maps), for the tests and
  the log;
- `read_only_reason` is the check the one deliberate exception makes: `--max-memory` keeps the DiT in
  its mapped files (`loader/mmap_weights.py`), only when nothing can rewrite them (a read-only
  filesystem, or files nobody has write permission on).
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

logger = logging.getLogger("diffserve.loader")

_MAPS = Path("/proc/self/maps")


def _probe_pread() -> bool:
    """Whether this safetensors reads with `pread` (`safe_open(..., backend="pread")`, safetensors 0.8):
    an older one refuses the keyword (TypeError) before it looks for the file."""
    try:
        safe_open("/nonexistent/diffserve-probe.safetensors", framework="pt", device="cpu", backend="pread")
    except TypeError:
        return False
    except Exception:  # noqa: BLE001 - the missing file: the keyword was accepted
        return True
    return True  # pragma: no cover


#: safetensors reads tensors into owned memory (`backend="pread"`): no copy is needed after a read.
READS_INTO_OWNED_MEMORY = _probe_pread()


def open_safetensors(path: str | os.PathLike[str]):  # noqa: ANN201 - safetensors' own type
    """`safe_open(path)` for the CPU, reading into owned memory where this safetensors can."""
    global READS_INTO_OWNED_MEMORY
    if READS_INTO_OWNED_MEMORY:
        try:
            return safe_open(str(path), framework="pt", device="cpu", backend="pread")
        except TypeError:  # an older safetensors after all: it maps, and `owned` copies
            READS_INTO_OWNED_MEMORY = False
    return safe_open(str(path), framework="pt", device="cpu")


def owned(tensor: torch.Tensor, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` on `device` in `dtype`, in memory of its own: a conversion copies anyway, and a tensor
    read from a mapped file (an old safetensors) is copied even when nothing converts it."""
    return tensor.to(device=device, dtype=dtype, copy=not READS_INTO_OWNED_MEMORY)


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _mapped_ranges(files: Iterable[Path]) -> dict[tuple[int, int], list[tuple[int, int]]] | None:
    """For each of `files` this process maps: (device, inode) -> the address ranges mapping it; None
    where /proc/self/maps cannot be read (not Linux)."""
    wanted = {ident: path for path in files if (ident := _identity(Path(path))) is not None}
    try:
        lines = _MAPS.read_text().splitlines()
    except OSError:
        return None
    found: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or fields[4] == "0":
            continue
        major, minor = (int(part, 16) for part in fields[3].split(":"))
        ident = (os.makedev(major, minor), int(fields[4]))
        if ident in wanted:
            start, end = (int(part, 16) for part in fields[0].split("-"))
            found.setdefault(ident, []).append((start, end))
    return found


def mapped_files(files: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """Those of `files` that this process has memory-mapped now (read from /proc/self/maps; empty where
    it cannot be read)."""
    paths = [Path(f) for f in files]
    ranges = _mapped_ranges(paths) or {}
    return [p for p in paths if _identity(p) in ranges]


def detach_from_files(module: nn.Module, files: Iterable[str | os.PathLike[str]]) -> int:
    """Copy into owned memory every CPU parameter and buffer of `module` that lies in a mapping of one
    of `files` (a tied tensor once, keeping the tie); returns the bytes copied. Where the mappings
    cannot be read (no /proc), every CPU tensor is copied: the same guarantee, paid in full."""
    paths = [Path(f) for f in files]
    by_file = _mapped_ranges(paths)
    ranges = None if by_file is None else [r for rs in by_file.values() for r in rs]
    if ranges == []:
        return 0
    copied = 0
    seen: set[int] = set()
    tensors = [*module.parameters(), *module.buffers()]
    for tensor in tensors:
        if id(tensor) in seen or tensor.device.type != "cpu" or tensor.numel() == 0:
            continue
        seen.add(id(tensor))
        address = tensor.data_ptr()
        if ranges is not None and not any(start <= address < end for start, end in ranges):
            continue
        tensor.data = tensor.data.clone()
        copied += tensor.numel() * tensor.element_size()
    if copied:
        logger.debug("copied %.1f MB of weights out of their mapped files", copied / 2**20)
    return copied


def read_only_reason(path: Path) -> str | None:
    """Why nothing can rewrite `path` while it is mapped (it is on a read-only filesystem, or no one
    has write permission on it), or None when it is writable."""
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return "on a read-only filesystem"
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if not mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH):
        return f"mode {stat.S_IMODE(mode):04o}, no write permission"
    return None
