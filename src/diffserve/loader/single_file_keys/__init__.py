"""Key conversions of single-file DiT checkpoints (original names -> Diffusers' names): the plan
machinery lives here (`plan.py`, `validate.py`, `prefix.py`); each family's converter lives in its package
(`families/<name>/single_file_keys.py`) and is named by its record's `SingleFileKeys`
(`loader/dit_facts.py`)."""

from __future__ import annotations

from diffserve.loader.single_file_keys.plan import KeyPlan, Piece, Shapes, identity_plan


def identity_keys_plan(shapes: Shapes, model_keys: frozenset[str]) -> KeyPlan:
    """The plan of a file that already uses Diffusers' names (Qwen-Image's originals do)."""
    del model_keys
    return identity_plan(shapes)


__all__ = ["KeyPlan", "Piece", "Shapes", "identity_keys_plan"]
