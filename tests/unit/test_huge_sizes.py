"""Issue 31, item 11: a request for an absurd size once sent the engine's receiving thread into a search
that tried one candidate size per 16 pixels (hours for "1000000000000x16"). Every side is capped (a 400
naming the maximum), and the search for the largest size that fits takes logarithmically many probes."""

from __future__ import annotations

import time

import pytest

from diffserve.configs.sampling_params import MAX_IMAGE_SIDE, SamplingParams
from diffserve.errors import InvalidRequestError
from diffserve.runtime.memory import MemoryModel, RequestCost, fitting_changes
from diffserve.server.errors import ApiParamError
from diffserve.server.schemas import parse_size

MB = 2**20


def _model(budget_bytes: int) -> MemoryModel:
    return MemoryModel(
        bytes_per_token=4096.0,
        bytes_per_pixel=64.0,
        fixed_bytes=0.0,
        decode_fixed_bytes=0.0,
        budget_bytes=budget_bytes,
        source="estimated",
    )


@pytest.mark.parametrize("name", ["width", "height"])
def test_a_side_above_the_maximum_is_refused_naming_it(name: str) -> None:
    with pytest.raises(InvalidRequestError, match=f"{name} must be at most {MAX_IMAGE_SIDE}, got 1000000000"):
        SamplingParams(prompt="x", **{name: 1_000_000_000}).check_values()
    SamplingParams(prompt="x", **{name: MAX_IMAGE_SIDE}).check_values()  # the maximum itself is accepted


def test_a_size_string_above_the_maximum_is_refused_naming_it() -> None:
    with pytest.raises(ApiParamError, match=f"each side must be at most {MAX_IMAGE_SIDE} pixels"):
        parse_size("1000000000000x16", "WIDTHxHEIGHT")
    assert parse_size(f"{MAX_IMAGE_SIDE}x16", "WIDTHxHEIGHT") == (MAX_IMAGE_SIDE, 16)


def test_the_fitting_search_takes_logarithmically_many_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(64 * MB)
    probes: list[RequestCost] = []
    fits_alone = MemoryModel.fits_alone

    def counted(self: MemoryModel, cost: RequestCost) -> bool:
        probes.append(cost)
        return fits_alone(self, cost)

    monkeypatch.setattr(MemoryModel, "fits_alone", counted)
    huge = RequestCost(height=16, width=10**12, pixel_multiple=16, branches=2, outputs=3)
    start = time.perf_counter()
    advice = fitting_changes(model, huge)
    assert time.perf_counter() - start < 5
    assert len(probes) <= 3 * 64, f"{len(probes)} probes"  # bisection: about log2 of each range
    size = next(a for a in advice if a.startswith("reduce size"))
    width = int(size.split()[-1].split("x")[0])
    assert model.fits_alone(RequestCost(height=16, width=width, pixel_multiple=16, branches=2, outputs=3))
    assert not model.fits_alone(
        RequestCost(height=16, width=width + 16, pixel_multiple=16, branches=2, outputs=3)
    )  # the largest that fits, as the linear search found it
