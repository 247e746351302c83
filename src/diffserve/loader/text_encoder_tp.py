"""Loading a large transformers text encoder as one tensor-parallel rank's shard: the model is built with
this rank's shards of its attention and MLP layers, and reads only its slices of the safetensors files.

What is split (Megatron style, as the DiTs: `tensor_parallel.py`):

- `T5EncoderModel` (SD3, FLUX) and `UMT5EncoderModel` (Wan), per block: self-attention q/k/v
  column-parallel and o row-parallel, so each rank computes its heads (`n_heads` / `inner_dim` become
  the local counts, which the forward reshapes with); the relative position bias table, one column per
  head, split by head (`ColumnParallelEmbedding`; T5 has it in the first block and shares the bias, UMT5
  has one per block); the feed-forward's wi (or the gated wi_0 and wi_1) column-parallel, wo row-parallel.
- `Qwen3Model` (Z-Image) and the language model of `Qwen2_5_VLForConditionalGeneration` (Qwen-Image), per
  decoder layer: q/k/v_proj column-parallel (with their biases), o_proj row-parallel, the MLP's gate/up
  column-parallel and down row-parallel. Query and key/value heads are split by the same factor, so a
  rank keeps whole GQA groups (`num_key_value_groups` is unchanged); Qwen3's q/k norms act on one head's
  features and stay whole.

Every rank holds the rest whole: token embeddings, norms, and Qwen2.5-VL's vision tower and `lm_head` (the
pipelines use the hidden states, never the logits). CLIP encoders are small and not sharded at all.

Loading follows transformers' `from_pretrained` step by step, so that the shard holds exactly the
tensors of the whole model's slices:
- the model is built on the meta device in transformers' own init context (`get_init_context`: the
  default dtype set to `dtype`, tying deferred), with the config's dtype set as `from_pretrained` sets it;
- checkpoint keys are renamed by the model's conversion mapping (`get_model_conversion_mapping`: e.g. the
  `model.layers...` / `visual...` keys of Qwen2.5-VL checkpoints); a key that needs a tensor conversion
  (a `WeightConverter`: fused or split tensors) is refused, as a rank cannot read it as slices;
- each tensor takes its meta parameter's dtype, or float32 where `_keep_in_fp32_modules` asks for it
  (with float16: T5's `wo`);
- tied weights (T5's `encoder.embed_tokens.weight` and `shared.weight`) are tied by the model's
  `tie_weights`, whichever of the pair the checkpoint holds;
- the buffers no checkpoint holds (rotary `inv_freq`) are computed by the model's `initialize_weights`,
  which leaves every loaded tensor alone (transformers' `_is_hf_initialized` mark).
Unlike `from_pretrained`, a parameter the checkpoint lacks is an error rather than a random
initialisation; checkpoint keys the model has no place for are skipped (with a warning, except those the
class lists in `_keys_to_ignore_on_load_unexpected`, such as a T5 checkpoint's decoder).
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import transformers
from safetensors import SafetensorError
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    WeightConverter,
    WeightRenaming,
    build_glob_alternation,
    rename_source_key,
)
from transformers.monkey_patching import patch_output_recorders

from diffserve.distributed.parallel_embedding import ColumnParallelEmbedding, parallel_embedding_shards
from diffserve.errors import ModelLoadError
from diffserve.layers.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardSpec,
    TensorParallelRank,
    shard_linear,
    tensor_parallel_shards,
)
from diffserve.loader.owned_weights import open_safetensors, owned
from diffserve.loader.safetensors_weights import SafeFile, find_weight_files

logger = logging.getLogger("diffserve.loader")

_READ_ERRORS = (SafetensorError, OSError, ValueError)


def _check_divides(owner: str, count: int, what: str, tp: TensorParallelRank) -> None:
    if count % tp.tp_size:
        raise ValueError(
            f"--tp-size {tp.tp_size}: the {owner}'s {count} {what} do not divide over {tp.tp_size} "
            "tensor-parallel ranks"
        )


def _shard_t5_encoder(model: PreTrainedModel, tp: TensorParallelRank) -> None:
    """T5 / UMT5 encoder blocks: attention by heads (with the relative bias table's head columns), the
    feed-forward by its hidden features."""
    config, owner = model.config, type(model).__name__
    _check_divides(owner, config.num_heads, "attention heads (num_heads)", tp)
    _check_divides(owner, config.d_ff, "feed-forward features (d_ff)", tp)
    for block in model.encoder.block:
        attention = block.layer[0].SelfAttention
        for name in ("q", "k", "v"):
            shard_linear(attention, name, ColumnParallelLinear, tp)
        shard_linear(attention, "o", RowParallelLinear, tp)
        if attention.has_relative_attention_bias:
            attention.relative_attention_bias = ColumnParallelEmbedding.replacing(
                attention.relative_attention_bias, tp
            )
        attention.n_heads //= tp.tp_size
        attention.inner_dim //= tp.tp_size
        ffn = block.layer[-1].DenseReluDense
        for name in ("wi_0", "wi_1") if config.is_gated_act else ("wi",):
            shard_linear(ffn, name, ColumnParallelLinear, tp)
        shard_linear(ffn, "wo", RowParallelLinear, tp)


def _shard_qwen_layers(
    owner: str, layers: nn.ModuleList, config: PreTrainedConfig, tp: TensorParallelRank
) -> None:
    """Qwen decoder layers: attention by heads (query and key/value heads alike), the MLP by features."""
    _check_divides(owner, config.num_attention_heads, "attention heads (num_attention_heads)", tp)
    _check_divides(owner, config.num_key_value_heads, "key/value heads (num_key_value_heads)", tp)
    _check_divides(owner, config.intermediate_size, "MLP features (intermediate_size)", tp)
    for layer in layers:
        attention = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            shard_linear(attention, name, ColumnParallelLinear, tp)
        shard_linear(attention, "o_proj", RowParallelLinear, tp)
        # Qwen2.5-VL keeps its head counts (its forward reshapes with -1 heads; kept true all the same).
        for count in ("num_heads", "num_key_value_heads"):
            if hasattr(attention, count):
                setattr(attention, count, getattr(attention, count) // tp.tp_size)
        for name in ("gate_proj", "up_proj"):
            shard_linear(layer.mlp, name, ColumnParallelLinear, tp)
        shard_linear(layer.mlp, "down_proj", RowParallelLinear, tp)


def _shard_qwen3(model: PreTrainedModel, tp: TensorParallelRank) -> None:
    _shard_qwen_layers(type(model).__name__, model.layers, model.config, tp)


def _shard_qwen2_5_vl(model: PreTrainedModel, tp: TensorParallelRank) -> None:
    text = model.model.language_model
    _shard_qwen_layers(f"{type(model).__name__} language model", text.layers, text.config, tp)


_SHARDERS: dict[str, Callable[[PreTrainedModel, TensorParallelRank], None]] = {
    "T5EncoderModel": _shard_t5_encoder,
    "UMT5EncoderModel": _shard_t5_encoder,
    "Qwen3Model": _shard_qwen3,
    "Qwen2_5_VLForConditionalGeneration": _shard_qwen2_5_vl,
}

#: The transformers encoder classes loaded as TP shards -> what every rank still holds whole (for the log).
TENSOR_PARALLEL_ENCODERS: dict[str, str] = {
    "T5EncoderModel": "token embeddings and norms",
    "UMT5EncoderModel": "token embeddings and norms",
    "Qwen3Model": "token embeddings and norms",
    "Qwen2_5_VLForConditionalGeneration": "token embeddings, norms, vision tower and lm_head",
}


def _build_on_meta(cls: type[PreTrainedModel], path: Path, dtype: torch.dtype) -> PreTrainedModel:
    """`cls` from `path`'s config.json on the meta device, in the context `from_pretrained` builds it in."""
    config = cls.config_class.from_pretrained(str(path), local_files_only=True)
    config.name_or_path = str(path)
    config.dtype = dtype
    for key in config.sub_configs:
        if (sub_config := getattr(config, key)) is not None:
            sub_config.dtype = dtype
    with contextlib.ExitStack() as stack:
        for context in cls.get_init_context(dtype, False, False, False):
            stack.enter_context(context)
        model = cls(config)
        patch_output_recorders(model)
    built = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if not t.is_meta]
    if built:  # e.g. a DeepSpeed ZeRO-3 init context, which materialises the model
        raise RuntimeError(f"{cls.__name__} was not built on the meta device (e.g. {built[0]})")
    return model


