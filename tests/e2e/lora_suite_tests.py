"""The module fixture, the generation test and the no-LoRA-after-LoRAs test every `Suite`-based LoRA parity file
(test_lora_parity_*.py over several families) declares: built from the file's `Suite`, so each file
states only its families and the tests of its own."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from diffserve.testing.lora_parity import (
    Engines,
    Loras,
    Suite,
    check_generation_matches_diffusers,
    check_no_lora_after_loras,
)

EnginesOf = Callable[[str], Engines]


def engines_fixture(suite: Suite) -> Callable[..., Iterator[EnginesOf]]:
    """The module fixture `engines_of`: a family's `Engines`, started on first use and kept for the
    module (one fixture for every family: a parametrized module fixture would be rebuilt for each
    differently parametrized test)."""

    @pytest.fixture(scope="module")
    def engines_of(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EnginesOf]:
        with suite.engines(tmp_path_factory.mktemp) as get:
            yield get

    return engines_of


def generation_test(suite: Suite) -> Callable[[EnginesOf, str, Loras], None]:
    """The test that each of `suite.cases()` (a family and its LoRAs) generates as Diffusers does."""

    @pytest.mark.parametrize(
        ("family", "loras"), [pytest.param(f, loras, id=i) for f, loras, i in suite.cases()]
    )
    def test_lora_generation_matches_diffusers(engines_of: EnginesOf, family: str, loras: Loras) -> None:
        check_generation_matches_diffusers(engines_of(family), family, loras)

    return test_lora_generation_matches_diffusers


def no_lora_after_loras_test(suite: Suite) -> Callable[[EnginesOf, str], None]:
    """The test that, per family, a request without LoRA after requests with both adapters is the base
    output bit for bit (`check_no_lora_after_loras` with its default requests)."""

    @pytest.mark.parametrize("family", list(suite.families))
    def test_no_lora_after_loras_is_the_base_bit_for_bit(engines_of: EnginesOf, family: str) -> None:
        check_no_lora_after_loras(engines_of(family))

    return test_no_lora_after_loras_is_the_base_bit_for_bit
