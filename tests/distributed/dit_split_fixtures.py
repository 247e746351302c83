"""The `expected` module fixture of the DiT sequence-parallel files (test_dit_sequence_parallel*.py) whose
families have a `one_device` forward: each family's one-device outputs, computed once per module."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Protocol

import pytest


class OneDevice(Protocol):
    """A family of a sequence-parallel file (a frozen dataclass): its plain forward on one device."""

    @property
    def one_device(self) -> Callable[[], object]: ...


def one_device_outputs_fixture(families: Mapping[str, OneDevice]) -> Callable[[], Callable[[str], object]]:
    """The module fixture `expected`: `expected(family)` is `families[family].one_device()`, computed on
    first use and kept for the module."""

    @pytest.fixture(scope="module")
    def expected() -> Callable[[str], object]:
        """A family's one-device outputs (computed once)."""
        return functools.cache(lambda family: families[family].one_device())

    return expected
