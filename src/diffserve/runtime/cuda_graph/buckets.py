"""The shapes breakable CUDA graphs are captured for: a batch bucket (DiT rows, CFG branches included) and,
for families whose prompt length varies, a token bucket (text tokens). A call is padded up to the smallest
bucket that holds it (`runtime/cuda_graph/padders.py`); a call larger than the largest bucket runs eager
(logged), as SGLang's breakable CUDA graphs do with an over-limit prompt."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: DiT rows a step may batch (the engine batches requests x CFG branches); more runs eager.
DEFAULT_BATCH_BUCKETS: tuple[int, ...] = (1, 2, 4, 8)
#: Text tokens of a family whose prompt length varies (Qwen-Image: 1 to ~1024); longer runs eager.
DEFAULT_TOKEN_BUCKETS: tuple[int, ...] = (64, 128, 256, 512, 1024)


def _checked(name: str, values: Sequence[int]) -> tuple[int, ...]:
    buckets = tuple(int(v) for v in values)
    if not buckets or any(b < 1 for b in buckets) or list(buckets) != sorted(set(buckets)):
        raise ValueError(f"{name} must be increasing positive sizes, got {list(values)}")
    return buckets


@dataclass(frozen=True)
class Buckets:
    """The batch and token buckets, each increasing."""

    batch: tuple[int, ...] = DEFAULT_BATCH_BUCKETS
    tokens: tuple[int, ...] = DEFAULT_TOKEN_BUCKETS

    def __post_init__(self) -> None:
        object.__setattr__(self, "batch", _checked("batch buckets", self.batch))
        object.__setattr__(self, "tokens", _checked("token buckets", self.tokens))

    def batch_bucket(self, rows: int) -> int | None:
        """The smallest batch bucket holding `rows`, or None when none does."""
        return next((b for b in self.batch if b >= rows), None)

    def token_bucket(self, tokens: int) -> int | None:
        """The smallest token bucket holding `tokens`, or None when none does."""
        return next((b for b in self.tokens if b >= tokens), None)
