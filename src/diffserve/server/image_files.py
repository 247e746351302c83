"""The files behind `response_format="url"`: one per image, `{output dir}/{image id}.{format}`, served by
`GET /v1/images/{image id}/content`. The bytes are written by `diffserve.outputs` (`save_image`, through a
hidden `.{name}.partial` sibling). A file is kept `--job-ttl` seconds (as video jobs are), then deleted:
`sweep_images` runs on the app's lifespan, and `remove_partial_images` clears half-written files at start."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

from diffserve.outputs import CONTENT_TYPES, partial_path

logger = logging.getLogger("diffserve.server")

#: Image ids are `{request id (32 hex)}-{index}`; anything else is refused before touching the disk.
#: Matched with `fullmatch` (`$` would accept a trailing newline).
IMAGE_ID_PATTERN = re.compile(r"[0-9a-f]{32}-[0-9]{1,2}")

#: Longest pause between two sweeps of expired url files (shorter TTLs are swept at a quarter of theirs).
SWEEP_INTERVAL_MAX_S = 60.0


def is_image_id(image_id: str) -> bool:
    return IMAGE_ID_PATTERN.fullmatch(image_id) is not None


def image_path(output_dir: Path, image_id: str, output_format: str) -> Path:
    """Where the url file of `image_id` in `output_format` lives."""
    return output_dir / f"{image_id}.{output_format}"


def _expired(path: Path, ttl: float, now: float) -> bool:
    try:
        return path.stat().st_mtime + ttl <= now
    except FileNotFoundError:
        return True


def find_image(output_dir: Path, image_id: str, ttl: float | None = None) -> Path | None:
    """The stored file of `image_id` (any format), or None. Ids that are not well-formed never match; with
    `ttl`, a file older than it is deleted now and does not match either."""
    if not is_image_id(image_id):
        return None
    for output_format in CONTENT_TYPES:
        path = image_path(output_dir, image_id, output_format)
        if path.is_file():
            if ttl is not None and _expired(path, ttl, time.time()):
                path.unlink(missing_ok=True)
                return None
            return path
    return None


def _entries(output_dir: Path) -> Iterator[os.DirEntry]:
    try:
        with os.scandir(output_dir) as entries:
            yield from entries
    except (FileNotFoundError, NotADirectoryError):
        return


def _url_image_name(name: str) -> bool:
    """`{image id}.{format}`: the name of a url file (nothing else in the output dir is touched)."""
    stem, dot, suffix = name.rpartition(".")
    return bool(dot) and suffix in CONTENT_TYPES and is_image_id(stem)


def expire_images(output_dir: Path, ttl: float, now: float | None = None) -> int:
    """Delete the url files written more than `ttl` seconds before `now`; returns how many."""
    cutoff = (time.time() if now is None else now) - ttl
    removed = 0
    for entry in _entries(output_dir):
        if not _url_image_name(entry.name):
            continue
        try:
            if entry.is_file(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_mtime <= cutoff:
                os.unlink(entry.path)
                removed += 1
        except FileNotFoundError:
            continue
    if removed:
        logger.info("Deleted %d expired url image(s) (--job-ttl %g s)", removed, ttl)
    return removed


def remove_partial_images(output_dir: Path) -> int:
    """Delete the half-written `.{image id}.{format}.partial` files a previous server left (start-up only:
    the engine is not writing yet); returns how many."""
    removed = 0
    for entry in _entries(output_dir):
        name = entry.name
        if not (name.startswith(".") and name.endswith(".partial")):
            continue
        final = name[1 : -len(".partial")]
        if not _url_image_name(final) or partial_path(Path(entry.path).with_name(final)).name != name:
            continue
        try:
            if entry.is_file(follow_symlinks=False):
                os.unlink(entry.path)
                removed += 1
        except FileNotFoundError:
            continue
    if removed:
        logger.info("Deleted %d half-written url image file(s) left by a previous server", removed)
    return removed


def sweep_interval(ttl: float) -> float:
    return min(SWEEP_INTERVAL_MAX_S, max(0.5, ttl / 4))


async def sweep_images(output_dir: Path, ttl: float) -> None:
    """Forever (until cancelled): delete expired url files every `sweep_interval(ttl)` seconds."""
    interval = sweep_interval(ttl)
    while True:
        await asyncio.sleep(interval)
        try:
            await asyncio.to_thread(expire_images, output_dir, ttl)
        except Exception:
            logger.exception("Could not delete expired url images")
