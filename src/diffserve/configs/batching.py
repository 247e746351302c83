"""The names of `--batch-policy` (what each does: `diffserve.runtime.batch_policy`), declared once for the
option and the runtime."""

from typing import Literal, get_args

BatchPolicyName = Literal["auto", "throughput", "latency"]
BATCH_POLICIES: tuple[str, ...] = get_args(BatchPolicyName)
