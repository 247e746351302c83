"""Choosing how a single file's names map to the model's, and checking it all fits before a byte of
tensor data is read: every model tensor covered, no file tensor left over, every shape right."""

from __future__ import annotations

from dataclasses import dataclass

from diffserve.loader.dit_facts import DitFactsTable, SingleFileKeys
from diffserve.loader.single_file_keys.plan import KeyPlan, Shapes, identity_plan

_SHOWN = 8


@dataclass(frozen=True)
class ChosenPlan:
    """The plan restricted to the model's tensors, and which naming it reads the file in."""

    plan: KeyPlan
    naming: str


def choose_plan(keys: SingleFileKeys, shapes: Shapes, model_keys: frozenset[str]) -> ChosenPlan:
    """Read the file in Diffusers' names or in the family's original names, whichever covers more of
    the model (a file in neither scores low on both; `plan_problems` then says what is wrong)."""
    candidates = [ChosenPlan(identity_plan(shapes), "Diffusers names")]
    converted = keys.plan(shapes, model_keys)
    if converted != candidates[0].plan:
        candidates.append(ChosenPlan(converted, f"original {keys.label} names"))

    def covered(chosen: ChosenPlan) -> int:
        return sum(1 for t, p in chosen.plan.items() if t in model_keys and p.source in shapes)

    best = max(candidates, key=covered)  # first (Diffusers names) on a tie
    return ChosenPlan({t: p for t, p in best.plan.items() if t in model_keys}, best.naming)


def plan_problems(
    chosen: ChosenPlan,
    shapes: Shapes,
    model_shapes: dict[str, tuple[int, ...]],
    keys: SingleFileKeys,
    facts: DitFactsTable,
    file_arch: str | None = None,
) -> str | None:
    """What keeps `chosen` from loading the model (missing / unexpected keys, wrong shapes), or None.
    `facts` tells which other family a mismatching file looks like; `file_arch` (a GGUF file's
    `general.architecture`) is named when it is not the family's."""
    plan = chosen.plan
    absent = sorted({p.source for p in plan.values() if p.source not in shapes})
    uncovered = sorted(model_shapes.keys() - plan.keys())
    used = {p.source for p in plan.values()}
    unexpected = sorted(set(shapes) - used - keys.ignored)
    problems = []
    if absent or uncovered:
        problems.append(f"missing keys: {_describe(absent + uncovered)}")
    if unexpected:
        problems.append(f"unexpected keys: {_describe(unexpected)}")
    if problems:
        guess = facts.guess_single_file_family(shapes)
        if guess and guess != keys.label:
            problems.insert(0, f"the file looks like a {guess} checkpoint, not {keys.label}")
        if file_arch and file_arch not in keys.gguf_arches:
            problems.insert(0, f"its GGUF architecture is {file_arch!r}")
        return "; ".join(problems)
    wrong = [
        f"{target!r} (from {p.source!r}) has shape {p.shape(shapes[p.source])}, the folder's config "
        f"expects {model_shapes[target]}"
        for target, p in sorted(plan.items())
        if p.shape(shapes[p.source]) != model_shapes[target]
    ]
    if not wrong:
        return None
    return "; ".join(wrong[:_SHOWN]) + (f"; ... ({len(wrong)} in all)" if len(wrong) > _SHOWN else "")


def _describe(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown + (f", ... ({len(names)} in all)" if len(names) > _SHOWN else "")
