"""The container prefix of single-file checkpoints: ComfyUI's all-in-one files name the DiT's tensors
`model.diffusion_model.<name>` next to the VAE's and the text encoders' (which the folder provides)."""

from __future__ import annotations

from collections.abc import Iterable

DIT_PREFIX = "model.diffusion_model."


def strip_dit_prefix(names: Iterable[str]) -> tuple[dict[str, str], int]:
    """(DiT tensor name -> name as stored, how many stored tensors lie outside the DiT). A file with no
    prefixed name is all DiT; one with some keeps only those (the rest are other components)."""
    names = list(names)
    prefixed = [name for name in names if name.startswith(DIT_PREFIX)]
    if not prefixed:
        return {name: name for name in names}, 0
    return {name[len(DIT_PREFIX) :]: name for name in prefixed}, len(names) - len(prefixed)
