"""`ModelFamily`: the record a family's package states about itself (`families/<name>/record.py`), and
what `diffserve make-tiny` hands a family's tiny-checkpoint builder.

A record says everything the rest of the engine needs to know about a family: the Diffusers pipeline
`_class_name` it serves (no guessing from folder or model names: a folder is served only when its
model_index.json names a pipeline some record lists, and anything else is refused with the list of what
is supported), its pipeline class, the native classes that implement its Diffusers components, the
loader's facts about its DiT (full-precision modules, LoRA conversion, single-file key plans), its task,
and the builder of its tiny random-weight checkpoint. Its pipeline constants and sampling defaults
(`config.py`) are the pipeline class's own: the pipeline reads them, so the record does not repeat them.
Its `name` is the family's one spelling everywhere (CLI, calibration files, logs); `aliases` are other
spellings accepted on input, and only the registry's `family_by_name` reads them.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from diffserve.configs.step_cache_policy import StepCachePolicy
from diffserve.loader.dit_facts import DitFacts
from diffserve.loader.native_classes import NativeClasses
from diffserve.pipelines.base import Pipeline
from diffserve.runtime.cuda_graph.padders import PromptPadder


@dataclass(frozen=True)
class TinyCheckpointOptions:
    """What `diffserve make-tiny` hands a family's tiny-checkpoint builder. Every builder reads `seed`;
    the other fields are variants of one family each, and other families' builders ignore them."""

    seed: int = 0
    #: FLUX: False writes a FLUX.1-schnell style DiT (no guidance embedding).
    guidance_embeds: bool = True
    #: SD3: write the SD3.5 layout (qk RMSNorm, dual attention in block 0).
    sd35: bool = False
    #: Wan: the scheduler written, "flow-match-euler" or "unipc" (what the released Wan 2.1 folders ship).
    scheduler: str = "flow-match-euler"
    #: Wan: "2.1", "2.2-a14b" (two experts) or "2.2-ti2v" (Wan 2.2 VAE, T2V and I2V in one wan-t2v folder).
    wan_variant: str = "2.1"


class TinyCheckpointBuilder(Protocol):
    """Writes a small random-weight checkpoint of one family in Diffusers layout to `out_dir` (created if
    missing) and returns the folder's path."""

    def __call__(self, out_dir: Path, options: TinyCheckpointOptions) -> Path: ...


def lazy_tiny_builder(
    module: str, builder: str, spec: str, options_fields: tuple[str, ...] = (), **spec_fields: Any
) -> TinyCheckpointBuilder:
    """The `tiny_builder` of a record whose builder takes a spec dataclass: it writes
    `builder(out_dir, spec(seed=..., **fields))`, the spec given the options' seed, the `options_fields`
    of `TinyCheckpointOptions` by their names and the record's `spec_fields` (its variant). `builder` and
    `spec` are names in the tiny `module`, imported only when a checkpoint is written: it loads
    transformers model classes that listing the families does not need."""

    def build(out_dir: Path, options: TinyCheckpointOptions) -> Path:
        tiny = importlib.import_module(module)
        chosen = {name: getattr(options, name) for name in options_fields}
        return getattr(tiny, builder)(
            out_dir, getattr(tiny, spec)(seed=options.seed, **chosen, **spec_fields)
        )

    return build


@dataclass(frozen=True)
class ModelFamily:
    """One model family: everything diffserve needs to load, serve and test it."""

    #: The family's one spelling (CLI, calibration files, logs, metrics).
    name: str
    #: The Diffusers pipeline `_class_name` in model_index.json that this family serves.
    diffusers_pipeline: str
    pipeline_cls: type[Pipeline]
    #: Diffusers `_class_name` -> native class, for the DiT, the VAE and the schedulers this family loads.
    native_classes: NativeClasses
    #: What it makes from what: "text-to-image", "image-edit", "text-to-video", "image-to-video".
    task: str
    #: Writes the family's tiny random-weight checkpoint (what `diffserve make-tiny NAME DIR` runs).
    tiny_builder: TinyCheckpointBuilder
    #: What the loader needs to know about the family's DiT (quantization, LoRA and single-file support).
    dit_facts: DitFacts
    #: Other spellings of `name` accepted on input (resolved by `family_by_name` only).
    aliases: tuple[str, ...] = ()
    #: `--enable-cuda-graph` opt-in: how the DiT's calls are padded to a captured (batch, token) bucket
    #: (`runtime/cuda_graph/padders.py`); None: the family runs eager only, and the flag is refused.
    prompt_padder: PromptPadder | None = None
    #: Other tiny checkpoints `diffserve make-tiny NAME DIR` writes for this family, as (NAME, builder)
    #: pairs: add-on models that are no family of their own (a FLUX.1 ControlNet folder). A NAME is unique
    #: among every family's names, aliases and extra builders (the registry checks).
    extra_tiny_builders: tuple[tuple[str, TinyCheckpointBuilder], ...] = ()

    @property
    def step_cache_policies(self) -> Mapping[str, StepCachePolicy]:
        """The approximate quality tiers the family serves with their default step-cache thresholds (empty:
        only "high", the exact path). They are measured per pipeline, so they live on the pipeline class; a
        model folder's calibration file overrides them (`configs/quality.py`)."""
        return self.pipeline_cls.step_cache_policies
