"""Loading each component of a Diffusers folder: native models, schedulers, transformers encoders
and tokenizers, with the per-component log line users know from SGLang Diffusion."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from torch import nn

from diffserve.errors import ModelLoadError
from diffserve.layers.custom_op import dispatch_custom_ops
from diffserve.loader.model_index import ComponentSpec, ModelIndex
from diffserve.loader.native_classes import (
    TRANSFORMERS_ENCODERS,
    TRANSFORMERS_IMAGE_PROCESSORS,
    TRANSFORMERS_PROCESSORS,
    TRANSFORMERS_TOKENIZERS,
    NativeClasses,
    NativeModelClass,
    NativeSchedulerClass,
)
from diffserve.loader.processors import load_image_text_processor
from diffserve.loader.safetensors_weights import find_weight_files, load_safetensors_into
from diffserve.platforms import Platform

logger = logging.getLogger("diffserve.loader")


@dataclass
class LoadedComponent:
    name: str
    class_name: str
    value: Any
    num_params: int
    num_bytes: int
    seconds: float


def _read_json(path) -> dict[str, Any]:
    if not path.is_file():
        raise ModelLoadError(f"missing {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc


def _module_size(module: nn.Module) -> tuple[int, int]:
    tensors = list(module.parameters()) + list(module.buffers())
    return sum(t.numel() for t in module.parameters()), sum(t.numel() * t.element_size() for t in tensors)


def load_native_model(
    spec: ComponentSpec, cls: NativeModelClass, platform: Platform, dtype: torch.dtype
) -> tuple[nn.Module, int]:
    """Build the native module `cls` (the family's class for `spec`) on meta from config.json, stream its
    safetensors in onto `platform`'s device, and bind its `CustomOp`s to `platform`. Returns the module
    and the bytes read from disk."""
    config = _read_json(spec.path / "config.json")
    try:
        with torch.device("meta"):
            module = cls.from_config(config)
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{spec.path / 'config.json'}: {exc}") from exc
    num_bytes = load_safetensors_into(module, find_weight_files(spec.path), platform.device(), dtype)
    module.eval().requires_grad_(False)
    # Inference-only rearrangements that need the loaded weights (e.g. fused QKV projections); the
    # model logs what it fused and keeps its checkpoint names.
    fuse = getattr(module, "fuse_for_inference", None)
    if fuse is not None:
        fuse()
    # The models build their CustomOps without a platform; bind them (fused ones included) to this one.
    dispatch_custom_ops(module, platform)
    return module, num_bytes


def load_scheduler(spec: ComponentSpec, cls: NativeSchedulerClass) -> object:
    """The native scheduler `cls` built from the component's scheduler_config.json."""
    config = _read_json(spec.path / "scheduler_config.json")
    try:
        return cls.from_config(config)
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{spec.path / 'scheduler_config.json'}: {exc}") from exc


def load_text_encoder(spec: ComponentSpec, device: torch.device, dtype: torch.dtype) -> nn.Module:
    cls = getattr(transformers, spec.class_name)
    try:
        model = cls.from_pretrained(str(spec.path), dtype=dtype, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load {spec.class_name} from {spec.path}: {exc}") from exc
    return model.to(device).eval().requires_grad_(False)


def load_tokenizer(spec: ComponentSpec) -> Any:
    for candidate in TRANSFORMERS_TOKENIZERS[spec.class_name]:
        cls = getattr(transformers, candidate, None)
        if cls is not None:
            break
    else:  # pragma: no cover - every supported transformers version has one of them
        raise ModelLoadError(f"this transformers version has no tokenizer class for {spec.class_name}")
    try:
        return cls.from_pretrained(str(spec.path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load tokenizer {spec.class_name} from {spec.path}: {exc}") from exc


def load_processor(spec: ComponentSpec) -> Any:
    """A Qwen2-VL processor for Qwen-Image-Edit (see `loader/processors.py`: built without its video half)."""
    try:
        return load_image_text_processor(spec.class_name, spec.path)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load processor {spec.class_name} from {spec.path}: {exc}") from exc


def load_image_processor(spec: ComponentSpec) -> Any:
    try:
        return getattr(transformers, spec.class_name).from_pretrained(str(spec.path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"cannot load image processor {spec.class_name} from {spec.path}: {exc}"
        ) from exc


def _is_supported(spec: ComponentSpec, native: NativeClasses) -> bool:
    """Whether the loader has a way to load this component for this family."""
    if spec.library == "transformers":
        return (
            spec.class_name in TRANSFORMERS_ENCODERS
            or spec.class_name in TRANSFORMERS_TOKENIZERS
            or spec.class_name in TRANSFORMERS_PROCESSORS
            or spec.class_name in TRANSFORMERS_IMAGE_PROCESSORS
        )
    return spec.library == "diffusers" and spec.class_name in native.class_names()


def _supported_summary(native: NativeClasses) -> str:
    names = sorted(
        native.class_names()
        | TRANSFORMERS_ENCODERS
        | set(TRANSFORMERS_TOKENIZERS)
        | TRANSFORMERS_PROCESSORS
        | TRANSFORMERS_IMAGE_PROCESSORS
    )
    return ", ".join(names)


def load_component(
    spec: ComponentSpec,
    native: NativeClasses,
    platform: Platform,
    dtype: torch.dtype,
    text_encoder_dtype: torch.dtype,
) -> LoadedComponent:
    """Load one component and log it: class, parameter count, size, time, available memory. A Diffusers
    component is built from the family's `native` table; a transformers one by transformers."""
    device = platform.device()
    logger.info("Loading %s (%s) from %s", spec.name, spec.class_name, spec.path)
    start = time.perf_counter()
    num_params = num_bytes = 0
    if not spec.path.is_dir():
        raise ModelLoadError(f"component folder {spec.path} named in model_index.json does not exist")
    if spec.library == "diffusers" and spec.class_name in native.models:
        value, _ = load_native_model(spec, native.models[spec.class_name], platform, dtype)
        num_params, num_bytes = _module_size(value)
    elif spec.library == "diffusers" and spec.class_name in native.schedulers:
        value = load_scheduler(spec, native.schedulers[spec.class_name])
    elif spec.library == "transformers" and spec.class_name in TRANSFORMERS_ENCODERS:
        value = load_text_encoder(spec, device, text_encoder_dtype)
        num_params, num_bytes = _module_size(value)
    elif spec.library == "transformers" and spec.class_name in TRANSFORMERS_TOKENIZERS:
        value = load_tokenizer(spec)
    elif spec.library == "transformers" and spec.class_name in TRANSFORMERS_PROCESSORS:
        value = load_processor(spec)
    elif spec.library == "transformers" and spec.class_name in TRANSFORMERS_IMAGE_PROCESSORS:
        value = load_image_processor(spec)
    else:
        raise ModelLoadError(
            f"component {spec.name!r} has class {spec.library}.{spec.class_name}, which diffserve does not "
            f"support for this pipeline; supported component classes: {_supported_summary(native)}"
        )
    platform.synchronize()
    seconds = time.perf_counter() - start
    avail = platform.memory_info().available_bytes
    avail_text = f", avail mem: {avail / 2**30:.2f} GB" if avail is not None else ""
    params_text = f", {num_params / 1e6:.2f}M params" if num_params else ""
    logger.info(
        "Loaded %s: %s (diffserve %s)%s, model size: %.3f GB, in %.2f s%s",
        spec.name,
        spec.class_name,
        "native" if spec.library == "diffusers" else "via transformers",
        params_text,
        num_bytes / 2**30,
        seconds,
        avail_text,
    )
    return LoadedComponent(spec.name, spec.class_name, value, num_params, num_bytes, seconds)


def load_components(
    index: ModelIndex,
    required: tuple[str, ...],
    native: NativeClasses,
    platform: Platform,
    dtype: torch.dtype,
    text_encoder_dtype: torch.dtype,
    optional: tuple[str, ...] = (),
) -> dict[str, LoadedComponent]:
    """Load the components a pipeline requires, in a fixed order; absent ones are an error.
    `optional` components are loaded when the folder has them and logged as skipped when not.
    `native` is the family's table of native classes (its registry record's): every Diffusers
    component must be in it, which is checked for all components before any is loaded."""
    absent = [name for name in required if name not in index.components]
    if absent:
        raise ModelLoadError(
            f"{index.root / 'model_index.json'} lacks components the {index.pipeline_class_name} pipeline "
            f"needs: {', '.join(absent)}"
        )
    unused = sorted(set(index.components) - set(required) - set(optional))
    if unused:
        raise ModelLoadError(
            f"{index.root / 'model_index.json'} names components diffserve's {index.pipeline_class_name} "
            f"does not use: {', '.join(unused)}. Running without them would not give what diffusers gives "
            "for this folder, so it is refused (for Wan, `transformer_2` marks a Wan 2.2 two-expert "
            "checkpoint, which diffserve does not support yet)"
        )
    present_optional = tuple(name for name in optional if name in index.components)
    skipped = [name for name in optional if name not in index.components]
    if skipped:
        logger.info("Optional components not in this folder (the pipeline runs without them): %s", skipped)
    names = required + present_optional
    refused = [index.components[name] for name in names if not _is_supported(index.components[name], native)]
    if refused:
        classes = ", ".join(f"{spec.name!r} ({spec.library}.{spec.class_name})" for spec in refused)
        raise ModelLoadError(
            f"{index.root / 'model_index.json'} names component classes diffserve's "
            f"{index.pipeline_class_name} does not support: {classes}; supported component classes: "
            f"{_supported_summary(native)}"
        )
    logger.info("Loading components: %s", list(names))
    return {
        name: load_component(index.components[name], native, platform, dtype, text_encoder_dtype)
        for name in names
    }
