"""The step-order checks shared by the per-request schedulers (DPM-Solver++, UniPC, SCM).

These schedulers keep a request's history in a state object and pair it with the request's sigmas by
step index, so a step outside the schedule, or one that skips or repeats an index, would silently
combine the wrong sigmas with the history: it is refused instead, on the host, before any maths.
"""

from __future__ import annotations

import torch


def checked_step_count(
    scheduler: str, sigmas: torch.Tensor, step_index: int, last_step_index: int | None
) -> int:
    """The number of steps of a request's schedule (`sigmas`, the final entry appended), after checking
    that `step_index` lies in it and directly follows the request's `last_step_index` (None before its
    first step). `scheduler` names the scheduler in the error messages."""
    num_steps = int(sigmas.shape[0]) - 1
    if not 0 <= step_index < num_steps:
        raise ValueError(f"step_index {step_index} is outside a {num_steps}-step schedule")
    if last_step_index is not None and step_index != last_step_index + 1:
        raise ValueError(
            f"{scheduler} steps must be consecutive: this request's last step was {last_step_index}, "
            f"got {step_index}"
        )
    return num_steps


def check_history_length(model_outputs: list[torch.Tensor | None], solver_order: int) -> None:
    """A multistep request state holds one slot per order of its scheduler: refuse another's state."""
    if len(model_outputs) != solver_order:
        raise ValueError("state was made for a different solver_order; use this scheduler's new_state()")
