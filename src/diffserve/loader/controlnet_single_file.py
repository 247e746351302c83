"""`--controlnet NAME=FILE.safetensors`: a ControlNet from one single-file checkpoint in its publisher's original
tensor names, with no config.json beside it (XLabs publish their FLUX.1 canny / depth / HED ControlNets so).

A family that loads such files lists their layouts on its pipeline (`Pipeline.controlnet_file_layouts`, each
a `ControlNetFileLayout`); the loader keeps no layout of its own. A layout recognises its files by marker
tensor names, derives the ControlNet's Diffusers config from the file's shapes and the base DiT's config
(what the file cannot tell, such as the RoPE axes), and maps the file's names to Diffusers' with a
`KeyPlan`, the single-file DiT loader's machinery (`loader/single_file_keys/`: fused `qkv` split by rows).

Everything is checked against the ControlNet built on meta before a byte of tensor data is read: every
model tensor covered, no file tensor left over, every shape right (`plan_problems`), else a
`ModelLoadError` naming the keys. The module is then the class a Diffusers folder of the same ControlNet
loads as, with the same weights, on the DiT's device in its dtype, fused as `load_native_model` fuses it.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from diffserve.errors import ModelLoadError, UserError
from diffserve.layers.custom_op import dispatch_custom_ops
from diffserve.loader.dit_facts import DitFactsTable, PlanBuilder, SingleFileKeys
from diffserve.loader.owned_weights import owned
from diffserve.loader.single_file_keys.plan import KeyPlan, Piece, Shapes
from diffserve.loader.single_file_keys.validate import ChosenPlan, plan_problems
from diffserve.loader.single_file_readers.safetensors_file import SafetensorsSource
from diffserve.platforms import Platform

logger = logging.getLogger("diffserve.loader")

#: The suffix of the single files `--controlnet` takes (a path that is no folder must have it).
SINGLE_FILE_SUFFIX = ".safetensors"


@dataclass(frozen=True)
class ControlNetFileLayout:
    """One publisher's single-file ControlNet layout, as a family states it.

    `label` names the layout in messages; `class_name` is the ControlNet class it loads as (a key of the
    pipeline's `controlnet_classes`); a file is of this layout when it holds every tensor of `markers`.
    `config(shapes, pipeline)` gives the class's Diffusers config from the file's shapes and the base
    pipeline (its DiT's config), raising ValueError naming what does not fit; `plan(shapes, model_keys)`
    maps every Diffusers tensor name to its piece of the file (as a DiT's `SingleFileKeys.plan` does)."""

    label: str
    class_name: str
    markers: tuple[str, ...]
    config: Callable[[Shapes, Any], dict[str, Any]]
    plan: PlanBuilder


def load_controlnet_file(
    name: str,
    path: Path,
    pipeline: Any,
    family_name: str,
    platform: Platform,
    dtype: torch.dtype,
) -> nn.Module:
    """The ControlNet `name` from the single file `path`, for `pipeline` (of family `family_name`), on
    `platform`'s device in `dtype`. UserError when the family loads no single-file ControlNets;
    ModelLoadError when the file is of no layout it knows, or does not fit (naming the keys)."""
    what = f"--controlnet {name}={path}"
    layouts: tuple[ControlNetFileLayout, ...] = getattr(pipeline, "controlnet_file_layouts", ())
    if not layouts:
        raise UserError(
            f"{what}: the {family_name} family loads ControlNets from Diffusers model folders only (config.json "
            "and safetensors), not single files (the README's ControlNet section lists the single-file layouts)"
        )
    if path.suffix != SINGLE_FILE_SUFFIX:
        raise UserError(f"{what}: a single-file ControlNet must be a {SINGLE_FILE_SUFFIX} file")
    classes: dict[str, Any] = getattr(pipeline, "controlnet_classes", {})
    source = SafetensorsSource(path)
    try:
        shapes = source.shapes()
        layout = _layout_of(what, shapes, layouts)
        cls = classes.get(layout.class_name)
        if cls is None:
            raise UserError(f"{what}: the {family_name} family does not take {layout.label} files")
        try:
            config = layout.config(shapes, pipeline)
            with torch.device("meta"):
                module = cls.from_config(config)
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(
                f"{what}: read in the {layout.label} layout, it does not fit this model: {exc}"
            ) from exc
        model_shapes = {key: tuple(t.shape) for key, t in module.state_dict().items()}
        full_plan = layout.plan(shapes, frozenset(model_shapes))
        plan = {target: piece for target, piece in full_plan.items() if target in model_shapes}
        chosen = ChosenPlan(plan, f"{layout.label} names")
        problem = plan_problems(
            chosen, shapes, model_shapes, SingleFileKeys(layout.label, layout.plan), _NO_FACTS
        )
        if problem is not None:
            raise ModelLoadError(
                f"{what} ({source.description}): read in the {layout.label} layout, with the widths a file "
                f"cannot tell taken from the model's DiT, it does not fit: {problem}"
            )
        total = _assign(module, plan, source, platform.device(), dtype)
    finally:
        source.close()
    module.eval().requires_grad_(False)
    fuse = getattr(module, "fuse_for_inference", None)
    if fuse is not None:  # as `load_native_model` fuses a folder's ControlNet
        fuse()
    dispatch_custom_ops(module, platform)
    logger.info(
        "ControlNet %r loaded from %s (%s as %s; %.1f MB read)",
        name,
        path,
        layout.label,
        cls.__name__,
        total / 1e6,
    )
    return module


#: No other family is guessed at in a ControlNet file's errors (`plan_problems` names its keys).
_NO_FACTS = DitFactsTable(())


def _layout_of(what: str, shapes: Shapes, layouts: tuple[ControlNetFileLayout, ...]) -> ControlNetFileLayout:
    """The first layout whose markers the file holds, else a ModelLoadError saying what each lacks."""
    for layout in layouts:
        if all(marker in shapes for marker in layout.markers):
            return layout
    lacks = "; ".join(
        f"{layout.label} files hold {', '.join(repr(m) for m in layout.markers)}, this one lacks "
        + ", ".join(repr(m) for m in layout.markers if m not in shapes)
        for layout in layouts
    )
    raise ModelLoadError(
        f"{what}: not a single-file ControlNet this model takes: {lacks} (a ControlNet in Diffusers' layout "
        "loads from its model folder, config.json beside the safetensors)"
    )


def _assign(
    module: nn.Module, plan: KeyPlan, source: SafetensorsSource, device: torch.device, dtype: torch.dtype
) -> int:
    """Read each file tensor once, cut it into its plan pieces and assign them into the meta `module`, in
    memory of their own on `device` (floating-point ones in `dtype`). Returns the bytes read."""
    by_source: dict[str, list[tuple[str, Piece]]] = defaultdict(list)
    for target, piece in plan.items():
        by_source[piece.source].append((target, piece))
    state: dict[str, torch.Tensor] = {}
    total = 0
    for stored, pieces in by_source.items():
        tensor = source.read(stored)
        total += source.stored_bytes(stored)
        for target, piece in pieces:
            value = piece.take(tensor)
            value = owned(value, device, dtype if value.is_floating_point() else value.dtype).contiguous()
            if value.untyped_storage().nbytes() != value.numel() * value.element_size():
                value = value.clone()  # a fused tensor's rows: not a view keeping the whole of it
            state[target] = value
        del tensor
    module.load_state_dict(state, strict=False, assign=True)
    still_meta = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    if still_meta:
        raise ModelLoadError(
            f"{type(module).__name__}: tensors left uninitialised: {', '.join(still_meta[:8])}"
        )
    return total
