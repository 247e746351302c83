"""The scaffolding of the LoRA parity tests against Diffusers (`tests/e2e/test_lora_parity_*.py`): per family,
one tiny folder, diffserve's `DiffGenerator` and Diffusers' pipeline on it with the same adapters loaded
(`load_lora` + per-request `loras=[...]` against `load_lora_weights` + `set_adapters(names, weights)`),
base outputs taken before any adapter was, and the checks every such test makes: a LoRA generation matches
Diffusers' and visibly changes the output; a request without LoRA after LoRA requests is the base, bit for
bit."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from diffusers.pipelines.pipeline_utils import DiffusionPipeline

from diffserve.testing.image_metrics import psnr_uint8 as psnr
from diffserve.testing.parity import assert_images_match, diffusers_uint8, stack_uint8
from diffserve.testing.tiny_lora import BLOCK_LINEARS, write_random_lora
from diffserve.testing.tiny_lora_original import FileModule, Layout, Suffix, write_original_lora


class Generator(Protocol):
    """What the suite uses of a `DiffGenerator` (passed in: `testing` is imported by the families' tiny
    builders, so it may not import the API; the package graph stays acyclic)."""

    def generate(self, *args: Any, **kwargs: Any) -> Any: ...

    def load_lora(self, name: str, path: Any, *args: Any, **kwargs: Any) -> Any: ...


class GeneratorClass(Protocol):
    """`DiffGenerator` itself: how the suite builds one."""

    def from_pretrained(self, root: Any, **kwargs: Any) -> Generator: ...


PSNR_BAR_DB = 40.0
#: A LoRA output must be further than this from the base output (and the second adapter's output from
#: the first's alone), so that matching Diffusers at PSNR_BAR_DB shows the adapter was applied right.
CHANGED_BAR_DB = 32.0
PROMPT = "a red fox in the snow"
SEED = 3
RANK = 4
#: The `.alpha` of the non-Diffusers files' modules, in turn: none equals RANK, and they differ per module.
ALPHAS = (2.0, 8.0, 3.0)
STD = 0.2  # of the random LoRA factors: large enough that every adapter visibly changes the output
ONE = (("a", 0.8),)
TWO = (("a", 0.8), ("b", 0.5))

Loras = tuple[tuple[str, float], ...]
#: (model folder, LoRA folder) -> the family's non-Diffusers files, by adapter name
OriginalFiles = Callable[[Path, Path], dict[str, Path]]


def no_files(root: Path, out: Path) -> dict[str, Path]:
    return {}


def float32_pipeline(cls: type[DiffusionPipeline]) -> Callable[[Path], DiffusionPipeline]:
    """Diffusers' pipeline class `cls` loaded from a folder in float32."""
    return lambda root: cls.from_pretrained(root, torch_dtype=torch.float32)


def write_original(modules: list[FileModule], path: Path, layout: Layout, suffix: Suffix, seed: int) -> Path:
    """A non-Diffusers (kohya / `diffusion_model.`) file at these tests' rank, alphas and spread."""
    return write_original_lora(modules, path, layout, suffix, rank=RANK, alphas=ALPHAS, seed=seed, std=STD)


@dataclass(frozen=True)
class Family:
    """How to build, run and LoRA-load one family; `request`: generation arguments both sides take."""

    build: Callable[[Path], Path]
    #: Diffusers' pipeline on the built folder
    reference: Callable[[Path], DiffusionPipeline]
    request: dict[str, object]
    original_files: OriginalFiles = no_files
    #: the names `original_files` gives its files (the test ids), in order
    originals: tuple[str, ...] = ()
    video: bool = False
    #: an input image, which diffserve takes as `input_images` and Diffusers as `image`
    image: object = None

    def generate(self, ours: Generator, loras: Loras) -> np.ndarray:
        """diffserve's output with adapters `loras`, as uint8."""
        image = {} if self.image is None else {"input_images": [self.image]}
        out = ours.generate(
            prompt=PROMPT,
            seed=SEED,
            loras=[{"name": n, "scale": s} for n, s in loras],
            **image,
            **self.request,
        )
        return stack_uint8(out.frames if self.video else out.images)

    def reference_output(self, pipe: DiffusionPipeline) -> np.ndarray:
        """Diffusers' output with the adapters `pipe` has set, as uint8."""
        image = {} if self.image is None else {"image": self.image}
        return diffusers_uint8(pipe, seed=SEED, video=self.video, prompt=PROMPT, **image, **self.request)


@dataclass
class Engines:
    """One family's two pipelines with every adapter loaded, and the base outputs taken before any adapter
    was (Diffusers' where the suite compares it); diffserve's LoRA outputs are kept per adapter set (each
    is generated once)."""

    family: Family
    root: Path
    ours: Generator
    reference: DiffusionPipeline
    ours_base: np.ndarray
    reference_base: np.ndarray | None
    _ours_outputs: dict[Loras, np.ndarray] = field(default_factory=dict)

    def run_ours(self, loras: Loras) -> np.ndarray:
        if loras not in self._ours_outputs:
            self._ours_outputs[loras] = self.family.generate(self.ours, loras)
        return self._ours_outputs[loras]

    def run_reference(self, loras: Loras) -> np.ndarray:
        names = [name for name, _ in loras]
        self.reference.set_adapters(names, adapter_weights=[scale for _, scale in loras])
        return self.family.reference_output(self.reference)


