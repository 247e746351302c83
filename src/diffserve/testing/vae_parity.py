"""Helpers of the VAE parity tests: a perturbation of a tiny VAE's weights, the config-defaults check, and a
decode with both sides' spatial tiling switched on for the call."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from diffserve.testing.parity import diffusers_init_defaults, randomize_norms


def weight_noise(std: float) -> Callable[[nn.Module], None]:
    """A `parity_pair` perturbation: N(0, std) added to every parameter, then the norms randomized, so a
    tiny VAE's output depends on every weight (initial zeros and ones hide layout mistakes)."""

    def perturb(model: nn.Module) -> None:
        for p in model.parameters():
            p.add_(std * torch.randn_like(p))
        randomize_norms(model)

    return perturb


def _plain(value: Any) -> Any:
    return tuple(value) if isinstance(value, list | tuple) else value


def assert_config_defaults_are_diffusers(diffusers_cls: type, defaults: Mapping[str, Any]) -> None:
    """The native VAE's config defaults are exactly Diffusers' `__init__` defaults (lists as tuples)."""
    want = {k: _plain(v) for k, v in diffusers_init_defaults(diffusers_cls).items()}
    assert {k: _plain(v) for k, v in defaults.items()} == want


def tiled_decodes(
    reference: Any, native: Any, z: torch.Tensor, tiles: Mapping[str, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(native, Diffusers) decodes of latents `z` with `enable_tiling(**tiles)` on both for the call."""
    reference.enable_tiling(**tiles)
    native.enable_tiling(**tiles)
    try:
        with torch.no_grad():
            return native.decode(z), reference.decode(z).sample
    finally:
        reference.disable_tiling()
        native.disable_tiling()
