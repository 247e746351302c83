"""`diffserve make-tiny` targets: every family's name and alias, and the records' extra builders
(`ModelFamily.extra_tiny_builders`: add-on models such as a FLUX.1 ControlNet), each name unique."""

from __future__ import annotations

import pytest

from diffserve.errors import UserError
from diffserve.registry import (
    EXTRA_TINY_BUILDERS,
    FAMILIES,
    family_by_name,
    family_names,
    tiny_builder_by_name,
    tiny_target_names,
)


def test_targets_are_the_families_then_the_extra_builders() -> None:
    names = tiny_target_names()
    assert names[: len(family_names())] == family_names()
    assert "flux-controlnet" in names and "flux-controlnet" in EXTRA_TINY_BUILDERS
    assert len(set(names)) == len(names)
    spellings = {spelling for family in FAMILIES for spelling in (family.name, *family.aliases)}
    assert not spellings & set(EXTRA_TINY_BUILDERS)


def test_a_family_name_or_alias_gives_its_builder() -> None:
    for family in FAMILIES:
        for spelling in (family.name, *family.aliases):
            assert tiny_builder_by_name(spelling) is family_by_name(spelling).tiny_builder


def test_an_unknown_target_lists_them_all() -> None:
    with pytest.raises(UserError, match="unknown make-tiny target 'flux-controlnets'.*flux-controlnet"):
        tiny_builder_by_name("flux-controlnets")