@dataclass(frozen=True)
class Suite:
    """One test module's families and how it starts them: adapter "a" (rank RANK, alpha 8 in
    `lora_adapter_metadata`) on the Linears `a_pattern` matches, "b" (rank 2, no metadata: alpha = rank)
    on those `b_pattern` matches, then each family's non-Diffusers files."""

    #: `DiffGenerator` (passed in, see `Generator`)
    generator_cls: GeneratorClass
    families: dict[str, Family]
    a_pattern: re.Pattern[str] = BLOCK_LINEARS
    b_pattern: re.Pattern[str] = BLOCK_LINEARS
    #: also take Diffusers' base output, which a request without LoRA after LoRA requests must match
    reference_base: bool = True
    #: `DiffGenerator.from_pretrained` arguments beyond the CPU device and no progress bar
    generator_kwargs: dict[str, Any] = field(default_factory=dict)

    def start(self, name: str, directory: Path) -> Engines:
        """Build `name`'s folder and LoRA files under `directory`, both pipelines, their base outputs,
        then load every adapter into both."""
        family = self.families[name]
        root = family.build(directory / "model")
        loras = directory / "loras"
        files = {
            # PEFT layout, alpha 8 != rank 4 in `lora_adapter_metadata` (scaling 2)
            "a": write_random_lora(
                root, loras / "a.safetensors", rank=RANK, alpha=8.0, seed=1, std=STD, pattern=self.a_pattern
            ),
            # rank 2, no metadata: alpha = rank (larger factors, so that its share of TWO is large too)
            "b": write_random_lora(
                root, loras / "b.safetensors", rank=2, seed=2, std=1.5 * STD, pattern=self.b_pattern
            ),
            **family.original_files(root, loras),
        }
        assert tuple(files)[2:] == family.originals
        ours = self.generator_cls.from_pretrained(
            root, device="cpu", show_progress=False, **self.generator_kwargs
        )
        reference = family.reference(root)
        reference.set_progress_bar_config(disable=True)
        ours_base = family.generate(ours, ())
        reference_base = family.reference_output(reference) if self.reference_base else None
        engines = Engines(family, root, ours, reference, ours_base, reference_base)
        for adapter, path in files.items():
            ours.load_lora(adapter, path)
            reference.load_lora_weights(str(path), adapter_name=adapter)
        return engines

    @contextmanager
    def engines(self, mktemp: Callable[[str], Path]) -> Iterator[Callable[[str], Engines]]:
        """A family's `Engines` by name, started on first use (in a folder `mktemp(name)` makes) and kept
        until the context ends, which closes them: one for every family (a parametrized module fixture
        would be rebuilt for each differently parametrized test)."""
        started: dict[str, Engines] = {}

        def get(name: str) -> Engines:
            if name not in started:
                started[name] = self.start(name, mktemp(name))
            return started[name]

        try:
            yield get
        finally:
            for engines in started.values():
                engines.ours.close()

    def cases(self) -> list[tuple[str, Loras, str]]:
        """(family, adapters, test id) per parity case: ONE, TWO and each non-Diffusers file at 0.7."""
        cases: list[tuple[str, Loras, str]] = []
        for name, family in self.families.items():
            cases.append((name, ONE, f"{name}-one"))
            cases.append((name, TWO, f"{name}-two"))
            cases.extend((name, ((o, 0.7),), f"{name}-{o}") for o in family.originals)
        return cases


def check_generation_matches_diffusers(engines: Engines, label: str, loras: Loras) -> None:
    """diffserve's output with `loras` changes the base output by more than CHANGED_BAR_DB and matches
    Diffusers' at PSNR_BAR_DB; with two adapters, the second also changes the first's output that far."""
    ours = engines.run_ours(loras)
    reference = engines.run_reference(loras)
    assert ours.shape == reference.shape == engines.ours_base.shape
    changed = psnr(ours, engines.ours_base)
    print(f"{label} {loras}: {changed:.2f} dB against the base output")
    assert changed < CHANGED_BAR_DB, "the adapters barely change the output: the comparison proves nothing"
    assert_images_match(ours, reference, f"{label} {loras} against Diffusers", min_db=PSNR_BAR_DB)
    if len(loras) > 1:
        alone = psnr(ours, engines.run_ours(loras[:1]))
        print(f"  against {loras[0][0]} alone: {alone:.2f} dB")
        assert alone < CHANGED_BAR_DB, "the second adapter barely changes the output"


def check_no_lora_after_loras(engines: Engines, earlier: Iterable[Loras] = (TWO,)) -> None:
    """After requests with the adapter sets `earlier`, a request without LoRA is diffserve's base output bit
    for bit (and Diffusers' base output at PSNR_BAR_DB, where the suite took it)."""
    for loras in earlier:
        engines.run_ours(loras)
    after = engines.family.generate(engines.ours, ())
    assert np.array_equal(after, engines.ours_base)
    if engines.reference_base is not None:
        assert_images_match(after, engines.reference_base, "base after LoRA requests", min_db=PSNR_BAR_DB)


def check_adapter_matches(engines: Engines, ours: np.ndarray, reference: np.ndarray, label: str) -> None:
    """One adapter's output `ours` changes the base output and matches Diffusers' `reference`."""
    assert psnr(ours, engines.ours_base) < CHANGED_BAR_DB
    assert_images_match(ours, reference, label, min_db=PSNR_BAR_DB)
