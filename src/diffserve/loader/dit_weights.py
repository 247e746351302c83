"""Where the DiT's weights come from and what is done to them at load (docs/memory.md): the folder's
safetensors, a single-file checkpoint (`--transformer-weights`: original-key safetensors or GGUF,
`loader/single_file.py`), or, under `--max-memory`, the folder's files memory-mapped and streamed per
block (`loader/mmap_weights.py`); then weight-only quantization (`--quantization`, `loader/quantize.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from diffserve.loader.dit_facts import DitFactsTable
from diffserve.loader.mmap_weights import load_mmapped_into
from diffserve.loader.model_index import ComponentSpec
from diffserve.loader.quantize import quantize_dit
from diffserve.loader.safetensors_weights import find_weight_files, load_safetensors_into
from diffserve.loader.single_file import load_transformer_weights_file


@dataclass(frozen=True)
class DitLoadOptions:
    """What the engine args ask of the DiT's weights (the defaults: the folder's, as they are)."""

    transformer_weights: Path | None = None  # a single-file checkpoint replacing the folder's weights
    quantization: str | None = None  # "int8" / "fp8": weight-only, after loading (and fusing)
    mmap_weights: bool = False  # keep the weights in their (memory-mapped) files: `--max-memory`
    #: The DiTs' facts (the registry's `DIT_FACTS`): how single files are named, what stays in full precision.
    facts: DitFactsTable = DitFactsTable(())


def load_dit_weights(
    module: nn.Module, spec: ComponentSpec, device: torch.device, dtype: torch.dtype, options: DitLoadOptions
) -> int:
    """Fill the (meta) DiT `module` from the source `options` names; returns the bytes read."""
    if options.transformer_weights is not None:
        return load_transformer_weights_file(
            module, options.transformer_weights, spec.class_name, device, dtype, options.facts
        )
    files = find_weight_files(spec.path)
    if options.mmap_weights:
        return load_mmapped_into(module, files, dtype)
    return load_safetensors_into(module, files, device, dtype)


def finish_dit(module: nn.Module, spec: ComponentSpec, options: DitLoadOptions) -> None:
    """After loading and fusing: quantize the DiT's Linears if asked."""
    if options.quantization is not None:
        quantize_dit(module, options.quantization, spec.class_name, options.facts)