def _describe(keys: Iterable[str], limit: int = 8) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > limit else "")


def _open(path: Path):
    try:
        return open_safetensors(path)
    except _READ_ERRORS as exc:
        raise ModelLoadError(f"cannot read {path}: the file is truncated or corrupt ({exc})") from exc


def _checkpoint_plan(model: PreTrainedModel, files: list[Path]) -> dict[Path, dict[str, str]]:
    """Per weights file: checkpoint key -> model state-dict key, renamed as `from_pretrained` renames
    them, for the keys the model has (the others are skipped, with a warning unless the class ignores
    them). Refuses keys that need a tensor conversion, and two keys for one parameter."""
    conversions = get_model_conversion_mapping(model)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    expected, prefix = model.state_dict(), model.base_model_prefix
    ignored = [re.compile(p) for p in model._keys_to_ignore_on_load_unexpected or ()]
    plan: dict[Path, dict[str, str]] = {}
    source_of: dict[str, str] = {}
    unexpected: list[str] = []
    for path in files:
        with _open(path) as f:
            keys = list(f.keys())
        plan[path] = {}
        for key in keys:
            target, converter = rename_source_key(key, renamings, converters, prefix, expected)
            if target not in expected and key in expected:  # as transformers: then only the prefix may change
                target, converter = rename_source_key(key, [], [], prefix, expected)
            if target not in expected:
                if not any(p.search(target) for p in ignored):
                    unexpected.append(key)
                continue
            if converter is not None:
                raise ModelLoadError(
                    f"{path}: tensor {key!r} needs transformers' weight conversion ({converter!r} -> {target}), "
                    "which a tensor-parallel rank cannot read as slices; load this checkpoint with --tp-size 1"
                )
            if target in source_of:
                raise ModelLoadError(
                    f"{path.parent}: checkpoint tensors {source_of[target]!r} and {key!r} both load into {target}"
                )
            source_of[target] = key
            plan[path][key] = target
    if unexpected:
        logger.warning(
            "%s: %s has no parameter for these checkpoint tensors, skipped: %s",
            files[0].parent, type(model).__name__, _describe(unexpected),
        )  # fmt: skip
    return plan


