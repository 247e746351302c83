"""The model families diffserve serves: the one list of them. Each family is a package under `families/`
whose `record.py` states its `ModelFamily` records (pipeline class, native classes, DiT facts, tiny
builder, ...); this module lists those packages, and code that needs a family's classes, names, builders
or DiT facts reads them from here instead of listing families itself.

Adding a family: its package `families/<name>/` (record, config, pipeline, its own stages, tiny builder),
its DiT and VAE under `models/` if they are new, one line in `FAMILIES` below, and its tests
(docs/adding-a-model.md).
"""

from __future__ import annotations

from diffserve.errors import ModelLoadError, UserError
from diffserve.families.chroma import record as chroma
from diffserve.families.cogvideox import record as cogvideox
from diffserve.families.flux import record as flux
from diffserve.families.flux2 import record as flux2
from diffserve.families.hidream import record as hidream
from diffserve.families.hunyuan_image import record as hunyuan_image
from diffserve.families.hunyuan_video import record as hunyuan_video
from diffserve.families.hunyuan_video15 import record as hunyuan_video15
from diffserve.families.longcat_image import record as longcat_image
from diffserve.families.ltx2 import record as ltx2
from diffserve.families.mochi import record as mochi
from diffserve.families.qwen_image import record as qwen_image
from diffserve.families.qwen_image21 import record as qwen_image21
from diffserve.families.record import ModelFamily, TinyCheckpointBuilder, TinyCheckpointOptions
from diffserve.families.sana import record as sana
from diffserve.families.sana_video import record as sana_video
from diffserve.families.sd3 import record as sd3
from diffserve.families.wan import record as wan
from diffserve.families.z_image import record as z_image
from diffserve.loader.dit_facts import DitFactsTable
from diffserve.runtime.cuda_graph.padders import PromptPadder

FAMILIES: tuple[ModelFamily, ...] = (
    *flux.FAMILIES,
    *sd3.FAMILIES,
    *qwen_image.FAMILIES,
    *qwen_image21.FAMILIES,
    *z_image.FAMILIES,
    *wan.FAMILIES,
    *sana.FAMILIES,
    *sana_video.FAMILIES,
    *flux2.FAMILIES,
    *hunyuan_image.FAMILIES,
    *hunyuan_video15.FAMILIES,
    *hunyuan_video.FAMILIES,
    *ltx2.FAMILIES,
    *longcat_image.FAMILIES,
    *chroma.FAMILIES,
    *cogvideox.FAMILIES,
    *mochi.FAMILIES,
    *hidream.FAMILIES,
)

#: Diffusers pipeline `_class_name` -> family.
REGISTRY: dict[str, ModelFamily] = {family.diffusers_pipeline: family for family in FAMILIES}

#: Every native DiT's loader facts (quantization, LoRA conversion, single-file keys), from the records.
DIT_FACTS = DitFactsTable(family.dit_facts for family in FAMILIES)


def _prompt_padders() -> dict[str, PromptPadder]:
    """DiT Diffusers class name -> the padder its families' records name (`--enable-cuda-graph`); families
    sharing a DiT (a variant and its base) must name the same one."""
    padders: dict[str, PromptPadder] = {}
    for family in FAMILIES:
        if family.prompt_padder is None:
            continue
        known = padders.setdefault(family.dit_facts.class_name, family.prompt_padder)
        if known is not family.prompt_padder:
            raise ValueError(f"two families name different prompt padders for {family.dit_facts.class_name}")
    return padders


#: What the runtime's breakable CUDA graphs read to pad a DiT's calls (runtime/cuda_graph/install.py).
PROMPT_PADDERS = _prompt_padders()

_BY_NAME: dict[str, ModelFamily] = {
    spelling: family for family in FAMILIES for spelling in (family.name, *family.aliases)
}


def _extra_tiny_builders() -> dict[str, TinyCheckpointBuilder]:
    """The records' extra make-tiny targets by name (`ModelFamily.extra_tiny_builders`), each name unique
    among them and the families' spellings."""
    builders: dict[str, TinyCheckpointBuilder] = {}
    for family in FAMILIES:
        for name, builder in family.extra_tiny_builders:
            if name in builders or name in _BY_NAME:
                raise ValueError(f"make-tiny target {name!r} is named twice")
            builders[name] = builder
    return builders


#: make-tiny targets that are no family (add-on models such as ControlNets) -> their builders.
EXTRA_TINY_BUILDERS = _extra_tiny_builders()

__all__ = [
    "DIT_FACTS",
    "PROMPT_PADDERS",
    "FAMILIES",
    "REGISTRY",
    "ModelFamily",
    "TinyCheckpointBuilder",
    "TinyCheckpointOptions",
    "family_by_name",
    "family_names",
    "tiny_builder_by_name",
    "tiny_target_names",
    "pipelines_for_task",
    "resolve_family",
]


def pipelines_for_task(task: str) -> tuple[str, ...]:
    """The Diffusers pipeline names of the families doing `task` ("image-edit", ...), in registry order:
    what an error message suggests to a user whose model cannot do what they asked."""
    return tuple(family.diffusers_pipeline for family in FAMILIES if family.task == task)


def family_names() -> tuple[str, ...]:
    """Every family's name, in registry order (aliases not included)."""
    return tuple(family.name for family in FAMILIES)


def family_by_name(name: str) -> ModelFamily:
    """The family with this name or alias (`zimage` -> `z-image`), or a UserError listing the names."""
    family = _BY_NAME.get(name)
    if family is None:
        raise UserError(f"unknown model family {name!r}; families: {', '.join(family_names())}")
    return family


def tiny_target_names() -> tuple[str, ...]:
    """What `diffserve make-tiny` writes: every family's name, then the records' extra targets."""
    return (*family_names(), *EXTRA_TINY_BUILDERS)


def tiny_builder_by_name(name: str) -> TinyCheckpointBuilder:
    """The builder `diffserve make-tiny NAME` runs: a family's (by name or alias) or an extra target's;
    a UserError listing the targets otherwise."""
    builder = EXTRA_TINY_BUILDERS.get(name)
    if builder is not None:
        return builder
    family = _BY_NAME.get(name)
    if family is None:
        raise UserError(f"unknown make-tiny target {name!r}; targets: {', '.join(tiny_target_names())}")
    return family.tiny_builder


def resolve_family(pipeline_class_name: str) -> ModelFamily:
    """The family for a Diffusers pipeline class name, or a ModelLoadError listing the supported ones."""
    family = REGISTRY.get(pipeline_class_name)
    if family is None:
        supported = ", ".join(sorted(REGISTRY))
        raise ModelLoadError(
            f"pipeline {pipeline_class_name!r} is not supported by diffserve's native backend; "
            f"supported pipelines: {supported}. To run it through diffusers' own pipeline instead (one request "
            'at a time, exact quality only), pass --backend diffusers (backend="diffusers" in the Python API; '
            "needs pip install 'diffserve[diffusers]')"
        )
    return family
