"""`--transformer-weights PATH`: the DiT's weights from one single-file checkpoint instead of the
folder's `transformer/` safetensors (the rest of the pipeline still comes from the folder).

Accepted files (docs/memory.md):
- `.safetensors` in the family's original names, as Diffusers' single-file loader or conversion scripts
  convert them (BFL's FLUX, Stability's SD3, Wan's, Z-Image's, Tencent's HunyuanImage 2.1, ComfyUI's
  LongCat-Image in BFL's names; Qwen-Image's originals already use Diffusers' names) or in
  Diffusers' names, optionally inside ComfyUI's `model.diffusion_model.` prefix; full precision, or
  pre-quantized FP8 as ComfyUI / Kijai publish it (plain e4m3fn / e5m2 casts, or with per-tensor or
  per-row `scale_weight` / `weight_scale` scales): the e4m3 weights of the Linears `--quantization`
  would quantize stay FP8, one float32 scale per row, as weight-only `QuantizedLinear`s (the path of
  `--quantization fp8`); other FP8 tensors (e5m2, the embedders and output head the family keeps in full
  precision) are dequantized to the model's dtype at load.
- `.gguf` (city96's layout: original names, or Diffusers' names; F32, F16, BF16, Q8_0, Q5_0, Q4_0,
  Q5_K, Q4_K, and any other type gguf-py dequantizes): the Q8_0 and Q4_K weights of those same Linears
  stay in their blocks as `GGUFLinear`s (`layers/gguf_linear.py`), dequantized per layer as they run, so
  the DiT holds about the file's bytes; every other tensor is dequantized at load into the model's dtype,
  one at a time (`single_file_readers/gguf_file.py`), and the log counts them by type.

A DiT holding such quantized layers runs unfused (fusing concatenates full-precision weights); LoRA
adapters are refused on it (they need full-precision Linears), as is tensor parallelism.

The file's names, shapes and types are all checked against the model before any tensor data is read:
a file of another family, a truncated or foreign file, or one whose shapes disagree with the folder's
config is a `ModelLoadError` naming the missing / unexpected keys. The weights load unfused, in
Diffusers' names; the loader then fuses (FLUX's QKV; not with quantized layers) and quantizes (the
Linears left in full precision) as it does for folder weights. Every tensor is a copy the engine owns:
the file can change or vanish after the load without touching the model.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from diffserve.errors import ModelLoadError
from diffserve.layers.gguf_linear import quantized_layer_kinds
from diffserve.layers.tensor_parallel import tensor_parallel_shards
from diffserve.loader.dit_facts import DitFactsTable
from diffserve.loader.owned_weights import owned
from diffserve.loader.quantize import quantizable_linears, tensor_bytes
from diffserve.loader.single_file_keys.plan import Piece
from diffserve.loader.single_file_keys.prefix import DIT_PREFIX, strip_dit_prefix
from diffserve.loader.single_file_keys.validate import choose_plan, plan_problems
from diffserve.loader.single_file_readers.gguf_file import GgufSource
from diffserve.loader.single_file_readers.safetensors_file import SafetensorsSource
from diffserve.loader.single_file_readers.source import PackedWeight, TensorSource

logger = logging.getLogger("diffserve.loader")

#: Whether the weights a quantized layer runs as stored stay quantized (`dequantized_at_load` clears it).
_KEEP_QUANTIZED = True


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
        keep = frozenset(name for name, _ in quantizable_linears(module, dit_class, facts) if _KEEP_QUANTIZED)
        total, kept, dequantized = _assign(module, chosen.plan, source, names, device, dtype, keep)
    finally:
        source.close()
    if others:
        logger.info(
            "%s: %d tensors outside %s (other components) were not loaded", path.name, others, DIT_PREFIX
        )
    mode = source.mode
    if kept:
        counts = ", ".join(
            f"{'FP8' if kind == 'fp8' else 'GGUF ' + kind} x {n}" for kind, n in kept.most_common()
        )
        how = "FP8 weight-only" if set(kept) == {"fp8"} else "dequantized per layer as they run"
        mode = f"Linears kept quantized ({counts}; {how}), the rest {mode}"
    if dequantized:
        logger.info(
            "%s: quantized tensors dequantized at load into %s: %s (%s)",
            path.name,
            str(dtype).removeprefix("torch."),
            ", ".join(f"{kind} x {n}" for kind, n in dequantized.most_common()),
            "types without a per-layer kernel here, or in modules the family keeps in full precision"
            if _KEEP_QUANTIZED
            else "all of them: dequantized_at_load()",
        )
    logger.info(
        "transformer weights from %s: %s; read in %s, %s into %s (%.1f MB read; the DiT holds %.1f MB)",
        path.name,
        source.description,
        chosen.naming,
        mode,
        str(dtype).removeprefix("torch."),
        total / 1e6,
        tensor_bytes(module) / 1e6,
    )
    return total


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, copied when it is a part of a larger one (a fused file tensor's rows): each weight in
    its own storage, as offloading (which moves tensors storage by storage) needs."""
    whole = tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    return tensor if whole else tensor.clone()


