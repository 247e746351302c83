"""`--transformer-weights PATH`: the DiT's weights from one single-file checkpoint instead of the
folder's `transformer/` safetensors (the rest of the pipeline still comes from the folder).

Accepted files (docs/memory.md):
- `.safetensors` in the family's original names, as Diffusers' single-file loader converts them (BFL's
  FLUX, Stability's SD3, Wan's, Z-Image's; Qwen-Image's originals already use Diffusers' names) or in
  Diffusers' names, optionally inside ComfyUI's `model.diffusion_model.` prefix; full precision, or
  pre-quantized FP8 as ComfyUI / Kijai publish it (plain e4m3fn / e5m2 casts, or with per-tensor or
  per-row `scale_weight` / `weight_scale` scales): FP8 weights are dequantized to the model's dtype at
  load (`--quantization fp8` re-quantizes them afterwards, per output channel).
- `.gguf` (city96's layout: original names, or Diffusers' names; F32, F16, BF16, Q8_0, Q5_0, Q4_0,
  Q5_K, Q4_K, and any other type gguf-py dequantizes): every tensor is dequantized at load into the
  model's dtype, one at a time (`single_file_readers/gguf_file.py`); the loaded DiT holds
  full-precision weights, so GGUF saves disk and download, not device memory.

The file's names, shapes and types are all checked against the model before any tensor data is read:
a file of another family, a truncated or foreign file, or one whose shapes disagree with the folder's
config is a `ModelLoadError` naming the missing / unexpected keys. The weights load unfused, in
Diffusers' names; the loader then fuses (FLUX's QKV) and quantizes as it does for folder weights.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

from diffserve.distributed.tensor_parallel import tensor_parallel_shards
from diffserve.errors import ModelLoadError
from diffserve.loader.dit_facts import DitFactsTable
from diffserve.loader.single_file_keys.plan import Piece
from diffserve.loader.single_file_keys.prefix import DIT_PREFIX, strip_dit_prefix
from diffserve.loader.single_file_keys.validate import choose_plan, plan_problems
from diffserve.loader.single_file_readers.gguf_file import GgufSource
from diffserve.loader.single_file_readers.safetensors_file import SafetensorsSource
from diffserve.loader.single_file_readers.source import TensorSource

logger = logging.getLogger("diffserve.loader")


def open_weights_file(path: Path) -> TensorSource:
    """The checkpoint at `path` as a `TensorSource`, by suffix (`.safetensors` or `.gguf`)."""
    if not path.is_file():
        raise ModelLoadError(f"transformer weights {str(path)!r} do not exist or are not a file")
    if path.suffix == ".gguf":
        return GgufSource(path)
    if path.suffix == ".safetensors":
        return SafetensorsSource(path)
    raise ModelLoadError(f"transformer weights must be a .safetensors or .gguf file, got {path.name!r}")


def load_transformer_weights_file(
    module: nn.Module,
    path: Path,
    dit_class: str,
    device: torch.device,
    dtype: torch.dtype,
    facts: DitFactsTable,
) -> int:
    """Fill the (meta) DiT `module` of class `dit_class` from the single file `path`, cast to `dtype` on
    `device`; `facts` (the registry's `DIT_FACTS`) says how the family's files are named. Returns the
    bytes read from the file."""
    path = Path(path)
    keys = facts.single_file(dit_class)
    if keys is None:
        raise ModelLoadError(
            f"--transformer-weights is not supported for {dit_class} "
            f"(supported: {', '.join(facts.single_file_classes())})"
        )
    if tensor_parallel_shards(module):
        raise ModelLoadError("--transformer-weights cannot be combined with tensor parallelism yet")
    source = open_weights_file(path)
    try:
        stored_shapes = source.shapes()
        names, others = strip_dit_prefix(stored_shapes)
        shapes = {name: stored_shapes[stored] for name, stored in names.items()}
        model_shapes = {k: tuple(v.shape) for k, v in module.state_dict().items()}
        chosen = choose_plan(keys, shapes, frozenset(model_shapes))
        problem = plan_problems(chosen, shapes, model_shapes, keys, facts, source.arch)
        if problem is not None:
            raise ModelLoadError(
                f"{path} does not fit the folder's {dit_class} (read in {chosen.naming}; {source.description}): "
                + problem
            )
        total = _assign(module, chosen.plan, source, names, device, dtype)
    finally:
        source.close()
    if others:
        logger.info(
            "%s: %d tensors outside %s (other components) were not loaded", path.name, others, DIT_PREFIX
        )
    logger.info(
        "transformer weights from %s: %s; read in %s, %s into %s (%.1f MB read)",
        path.name,
        source.description,
        chosen.naming,
        source.mode,
        str(dtype).removeprefix("torch."),
        total / 1e6,
    )
    return total


def _assign(
    module: nn.Module,
    plan: dict[str, Piece],
    source: TensorSource,
    names: dict[str, str],
    device: torch.device,
    dtype: torch.dtype,
) -> int:
    """Read each file tensor once, cut it into its plan pieces, assign them. Returns bytes read."""
    by_source: dict[str, list[tuple[str, Piece]]] = defaultdict(list)
    for target, piece in plan.items():
        by_source[piece.source].append((target, piece))
    state: dict[str, torch.Tensor] = {}
    total = 0
    for name, pieces in by_source.items():
        tensor = source.read(names[name])
        total += source.stored_bytes(names[name])
        for target, piece in pieces:
            value = piece.take(tensor)
            target_dtype = dtype if value.is_floating_point() else value.dtype
            state[target] = value.to(device=device, dtype=target_dtype).contiguous()
        del tensor
    module.load_state_dict(state, strict=False, assign=True)
    still_meta = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    if still_meta:
        raise ModelLoadError(
            f"{type(module).__name__}: tensors left uninitialised: {', '.join(still_meta[:8])}"
        )
    return total