def _target_dtype(model: PreTrainedModel, dtype: torch.dtype) -> Callable[[str, torch.Tensor], torch.dtype]:
    """The dtype `from_pretrained` gives the tensor loaded into state-dict key `key` (meta tensor `empty`):
    float32 where the model's keep-in-fp32 plan names it, else the meta tensor's own."""
    plan = model._get_dtype_plan(dtype)
    if not plan:
        return lambda key, empty: empty.dtype
    alternation, group_to_pattern, _ = build_glob_alternation(list(plan))

    def target(key: str, empty: torch.Tensor) -> torch.dtype:
        match = alternation.search(key)
        return plan[group_to_pattern[match.lastgroup]] if match is not None else empty.dtype

    return target


def _read(f: SafeFile, key: str, spec: ShardSpec | None, path: Path) -> torch.Tensor:
    """Tensor `key` of an open safetensors file: whole, or only the ranges `spec` names."""
    if spec is None:
        return f.get_tensor(key)
    sliced = f.get_slice(key)
    if tuple(sliced.get_shape()) != spec.full_shape:
        raise ModelLoadError(
            f"{path}: tensor {key!r} has shape {tuple(sliced.get_shape())}, the model config expects "
            f"{spec.full_shape} (before tensor-parallel sharding)"
        )
    pieces = [sliced[index] for index in spec.indices()]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=spec.dim)


