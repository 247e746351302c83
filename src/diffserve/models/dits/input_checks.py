"""The checks of a DiT forward's inputs that the native DiTs share: per-sample vectors (the timestep, the
guidance scale) and the choice between the text encoder's states and their embedding."""

from __future__ import annotations

import torch


def check_per_sample(batch: int, **vectors: torch.Tensor | None) -> None:
    """ValueError `<name> must have shape (batch,) or (1,)` unless each given vector (the timestep, the
    guidance scale) holds one value per sample or one for the whole batch; None ones are not checked."""
    for name, t in vectors.items():
        if t is not None and (t.ndim != 1 or t.shape[0] not in (1, batch)):
            raise ValueError(f"{name} must have shape ({batch},) or (1,), got {tuple(t.shape)}")


def check_one_text_input(
    encoder_hidden_states: torch.Tensor | None, context: torch.Tensor | None, states: str
) -> None:
    """ValueError unless exactly one of the text encoder's states and their embedding (`context`, what
    `embed_context` returns, so that many steps embed them once) is given; `states` names the encoder's."""
    if (context is None) == (encoder_hidden_states is None):
        raise ValueError(f"pass exactly one of encoder_hidden_states ({states}) and context (embedded)")
