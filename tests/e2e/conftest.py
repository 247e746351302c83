"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

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