def _put(model: nn.Module, key: str, tensor: torch.Tensor) -> None:
    """Assign a loaded tensor to the parameter or buffer `key`, marked loaded for `initialize_weights`."""
    module_path, _, leaf = key.rpartition(".")
    module = model.get_submodule(module_path)
    if leaf in module._buffers:
        module._buffers[leaf] = tensor
    else:
        tensor = nn.Parameter(tensor, requires_grad=False)
        setattr(module, leaf, tensor)
    tensor._is_hf_initialized = True


def _load_weights(
    model: PreTrainedModel, files: list[Path], device: torch.device, dtype: torch.dtype
) -> tuple[set[str], int]:
    """Read every planned tensor of `files` into `model` (a sharded one: only this rank's slices), file by
    file. Returns the state-dict keys loaded and the bytes read."""
    plan = _checkpoint_plan(model, files)
    expected = model.state_dict()
    sharded = tensor_parallel_shards(model) | parallel_embedding_shards(model)
    target_dtype = _target_dtype(model, dtype)
    loaded, num_bytes = set(), 0
    for path, names in plan.items():
        with _open(path) as f:
            for key, target in names.items():
                try:
                    tensor = _read(f, key, sharded.get(target), path)
                except _READ_ERRORS as exc:
                    raise ModelLoadError(f"cannot read tensor {key!r} from {path}: {exc}") from exc
                if tensor.shape != expected[target].shape:
                    raise ModelLoadError(
                        f"{path}: tensor {key!r} has shape {tuple(tensor.shape)}, the model config expects "
                        f"{tuple(expected[target].shape)}"
                    )
                num_bytes += tensor.numel() * tensor.element_size()
                _put(model, target, owned(tensor, device, target_dtype(target, expected[target])))
                loaded.add(target)
    return loaded, num_bytes


def _finish(model: PreTrainedModel, loaded: set[str], device: torch.device, path: Path) -> None:
    """Tie the tied weights, compute the non-persistent buffers, as `from_pretrained` does after reading."""
    missing = set(model.state_dict()) - loaded
    model.tie_weights(missing_keys=missing, recompute_mapping=False)  # drops the tied ones from `missing`
    if missing:
        raise ModelLoadError(
            f"weights in {path} do not match {type(model).__name__}: missing keys: {_describe(missing)}"
        )
    for key, buffer in model.named_non_persistent_buffers():
        module_path, _, leaf = key.rpartition(".")
        model.get_submodule(module_path)._buffers[leaf] = torch.empty_like(buffer, device=device)
    model.initialize_weights()  # only what no checkpoint tensor set: here, those buffers
    still_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if still_meta:
        raise ModelLoadError(f"{type(model).__name__}: tensors left uninitialised: {_describe(still_meta)}")


def load_tensor_parallel_encoder(
    class_name: str, path: Path, device: torch.device, dtype: torch.dtype, tp: TensorParallelRank
) -> tuple[PreTrainedModel, int]:
    """Transformers encoder `class_name` (one of `TENSOR_PARALLEL_ENCODERS`) from folder `path` as TP rank
    `tp.tp_rank`'s shard, on `device` in `dtype` (as `from_pretrained(path, dtype=dtype)` would give it,
    sharded), in eval mode without gradients. Returns the model and the bytes read from disk.

    Heads, key/value heads or MLP widths that do not divide `tp.tp_size` are a ValueError naming them and
    --tp-size; broken or mismatched weights a `ModelLoadError`."""
    if class_name not in _SHARDERS:
        raise ValueError(
            f"{class_name} has no tensor-parallel loading; supported: {', '.join(sorted(_SHARDERS))}"
        )
    model = _build_on_meta(getattr(transformers, class_name), path, dtype)
    _SHARDERS[class_name](model, tp)
    loaded, num_bytes = _load_weights(model, find_weight_files(path), device, dtype)
    _finish(model, loaded, device, path)
    return model.eval().requires_grad_(False), num_bytes