@contextlib.contextmanager
def dequantized_at_load() -> Iterator[None]:
    """Within it, every quantized tensor of a single file is dequantized at load (no layer kept
    quantized): the reference the kept-quantized model is compared with (tests, `benchmarks/`)."""
    global _KEEP_QUANTIZED
    was, _KEEP_QUANTIZED = _KEEP_QUANTIZED, False
    try:
        yield
    finally:
        _KEEP_QUANTIZED = was


def holds_quantized_layers(module: nn.Module) -> bool:
    """Whether `module` computes with quantized layers (a GGUF or FP8 file kept quantized, or
    `--quantization`): then it is not fused."""
    return bool(quantized_layer_kinds(module))


def _assign(
    module: nn.Module,
    plan: dict[str, Piece],
    source: TensorSource,
    names: dict[str, str],
    device: torch.device,
    dtype: torch.dtype,
    keep: frozenset[str],
) -> tuple[int, Counter[str], Counter[str]]:
    """Read each file tensor once, cut it into its plan pieces, assign them; the weights of the Linears
    in `keep` that the source stores in a form a quantized layer runs (`packed_kind`) replace those
    Linears by quantized layers. Returns the bytes read, the layers kept quantized by kind and the
    quantized file tensors dequantized at load by type."""
    by_source: dict[str, list[tuple[str, Piece]]] = defaultdict(list)
    for target, piece in plan.items():
        by_source[piece.source].append((target, piece))
    state: dict[str, torch.Tensor] = {}
    packed_layers: dict[str, PackedWeight] = {}
    dequantized: Counter[str] = Counter()
    total = 0
    for name, pieces in by_source.items():
        stored = names[name]
        kind = source.packed_kind(stored)
        packed = [(t, p) for t, p in pieces if kind is not None and t.removesuffix(".weight") in keep]
        plain = [(t, p) for t, p in pieces if (t, p) not in packed]
        total += source.stored_bytes(stored)
        if packed:
            weight = source.read_packed(stored)
            for target, piece in packed:
                packed_layers[target.removesuffix(".weight")] = weight.take(piece).with_own_storage()
            del weight
        if plain:
            tensor = source.read(stored)
            if (stored_type := source.quantized_type(stored)) is not None:
                dequantized[stored_type] += 1
            for target, piece in plain:
                value = piece.take(tensor)
                target_dtype = dtype if value.is_floating_point() else value.dtype
                state[target] = _own_storage(owned(value, device, target_dtype).contiguous())
            del tensor
    module.load_state_dict(state, strict=False, assign=True)
    for layer_name, weight in packed_layers.items():
        parent_name, _, leaf = layer_name.rpartition(".")
        parent = module.get_submodule(parent_name)
        bias = getattr(parent, leaf).bias
        setattr(parent, leaf, weight.layer(bias, device))
    still_meta = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    if still_meta:
        raise ModelLoadError(
            f"{type(module).__name__}: tensors left uninitialised: {', '.join(still_meta[:8])}"
        )
    return total, Counter(w.kind for w in packed_layers.values()), +dequantized
