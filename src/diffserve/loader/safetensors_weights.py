"""Streaming Diffusers safetensors weights (single file or sharded) into a module built on `meta`.

A module holding tensor-parallel layers (`layers/tensor_parallel.py`) gets only its rank's part of
each sharded tensor: those ranges are read with safetensors' `get_slice`, never the whole tensor.
Every tensor is read into memory the engine owns (`loader/owned_weights.py`): nothing loaded stays a
view of its file's pages, so a file rewritten or truncated after the load changes nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

import torch
from safetensors import SafetensorError
from torch import nn

from diffserve.errors import ModelLoadError
from diffserve.layers.tensor_parallel import ShardSpec, tensor_parallel_shards
from diffserve.loader.owned_weights import open_safetensors, owned

_WEIGHT_NAMES = ("diffusion_pytorch_model", "model")
_READ_ERRORS = (SafetensorError, OSError, ValueError)


def find_weight_files(component_dir: Path) -> list[Path]:
    """The safetensors files of a component: an index's shards, or the single weights file."""
    for stem in _WEIGHT_NAMES:
        index = component_dir / f"{stem}.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise ModelLoadError(f"{index} is not a valid safetensors index: {exc}") from exc
            shards = sorted({component_dir / name for name in weight_map.values()})
            absent = [s.name for s in shards if not s.is_file()]
            if absent:
                raise ModelLoadError(f"{index} lists shards that are missing: {', '.join(absent)}")
            return shards
        single = component_dir / f"{stem}.safetensors"
        if single.is_file():
            return [single]
    others = sorted(p.name for p in component_dir.glob("*.bin")) if component_dir.is_dir() else []
    hint = f" (found {', '.join(others)}: only .safetensors weights are supported)" if others else ""
    raise ModelLoadError(f"no safetensors weights in {component_dir}{hint}")


class SafeSlice(Protocol):
    """What `safe_open(...).get_slice(name)` returns: the tensor's shape, and basic indexing that reads
    only the indexed bytes."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor: ...


class SafeFile(Protocol):
    """An open safetensors file (`safe_open(..., framework="pt")`), as the loader reads it."""

    def keys(self) -> list[str]: ...

    def get_tensor(self, name: str) -> torch.Tensor: ...

    def get_slice(self, name: str) -> SafeSlice: ...


def _open(path: Path):
    try:
        return open_safetensors(path)
    except _READ_ERRORS as exc:
        raise ModelLoadError(f"cannot read {path}: the file is truncated or corrupt ({exc})") from exc


def _describe(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > limit else "")


def _read_tensor(f: SafeFile, key: str, spec: ShardSpec | None, path: Path) -> torch.Tensor:
    """Tensor `key` of the open file: whole, or only the ranges `spec` names (this rank's shard)."""
    if spec is None:
        return f.get_tensor(key)
    sliced = f.get_slice(key)
    full_shape = tuple(sliced.get_shape())
    if full_shape != spec.full_shape:
        raise ModelLoadError(
            f"{path}: tensor {key!r} has shape {full_shape}, the model config expects {spec.full_shape} "
            "(before tensor-parallel sharding)"
        )
    pieces = [sliced[index] for index in spec.indices()]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=spec.dim)


def load_safetensors_into(
    module: nn.Module, files: list[Path], device: torch.device, dtype: torch.dtype
) -> int:
    """Assign every tensor of `files` into `module` (built on meta), shard by shard. Returns bytes read.

    Checkpoint and module must have the same keys and shapes (else a `ModelLoadError` names them).
    Floating-point tensors are cast to `dtype`; integer tensors keep theirs. Only one shard's tensors are
    held at a time, so peak host memory stays near the largest shard. A tensor-parallel layer's weights
    are read as its rank's slices only (the bytes returned count what was read).
    """
    sharded = tensor_parallel_shards(module)
    expected_shapes = {k: v.shape for k, v in module.state_dict().items()}
    file_keys: set[str] = set()
    for path in files:
        with _open(path) as f:
            file_keys.update(f.keys())
    missing = sorted(expected_shapes.keys() - file_keys)
    unexpected = sorted(file_keys - expected_shapes.keys())
    if missing or unexpected:
        parts = [f"missing keys: {_describe(missing)}"] if missing else []
        parts += [f"unexpected keys: {_describe(unexpected)}"] if unexpected else []
        raise ModelLoadError(
            f"weights in {files[0].parent} do not match {type(module).__name__}: " + "; ".join(parts)
        )

    total_bytes = 0
    for path in files:
        shard: dict[str, torch.Tensor] = {}
        with _open(path) as f:
            for key in f.keys():  # noqa: SIM118  (safe_open is not a Mapping)
                try:
                    tensor = _read_tensor(f, key, sharded.get(key), path)
                except _READ_ERRORS as exc:
                    raise ModelLoadError(f"cannot read tensor {key!r} from {path}: {exc}") from exc
                if tensor.shape != expected_shapes[key]:
                    raise ModelLoadError(
                        f"{path}: tensor {key!r} has shape {tuple(tensor.shape)}, "
                        f"the model config expects {tuple(expected_shapes[key])}"
                    )
                total_bytes += tensor.numel() * tensor.element_size()
                target_dtype = dtype if tensor.is_floating_point() else tensor.dtype
                shard[key] = owned(tensor, device, target_dtype)
        module.load_state_dict(shard, strict=False, assign=True)
    still_meta = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    if still_meta:
        raise ModelLoadError(f"{type(module).__name__}: tensors left uninitialised: {_describe(still_meta)}")
    return total_bytes
