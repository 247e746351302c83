"""`StepCachePolicy`: diffserve's own step cache, the quality tiers' original method ("stepcache").

A quality tier is a preset: a cache method by name with its settings (`configs/quality.py`), or this
policy, which the tiers ran before they could name a method and which calibration files of format 2 record
(a threshold per tier). It stays a candidate of `diffserve calibrate-cache`, so a calibrated tier never
computes more blocks than this cache did at the same PSNR bar. It is not a `cache` a request can name.

Configuration only (no torch), so the CLI and the HTTP front end can read and validate tiers without
importing the model stack; the cache itself is `models/cache_methods/tier.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class StepCachePolicy:
    """When a request may reuse the blocks' residual instead of running them.

    `threshold`: reuse while the accumulated relative L1 change of the signal since the last full
    step stays below it (0 never reuses). `full_first_steps` / `full_last_steps`: steps always run in
    full at the start (the image's layout forms there) and at the end (fine detail). `max_reuse_in_a_row`:
    a full step is forced after this many reused ones, so the error cannot grow unchecked.
    """

    #: Its name in responses, logs and calibration files (like a cache method's).
    method: ClassVar[str] = "stepcache"

    threshold: float
    full_first_steps: int = 2
    full_last_steps: int = 1
    max_reuse_in_a_row: int = 4

    def __post_init__(self) -> None:
        if self.threshold < 0:
            raise ValueError(f"threshold must be >= 0, got {self.threshold}")
        if self.full_first_steps < 1 or self.full_last_steps < 0 or self.max_reuse_in_a_row < 1:
            raise ValueError(f"invalid step cache policy {self}")

    def to_dict(self) -> dict[str, float | int]:
        return {
            "threshold": self.threshold,
            "full_first_steps": self.full_first_steps,
            "full_last_steps": self.full_last_steps,
            "max_reuse_in_a_row": self.max_reuse_in_a_row,
        }
