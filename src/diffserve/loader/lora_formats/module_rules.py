"""Tables that name a DiT's LoRA-able Linears the way non-Diffusers files do, and map those names to
Diffusers module paths.

kohya files join a module path with underscores (`lora_unet_transformer_blocks_0_attn_to_q`), so the
path cannot be recovered by splitting: a table of the model's module names says where the dots were,
the way Diffusers' converters list protected n-grams. Original-checkpoint files (`diffusion_model.…`)
use the model authors' names (`blocks.0.self_attn.q`), which a table renames. A `ModuleRule` gives one
module name as files write it (`source`, with dots) and the Diffusers path(s) it lands on; `{n}` in a
name stands for a block index, `{p}` for a patch-size key such as `2-1`. A rule with several targets is a
fused projection whose up factor's rows divide into equal parts, one per target, in order.

Some trainers save a module twice, under Diffusers' name and under an original one (a fused `qkv` next
to `to_q` / `to_k` / `to_v`); Diffusers then ignores the original. Rules marked `alias` are such
secondary names: their keys are dropped when the same file also names the targets directly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_PLACEHOLDERS = {"{n}": r"(\d+)", "{p}": r"(\d+-\d+)"}
_PLACEHOLDER_SPLIT = re.compile(r"(\{n\}|\{p\})")


@dataclass(frozen=True)
class ModuleRule:
    """`source`, the module name as a file writes it (dotted), lands on the Diffusers paths `targets`
    (component-relative); `alias`: a secondary name, ignored next to direct keys of the same targets."""

    source: str
    targets: tuple[str, ...]
    alias: bool = False


def same(*paths: str) -> list[ModuleRule]:
    """Rules for modules that files name exactly as Diffusers does."""
    return [ModuleRule(path, (path,)) for path in paths]


def renamed(source: str, target: str, alias: bool = False) -> ModuleRule:
    return ModuleRule(source, (target,), alias)


def split(source: str, *targets: str, alias: bool = False) -> ModuleRule:
    return ModuleRule(source, targets, alias)


def _pattern(template: str) -> re.Pattern[str]:
    parts = _PLACEHOLDER_SPLIT.split(template)
    return re.compile("".join(_PLACEHOLDERS.get(part, re.escape(part)) for part in parts))


def _fill(template: str, values: tuple[str, ...]) -> str:
    parts = _PLACEHOLDER_SPLIT.split(template)
    filled: list[str] = []
    index = 0
    for part in parts:
        if part in _PLACEHOLDERS:
            filled.append(values[index])
            index += 1
        else:
            filled.append(part)
    return "".join(filled)


@dataclass(frozen=True)
class Resolved:
    """Where one file module lands: its Diffusers `targets`, and whether it was named by an alias."""

    targets: tuple[str, ...]
    alias: bool


class ModuleTable:
    """An architecture's rules, matched against dotted names and against kohya's underscore-joined
    ones. A name two rules map to different targets is a table error, raised as `ValueError`."""

    def __init__(self, rules: list[ModuleRule]) -> None:
        self.rules = tuple(rules)
        self._dotted = [(_pattern(rule.source), rule) for rule in rules]
        self._flat = [(_pattern(rule.source.replace(".", "_")), rule) for rule in rules]

    def resolve_dotted(self, name: str) -> Resolved | None:
        """The rule for a dotted module name, or None when no rule names it."""
        return self._resolve(self._dotted, name)

    def resolve_flat(self, name: str) -> Resolved | None:
        """The rule for a kohya underscore-joined module name, or None when no rule names it."""
        return self._resolve(self._flat, name)

    @staticmethod
    def _resolve(patterns: list[tuple[re.Pattern[str], ModuleRule]], name: str) -> Resolved | None:
        found: dict[tuple[str, ...], bool] = {}
        for pattern, rule in patterns:
            match = pattern.fullmatch(name)
            if match:
                targets = tuple(_fill(t, match.groups()) for t in rule.targets)
                # a name that a direct rule also gives (kohya's `to_q` for `to.q`) is direct
                found[targets] = found.get(targets, True) and rule.alias
        if len(found) > 1:
            raise ValueError(f"module table is ambiguous for {name!r}: {sorted(found)}")
        return next((Resolved(targets, alias) for targets, alias in found.items()), None)
