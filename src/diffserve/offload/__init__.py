"""Offload: weights kept in host memory and moved to the device when needed (docs/memory.md).

`plan.py` decides where each component lives before loading (the explicit flags, `--offload auto`,
`--max-memory`), `components.py` moves whole components for their stages, `layerwise.py` streams a DiT's
blocks; `sizes.py` reads the components' sizes from their checkpoint headers."""

from diffserve.offload.components import (
    OffloadGroup,
    components_that_can_stay_resident,
    install_memory_plan,
    log_resident_candidates,
    offload_group,
    weight_residency,
)
from diffserve.offload.plan import MemoryPlan, log_plan, plan_memory

__all__ = [
    "MemoryPlan",
    "OffloadGroup",
    "components_that_can_stay_resident",
    "install_memory_plan",
    "log_plan",
    "log_resident_candidates",
    "offload_group",
    "plan_memory",
    "weight_residency",
]
