"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffserve.models.vaes.autoencoder_kl import AutoencoderKL


@pytest.fixture
def tiled_decodes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The latent shapes `AutoencoderKL` decodes in tiles, recorded."""
    calls: list[tuple[int, ...]] = []
    tiled_decode = AutoencoderKL._tiled_decode

    def recording(self: AutoencoderKL, z):  # noqa: ANN001, ANN202
        calls.append(tuple(z.shape))
        return tiled_decode(self, z)

    monkeypatch.setattr(AutoencoderKL, "_tiled_decode", recording)
    return calls


@pytest.fixture(scope="session")
def cache_flux_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The cache-method tests' tiny random FLUX: 2 double- and 4 single-stream blocks (room for DBCache's
    Fn and Bn), built once per test process."""
    from diffserve.families.flux.tiny import TinyFluxSpec, build_tiny_flux

    return build_tiny_flux(
        tmp_path_factory.mktemp("cache-flux"), TinyFluxSpec(num_layers=2, num_single_layers=4)
    )


@pytest.fixture(scope="module")
def cache_flux(cache_flux_dir: Path):
    """A `DiffGenerator` on `cache_flux_dir`, one per test module."""
    from diffserve import DiffGenerator

    return DiffGenerator.from_pretrained(cache_flux_dir, device="cpu", show_progress=False)


@pytest.fixture(scope="module")
def cache_flux_reference(cache_flux_dir: Path):
    """diffusers' FluxPipeline on `cache_flux_dir` (fp32, no progress bar), one per test module."""
    import torch
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(cache_flux_dir, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe
