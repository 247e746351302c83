"""Loading the components of a Diffusers folder: native models and schedulers, transformers encoders,
tokenizers and processors, each logged with its size, load time and the memory left."""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

from diffserve.errors import ModelLoadError
from diffserve.layers.custom_op import dispatch_custom_ops
from diffserve.layers.tensor_parallel import TensorParallelRank
from diffserve.loader.dit_weights import DitLoadOptions, finish_dit, load_dit_weights
from diffserve.loader.model_index import ComponentSpec, ModelIndex, read_json
from diffserve.loader.native_classes import NativeClasses, NativeModelClass, NativeSchedulerClass
from diffserve.loader.owned_weights import detach_from_files
from diffserve.loader.processors import (
    TOKENIZER_ONLY_PROCESSORS,
    load_image_text_processor,
    load_named_image_processor,
    load_named_tokenizer,
    load_processor_tokenizer,
    transformers_role,
)
from diffserve.loader.single_file import holds_quantized_layers
from diffserve.loader.text_encoder_tp import TENSOR_PARALLEL_ENCODERS, load_tensor_parallel_encoder
from diffserve.platforms import Platform

logger = logging.getLogger("diffserve.loader")

#: transformers classes accepted as text encoders.
#: Tokenizers, processors and image processors are not listed: any class transformers has by that name
#: and that is one (`processors.transformers_role`) is accepted, so a folder saved by a newer transformers
#: (transformers 5 writes `TokenizersBackend` for a generic fast tokenizer, `CLIPImageProcessorPil`
#: without torchvision) loads. These tokenizer names are resolved to the first of their slow or fast
#: spellings that this transformers version has.
TRANSFORMERS_TOKENIZERS: dict[str, tuple[str, ...]] = {
    "CLIPTokenizer": ("CLIPTokenizerFast", "CLIPTokenizer"),
    "CLIPTokenizerFast": ("CLIPTokenizerFast", "CLIPTokenizer"),
    "T5Tokenizer": ("T5TokenizerFast", "T5Tokenizer"),
    "T5TokenizerFast": ("T5TokenizerFast", "T5Tokenizer"),
    "Qwen2Tokenizer": ("Qwen2TokenizerFast", "Qwen2Tokenizer"),
    "Qwen2TokenizerFast": ("Qwen2TokenizerFast", "Qwen2Tokenizer"),
    "GemmaTokenizer": ("GemmaTokenizerFast", "GemmaTokenizer"),
    "GemmaTokenizerFast": ("GemmaTokenizerFast", "GemmaTokenizer"),
    "ByT5Tokenizer": ("ByT5Tokenizer",),  # HunyuanVideo 1.5's glyph encoder (bytes; no fast class)
    # A generic tokenizer.json (e.g. a word-level vocabulary, as the shipped demo model uses).
    "PreTrainedTokenizerFast": ("PreTrainedTokenizerFast",),
}


def accepts_transformers_class(class_name: str, native: NativeClasses) -> bool:
    """Whether a model_index.json component of the transformers library may name `class_name`: one of the
    family's encoders (`NativeClasses.encoders`), or any tokenizer, processor or image processor class
    transformers has."""
    known = native.encoders.union(TRANSFORMERS_TOKENIZERS)
    return class_name in known or transformers_role(class_name) is not None


@dataclass
class LoadedComponent:
    """One loaded component: its model_index.json name and class, and the object the pipeline uses."""

    name: str
    class_name: str
    value: Any


def _from_config(cls: NativeModelClass | NativeSchedulerClass, path: Path) -> Any:
    config = read_json(path)
    try:
        return cls.from_config(config)
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc


@contextlib.contextmanager
def _loading(what: str, path: Path) -> Iterator[None]:
    """Turn transformers' load errors into a `ModelLoadError` naming what failed to load from where."""
    try:
        yield
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load {what} from {path}: {exc}") from exc


def supports_tensor_parallel(cls: NativeModelClass) -> bool:
    """Whether `cls` shards itself over a TP group: it has `shard_for_tensor_parallel(tp)`, which swaps
    its (meta) layers for this rank's shards before loading (else it is loaded whole on every rank)."""
    return callable(getattr(cls, "shard_for_tensor_parallel", None))


def _shard(module: nn.Module, spec: ComponentSpec, tp: TensorParallelRank) -> None:
    """Swap `module`'s (meta) layers for their TP shards, before any weight is read; a model without TP
    support (a VAE) stays whole on every rank."""
    shard = getattr(module, "shard_for_tensor_parallel", None)
    if shard is None:
        logger.info("%s (%s): replicated on each of the %d TP ranks", spec.name, spec.class_name, tp.tp_size)
        return
    try:
        shard(tp)
    except ValueError as exc:  # e.g. heads that do not divide the TP size
        raise ModelLoadError(f"{spec.path}: {exc}") from exc
    logger.info("%s (%s): TP rank %d of %d", spec.name, spec.class_name, tp.tp_rank, tp.tp_size)


def load_native_model(
    spec: ComponentSpec,
    cls: NativeModelClass,
    platform: Platform,
    dtype: torch.dtype,
    tensor_parallel: TensorParallelRank | None = None,
    device: torch.device | None = None,
    dit_options: DitLoadOptions | None = None,
) -> tuple[nn.Module, int]:
    """Build the native module `cls` on meta from config.json, stream its safetensors in onto `device`
    (default: `platform`'s; the host for an offloaded component), and bind its `CustomOp`s to
    `platform`. Returns the module and the bytes read from disk.

    With `tensor_parallel` (a TP group of more than one rank) a model that supports it is built as this
    rank's shard and reads only that shard's slices of the checkpoint; other models load whole. The DiT
    takes `dit_options` (loader/dit_weights.py: another weights file, memory-mapped weights, quantization)."""
    device = platform.device() if device is None else device
    options = dit_options or DitLoadOptions()
    # A DiT to quantize is loaded, fused and quantized in host memory, then moved: the device never
    # holds its full-precision weights.
    load_device = torch.device("cpu") if options.quantization is not None else device
    with torch.device("meta"):
        module = _from_config(cls, spec.path / "config.json")
    if tensor_parallel is not None and tensor_parallel.tp_size > 1:
        _shard(module, spec, tensor_parallel)
    num_bytes = load_dit_weights(module, spec, load_device, dtype, options)
    module.eval().requires_grad_(False)
    # Inference-only rearrangements that need the loaded weights (e.g. fused QKV projections); weights
    # kept in their memory-mapped files (`--max-memory`) stay unfused, as fusing would copy them all in,
    # and so do layers a GGUF / FP8 file left quantized (fusing concatenates full-precision weights).
    fuse = getattr(module, "fuse_for_inference", None)
    if fuse is not None and not options.mmap_weights:
        if holds_quantized_layers(module):
            logger.info(
                "%s (%s): left unfused (its Linears are quantized as the file stores them)",
                spec.name,
                spec.class_name,
            )
        else:
            fuse()
    finish_dit(module, spec, options)
    if load_device != device:
        module.to(device)
    # The models build their CustomOps without a platform; bind them (fused ones included) to this one.
    dispatch_custom_ops(module, platform)
    return module, num_bytes


def load_tokenizer(spec: ComponentSpec) -> Any:
    """The tokenizer `spec` names: one of `TRANSFORMERS_TOKENIZERS` as whichever of its slow/fast classes
    this transformers version has, any other as transformers' class of that name."""
    if spec.class_name not in TRANSFORMERS_TOKENIZERS:
        with _loading(f"tokenizer {spec.class_name}", spec.path):
            return load_named_tokenizer(spec.class_name, spec.path)
    for candidate in TRANSFORMERS_TOKENIZERS[spec.class_name]:
        cls = getattr(transformers, candidate, None)
        if cls is not None:
            break
    else:  # pragma: no cover - every supported transformers version has one of them
        raise ModelLoadError(f"this transformers version has no tokenizer class for {spec.class_name}")
    with _loading(f"tokenizer {spec.class_name}", spec.path):
        return cls.from_pretrained(str(spec.path), local_files_only=True)


def _load(
    spec: ComponentSpec,
    native: NativeClasses,
    platform: Platform,
    dtype: torch.dtype,
    text_dtype: torch.dtype,
    tensor_parallel: TensorParallelRank | None,
    host_components: frozenset[str] = frozenset(),
    dit_options: DitLoadOptions | None = None,
) -> Any:
    """Load one component whose class `load_components` has checked is supported: onto the host when it
    is in `host_components` (offloaded: it moves to the device for its stage), else onto the device."""
    path, name = str(spec.path), spec.class_name
    device = torch.device("cpu") if spec.name in host_components else platform.device()
    if spec.library == "diffusers" and name in native.models:
        options = dit_options if spec.name == "transformer" else None
        if spec.name == "transformer_2" and dit_options is not None:
            # Wan 2.2 A14B's low-noise expert: quantised and memory-mapped like the first DiT; a
            # --transformer-weights file holds one DiT and replaces the high-noise expert only.
            options = replace(dit_options, transformer_weights=None)
        return load_native_model(
            spec, native.models[name], platform, dtype, tensor_parallel, device, options
        )[0]
    if spec.library == "diffusers" and name in native.guiders:
        return _from_config(native.guiders[name], spec.path / "guider_config.json")
    if spec.library == "diffusers":
        return _from_config(native.schedulers[name], spec.path / "scheduler_config.json")
    role = transformers_role(name)
    if role == "tokenizer" or name in TRANSFORMERS_TOKENIZERS:
        return load_tokenizer(spec)
    tp = tensor_parallel
    if tp is not None and tp.tp_size > 1 and name in TENSOR_PARALLEL_ENCODERS:  # CLIP loads whole
        with _loading(name, spec.path):  # (heads that do not divide --tp-size are a ValueError)
            model = load_tensor_parallel_encoder(name, spec.path, device, text_dtype, tp)[0]
        logger.info(
            "%s (%s): TP rank %d of %d (whole on each rank: %s)",
            spec.name, name, tp.tp_rank, tp.tp_size, TENSOR_PARALLEL_ENCODERS[name],
        )  # fmt: skip
        return model
    if name in native.encoders:
        with _loading(name, spec.path):
            model = getattr(transformers, name).from_pretrained(path, dtype=text_dtype, local_files_only=True)
        model = model.to(device).eval().requires_grad_(False)
        # transformers maps the files and keeps same-dtype weights as views of them: copy those out, so
        # that a weight file rewritten or truncated after the load changes nothing (owned_weights.py).
        detach_from_files(model, sorted(spec.path.glob("*.safetensors")))
        return model
    if role == "processor" and (name in TOKENIZER_ONLY_PROCESSORS or spec.name.startswith("tokenizer")):
        # A processor in a tokenizer's place (FLUX.2-dev's PixtralProcessor): the pipeline uses its text part.
        with _loading(f"processor {name}'s tokenizer", spec.path):
            return load_processor_tokenizer(spec.path)
    if role == "processor":
        with _loading(f"processor {name}", spec.path):
            return load_image_text_processor(name, spec.path)
    with _loading(f"image processor {name}", spec.path):
        return load_named_image_processor(name, path)


@contextlib.contextmanager
def _no_transformers_progress_bars() -> Iterator[None]:
    """transformers' own per-file "Loading weights" bars off while a component loads (the CLI's logging
    setup turns them off for good; a `DiffGenerator` in a user's program gets the same quiet load, and the
    bars are back for the program's own transformers use afterwards)."""
    from transformers.utils import logging as transformers_logging

    was_on = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            transformers_logging.enable_progress_bar()


def _load_and_log(
    spec: ComponentSpec, load: Callable[[ComponentSpec], Any], platform: Platform
) -> LoadedComponent:
    """`load(spec)`, logged: class, parameter count, size, time, available memory."""
    logger.info("Loading %s (%s) from %s", spec.name, spec.class_name, spec.path)
    start = time.perf_counter()
    if not spec.path.is_dir():
        raise ModelLoadError(f"component folder {spec.path} named in model_index.json does not exist")
    with _no_transformers_progress_bars():
        value = load(spec)
    num_params = num_bytes = 0
    if isinstance(value, nn.Module):
        num_params = sum(t.numel() for t in value.parameters())
        num_bytes = sum(t.numel() * t.element_size() for t in [*value.parameters(), *value.buffers()])
    platform.synchronize()
    seconds = time.perf_counter() - start
    avail = platform.memory_info().available_bytes
    logger.info(
        "Loaded %s: %s (diffserve %s)%s, model size: %.3f GB, in %.2f s%s",
        spec.name,
        spec.class_name,
        "native" if spec.library == "diffusers" else "via transformers",
        f", {num_params / 1e6:.2f}M params" if num_params else "",
        num_bytes / 2**30,
        seconds,
        f", avail mem: {avail / 2**30:.2f} GB" if avail is not None else "",
    )
    return LoadedComponent(spec.name, spec.class_name, value)


def load_components(
    index: ModelIndex,
    required: tuple[str, ...],
    native: NativeClasses,
    platform: Platform,
    dtype: torch.dtype,
    text_encoder_dtype: torch.dtype,
    optional: tuple[str, ...] = (),
    tensor_parallel: TensorParallelRank | None = None,
    host_components: frozenset[str] = frozenset(),
    dit_options: DitLoadOptions | None = None,
) -> dict[str, LoadedComponent]:
    """Load the components a pipeline requires, in a fixed order, and the `optional` ones the folder has.

    `native` is the family's table of native classes (its registry record's). With `tensor_parallel`,
    the native models that support it load as this rank's shard (see `load_native_model`), and so do
    the large text encoders (`loader/text_encoder_tp.py`); CLIP and the other models load whole.
    Components named in `host_components` load into host memory (offloaded, `offload/`); the DiT
    (`transformer`) takes `dit_options`.
    Absent required components, components the pipeline does not use and classes diffserve cannot load
    are all refused before any component is loaded.
    """
    where = index.root / "model_index.json"
    absent = [name for name in required if name not in index.components]
    if absent:
        raise ModelLoadError(
            f"{where} lacks components the {index.pipeline_class_name} pipeline needs: {', '.join(absent)}"
        )
    unused = sorted(set(index.components) - set(required) - set(optional))
    if unused:
        raise ModelLoadError(
            f"{where} names components diffserve's {index.pipeline_class_name} "
            f"does not use: {', '.join(unused)}. Running without them would not give what diffusers gives "
            "for this folder, so it is refused (for Wan, `transformer_2` marks a Wan 2.2 two-expert "
            "checkpoint, which diffserve does not support yet)"
        )
    skipped = [name for name in optional if name not in index.components]
    if skipped:
        logger.info("Optional components not in this folder (the pipeline runs without them): %s", skipped)
    names = required + tuple(name for name in optional if name in index.components)
    specs = [index.components[name] for name in names]
    accepted = {
        "diffusers": {*native.models, *native.schedulers, *native.guiders},
    }
    refused = [
        spec
        for spec in specs
        if not (
            spec.class_name in accepted["diffusers"]
            if spec.library == "diffusers"
            else spec.library == "transformers" and accepts_transformers_class(spec.class_name, native)
        )
    ]
    if refused:
        classes = ", ".join(f"{spec.name!r} ({spec.library}.{spec.class_name})" for spec in refused)
        supported = ", ".join(sorted(accepted["diffusers"] | native.encoders))
        raise ModelLoadError(
            f"{where} names component classes diffserve's {index.pipeline_class_name} does not support: "
            f"{classes}; supported component classes: {supported}, and the tokenizer, processor and image "
            f"processor classes of the installed transformers ({transformers.__version__})"
        )
    logger.info("Loading components: %s", list(names))
    load = functools.partial(
        _load, native=native, platform=platform, dtype=dtype, text_dtype=text_encoder_dtype,
        tensor_parallel=tensor_parallel, host_components=host_components,
        dit_options=dit_options or DitLoadOptions(),
    )  # fmt: skip
    return {spec.name: _load_and_log(spec, load, platform) for spec in specs}
