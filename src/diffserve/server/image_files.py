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
from collections.abc import Callable
from pathlib import Path

from diffserve.outputs import CONTENT_TYPES, partial_path

logger = logging.getLogger("diffserve.server")

#: Image ids are `{request id (32 hex)}-{index}` (matched with `fullmatch`: `$` accepts a trailing "\n").
IMAGE_ID_PATTERN = re.compile(r"[0-9a-f]{32}-[0-9]{1,2}")

SWEEP_INTERVAL_MAX_S = 60.0  # longest pause between sweeps (a short TTL is swept every quarter of it)


def is_image_id(image_id: str) -> bool:
    return IMAGE_ID_PATTERN.fullmatch(image_id) is not None


def image_path(output_dir: Path, image_id: str, output_format: str) -> Path:
    """Where the url file of `image_id` in `output_format` lives."""
    return output_dir / f"{image_id}.{output_format}"


def find_image(output_dir: Path, image_id: str, ttl: float | None = None) -> Path | None:
    """The stored file of `image_id` (any format), or None for an ill-formed id; with `ttl`, an older
    file is deleted now and does not match."""
    if not is_image_id(image_id):
        return None
    for output_format in CONTENT_TYPES:
        path = image_path(output_dir, image_id, output_format)
        if path.is_file():
            try:
                expired = ttl is not None and path.stat().st_mtime + ttl <= time.time()
            except FileNotFoundError:
                return None
            if expired:
                path.unlink(missing_ok=True)
                return None
            return path
    return None


def _url_image_name(name: str) -> bool:
    """`{image id}.{format}`: the name of a url file (nothing else in the output dir is touched)."""
    stem, dot, suffix = name.rpartition(".")
    return bool(dot) and suffix in CONTENT_TYPES and is_image_id(stem)


def _delete_files(output_dir: Path, doomed: Callable[[os.DirEntry], bool]) -> int:
    """Delete the regular files of `output_dir` that `doomed` picks; returns how many."""
    removed = 0
    try:
        with os.scandir(output_dir) as entries:
            for entry in entries:
                try:
                    if entry.is_file(follow_symlinks=False) and doomed(entry):
                        os.unlink(entry.path)
                        removed += 1
                except FileNotFoundError:
                    continue
    except (FileNotFoundError, NotADirectoryError):
        pass
    return removed


def expire_images(output_dir: Path, ttl: float, now: float | None = None) -> int:
    """Delete the url files written more than `ttl` seconds before `now`; returns how many."""
    cutoff = (time.time() if now is None else now) - ttl

    def expired(entry: os.DirEntry) -> bool:
        return _url_image_name(entry.name) and entry.stat(follow_symlinks=False).st_mtime <= cutoff

    removed = _delete_files(output_dir, expired)
    if removed:
        logger.info("Deleted %d expired url image(s) (--job-ttl %g s)", removed, ttl)
    return removed


def remove_partial_images(output_dir: Path) -> int:
    """Delete the half-written url files (`partial_path`) a previous server left (at start-up, before
    the engine writes); returns how many."""

    def is_partial(entry: os.DirEntry) -> bool:
        final = entry.name[1 : -len(".partial")]
        return _url_image_name(final) and partial_path(Path(final)).name == entry.name

    removed = _delete_files(output_dir, is_partial)
    if removed:
        logger.info("Deleted %d half-written url image file(s) left by a previous server", removed)
    return removed


def sweep_interval(ttl: float) -> float:
    return min(SWEEP_INTERVAL_MAX_S, max(0.5, ttl / 4))


async def sweep_images(output_dir: Path, ttl: float) -> None:
    """Until cancelled: delete expired url files every `sweep_interval(ttl)` seconds."""
    while True:
        await asyncio.sleep(sweep_interval(ttl))
        try:
            await asyncio.to_thread(expire_images, output_dir, ttl)
        except Exception:
            logger.exception("Could not delete expired url images")
