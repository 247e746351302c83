"""Weight-only quantization of a loaded DiT (`--quantization int8|fp8`, docs/memory.md): its Linears
become `QuantizedLinear`s (8-bit weights, one scale per output channel), after loading and fusing.

What stays in full precision, per family (its record's `DitFacts`), follows what the field leaves out (diffusers'
`_skip_layerwise_casting_patterns` / `_keep_in_fp32_modules`, the `modules_to_not_convert` of SDNQ's
and torchao recipes): norms, positional and modulation tables and the patch-embedding convolutions are
not Linears and are never touched; the input embedders (latent and text projections), the timestep,
guidance and pooled-text embedders, and the output head (`norm_out`, `proj_out`, Z-Image's
`all_final_layer`) keep their precision. They sit where an error reaches every token (the conditioning
vector) or the output directly, and are small: with the biases and norms, 0.2-1.7% of the parameters of
FLUX.1-dev, SD3.5-large, Qwen-Image, Z-Image-Turbo and Wan 2.1 14B (for Wan mostly the projection of
the timestep embedding to the blocks' modulation, `condition_embedder.time_proj`).

Every Linear inside the repeated blocks is quantized, fused ones included (FLUX's `to_qkv`,
`to_qkv_mlp`). FLUX's `adaln_modulation` is quantized whole: it fuses every block's adaLN projection
(27% of FLUX.1-dev's weights) with the output head's (`norm_out.linear`, 0.6% of its rows), whose rows
keep their own scales like any others.

`--quantization fp8-dynamic` quantizes the same Linears to `Fp8DynamicLinear`s, which compute in FP8
(per-token activation scales, `torch._scaled_mm`) rather than dequantizing; a Linear whose dims are not
multiples of 16 (which `_scaled_mm` cannot take) keeps its precision, and the log names how many.
`check_quantization_device` refuses it before anything loads where the device has no FP8 compute.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from diffserve.configs.memory_options import QUANTIZATION_MODES
from diffserve.errors import UserError
from diffserve.layers.fp8_dynamic_linear import MODE as FP8_DYNAMIC
from diffserve.layers.fp8_dynamic_linear import (
    Fp8DynamicLinear,
    fp8_compute_unavailable_reason,
    fp8_dynamic_supported_shape,
)
from diffserve.layers.fused_linear import FusedLinear
from diffserve.layers.gguf_linear import quantized_layer_kinds
from diffserve.layers.quantized_linear import QuantizedLinear
from diffserve.layers.tensor_parallel import ParallelLinear
from diffserve.loader.dit_facts import DitFactsTable
from diffserve.platforms.base import Platform

logger = logging.getLogger("diffserve.loader")

#: The Linear classes quantized: plain and fused (not tensor-parallel shards, not LoRA-wrapped layers).
_QUANTIZABLE = (nn.Linear, FusedLinear)


def quantizable_linears(
    module: nn.Module, dit_class: str, facts: DitFactsTable
) -> list[tuple[str, nn.Linear]]:
    """(name, Linear) of every Linear of `module` that `quantize_dit` quantizes, in module order: all but
    those under the family's full-precision modules (its record's `DitFacts.full_precision_modules`)."""
    kept = facts.full_precision_modules(dit_class)
    return [
        (name, linear)
        for name, linear in module.named_modules()
        if type(linear) in _QUANTIZABLE and name.split(".", 1)[0] not in kept
    ]


def check_quantization_device(mode: str | None, platform: Platform, dtype: torch.dtype) -> None:
    """UserError, before anything loads, when `mode` cannot compute on `platform` in `dtype`: FP8
    compute (`fp8-dynamic`) needs an NVIDIA GPU of compute capability >= 8.9 and bf16 activations."""
    if mode != FP8_DYNAMIC:
        return
    reason = fp8_compute_unavailable_reason(platform)
    if reason is not None:
        raise UserError(reason)
    if dtype != torch.bfloat16:
        raise UserError(
            f"--quantization {FP8_DYNAMIC} computes with bf16 activations: use --dtype bfloat16, not {dtype}"
        )


def tensor_bytes(module: nn.Module) -> int:
    """Bytes of `module`'s parameters and buffers: what it keeps resident."""
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def quantize_dit(module: nn.Module, mode: str, dit_class: str, facts: DitFactsTable) -> None:
    """Replace, in place, the Linears of the loaded (and fused) DiT `module` of Diffusers class
    `dit_class` by `QuantizedLinear`s of `mode` ("int8" or "fp8"; "fp8-dynamic": `Fp8DynamicLinear`s), leaving the family's embedders and
    output head in full precision (`facts`: the registry's `DIT_FACTS`). Each layer is freed as it is replaced,
    so the peak is the model plus one layer's quantized copy."""
    if mode not in QUANTIZATION_MODES:
        raise UserError(f"--quantization must be one of {', '.join(QUANTIZATION_MODES)}, got {mode!r}")
    if any(isinstance(m, ParallelLinear) for m in module.modules()):
        raise UserError("--quantization does not combine with tensor parallelism (--tp-size > 1) yet")
    targets = quantizable_linears(module, dit_class, facts)
    if not targets and quantized_layer_kinds(module):
        logger.info(
            "--quantization %s: %s's Linears are all quantized already (as its weights file stores them)",
            mode,
            dit_class,
        )
        return
    if not targets:
        raise UserError(f"--quantization: {dit_class} has no Linear layers to quantize")
    layer_class: type[QuantizedLinear] = QuantizedLinear
    if mode == FP8_DYNAMIC:
        layer_class = Fp8DynamicLinear
        kept = [name for name, linear in targets if not fp8_dynamic_supported_shape(linear)]
        if kept:
            logger.info(
                "--quantization %s: %d Linears of %s keep their precision (dims not multiples of 16, which "
                "FP8 matmuls cannot take): %s", mode, len(kept), dit_class, ", ".join(kept[:8])
                + (", ..." if len(kept) > 8 else ""),
            )  # fmt: skip
        targets = [(name, linear) for name, linear in targets if fp8_dynamic_supported_shape(linear)]
        if not targets:
            raise UserError(f"--quantization {mode}: no Linear of {dit_class} has dims FP8 matmuls can take")
    before = tensor_bytes(module)
    device = targets[0][1].weight.device
    names = [name for name, _ in targets]
    del targets  # so that each Linear is freed as soon as it is replaced
    for name in names:
        parent_name, _, leaf = name.rpartition(".")
        parent = module.get_submodule(parent_name)
        setattr(parent, leaf, layer_class.from_linear(getattr(parent, leaf), mode))
    empty_cache = getattr(getattr(torch, device.type, None), "empty_cache", None)
    if device.type != "cpu" and callable(empty_cache):
        empty_cache()  # hand the full-precision weights' cached blocks back to the device
    after = tensor_bytes(module)
    logger.info(
        "%s: %s %s of %d Linears (kept in full precision: %s): weights %s -> %s (%.0f%%)",
        dit_class, mode, "quantization" if mode == FP8_DYNAMIC else "weight-only quantization", len(names),
        ", ".join(sorted(facts.full_precision_modules(dit_class))),
        _size(before), _size(after), 100 * after / before,
    )  # fmt: skip


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"
