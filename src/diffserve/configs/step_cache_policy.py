"""`StepCachePolicy`: when an approximate-quality request may reuse the DiT blocks' residual.

Configuration only (no torch), so the CLI and the HTTP front end can read and validate tiers without
importing the model stack; the cache itself is `models/step_cache.py`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepCachePolicy:
    """When a request may reuse the blocks' residual instead of running them.

    `threshold`: reuse while the accumulated relative L1 change of the signal since the last full
    step stays below it (0 never reuses). `full_first_steps` / `full_last_steps`: steps always run in
    full at the start (the image's layout forms there) and at the end (fine detail). `max_reuse_in_a_row`:
    a full step is forced after this many reused ones, so the error cannot grow unchecked.
    """

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
