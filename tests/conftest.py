"""Shared fixtures: tiny FLUX checkpoints built once per test session (random weights, Diffusers layout)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_flux_dir(tmp_path_factory: pytest.TempPathFactory):
    """FLUX.1-dev style: guidance embedding on."""
    from diffserve.testing.tiny_flux import TinyFluxSpec, build_tiny_flux

    return build_tiny_flux(tmp_path_factory.mktemp("tiny-flux"), TinyFluxSpec(seed=0, guidance_embeds=True))


@pytest.fixture(scope="session")
def tiny_flux_schnell_dir(tmp_path_factory: pytest.TempPathFactory):
    """FLUX.1-schnell style: no guidance embedding."""
    from diffserve.testing.tiny_flux import TinyFluxSpec, build_tiny_flux

    return build_tiny_flux(
        tmp_path_factory.mktemp("tiny-flux-schnell"), TinyFluxSpec(seed=1, guidance_embeds=False)
    )
