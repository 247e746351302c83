"""Diffusers / PEFT-layout LoRA files: `<component>.<module>.lora_A.weight` / `.lora_B.weight`.

Accepted, as Diffusers reads them: the component prefix (`transformer.`, `text_encoder.`,
`text_encoder_2.`; keys without one are the transformer's), PEFT's own `base_model.model.` prefix,
the adapter name PEFT may leave in a key (`lora_A.default.weight`; one adapter per file), the older
spellings `lora.down` / `lora.up`, `lora_linear_layer.down` / `.up` and attention-processor keys
(`attn.processor.to_q_lora.down.weight`: `to_q` / `to_out.0` in a transformer, `q_proj` / `out_proj`
in a text encoder).

Alpha, per module: the file's `<module>.alpha` tensor when it has one; else the `LoraConfig` that
Diffusers builds from the file's `lora_adapter_metadata` (`adapter_metadata.py`); else alpha = rank,
which is what Diffusers' inferred config amounts to without alphas (it mirrors every module's rank into
`alpha_pattern`). For FLUX, Diffusers hands `.alpha` tensors to PEFT as `network_alphas`: a module with
none then gets the component's first alpha in file order (PEFT's default `lora_alpha`).

Keys for a component the family's Diffusers loader does not load (T5 encoders, Qwen's or Wan's text
encoder), biases, DoRA magnitudes and weight diffs go to `unsupported`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from diffserve.loader.lora_formats.adapter_metadata import (
    METADATA_KEY,
    AdapterConfig,
    config_for,
    read_adapter_metadata,
)
from diffserve.loader.lora_formats.architectures import Architecture
from diffserve.loader.lora_formats.pairs import (
    ModuleTensors,
    Role,
    checked_factors,
    describe,
    lora_error,
    parse_suffix,
)
from diffserve.loader.lora_weights import ConvertedLora, LoraWeights

PEFT_PREFIX = "base_model.model."
_TRANSFORMER = "transformer"
_COMPONENT = re.compile(r"(?:transformer|text_encoder|unet|prior|controlnet)(?:_\d+)?")
_ATTENTION_PROCESSOR = re.compile(
    r"(?P<module>.+)\.(?P<proj>to_q|to_k|to_v|to_out)_lora\.(?P<role>down|up)\.weight"
)
_PROCESSOR_TARGETS = {
    "transformer": {"to_q": "to_q", "to_k": "to_k", "to_v": "to_v", "to_out": "to_out.0"},
    "text_encoder": {"to_q": "q_proj", "to_k": "k_proj", "to_v": "v_proj", "to_out": "out_proj"},
}


def split_component(name: str) -> tuple[str, str]:
    """(component, module-relative rest) of a key; keys without a component prefix are the
    transformer's."""
    head, dot, rest = name.partition(".")
    if dot and _COMPONENT.fullmatch(head):
        return head, rest
    return _TRANSFORMER, name


def _renamed_processor_key(component: str, rest: str) -> str:
    match = _ATTENTION_PROCESSOR.fullmatch(rest)
    if match is None:
        return rest
    kind = "text_encoder" if component.startswith("text_encoder") else "transformer"
    factor = "lora_A" if match["role"] == "down" else "lora_B"
    return f"{match['module']}.{_PROCESSOR_TARGETS[kind][match['proj']]}.{factor}.weight"


def convert_peft_lora(
    state_dict: Mapping[str, torch.Tensor], file_metadata: Mapping[str, str], arch: Architecture, source: str
) -> ConvertedLora:
    """Convert a Diffusers / PEFT-layout state dict; `LoraError` for keys of no LoRA spelling, two
    adapters in one file, a factor without its partner, mismatched ranks or metadata."""
    modules: dict[tuple[str, str], ModuleTensors] = {}
    unknown: list[str] = []
    unsupported: list[str] = []
    adapters: set[str] = set()
    first_alpha: dict[str, str] = {}  # component -> module of its first `.alpha` key, in file order
    for key, tensor in state_dict.items():
        component, rest = split_component(key.removeprefix(PEFT_PREFIX).replace(".processor.", "."))
        parsed = parse_suffix(_renamed_processor_key(component, rest))
        if parsed is None:
            unknown.append(key)
        elif parsed.role is Role.UNSUPPORTED or component not in arch.components:
            unsupported.append(key)
        else:
            if parsed.adapter is not None:
                adapters.add(parsed.adapter)
            if parsed.role is Role.ALPHA:
                first_alpha.setdefault(component, parsed.module)
            label = f"{component}.{parsed.module}"
            modules.setdefault((component, parsed.module), ModuleTensors()).put(
                parsed.role, tensor, key, label, source
            )
    if unknown:
        raise lora_error(
            source, f"keys in no LoRA layout known for {arch.dit_class}: {describe(sorted(unknown))}"
        )
    if len(adapters) > 1:
        raise lora_error(
            source, f"the file holds several PEFT adapters ({', '.join(sorted(adapters))}); save one"
        )

    configs = read_adapter_metadata(dict(file_metadata), source)
    if arch.first_alpha_fill and first_alpha and configs is not None:
        raise lora_error(
            source, f"the file has both .alpha tensors and {METADATA_KEY}; Diffusers refuses that for FLUX"
        )
    fill = {c: modules[(c, m)].alpha(source) for c, m in first_alpha.items()} if arch.first_alpha_fill else {}

    targets: dict[str, LoraWeights] = {}
    for (component, module), tensors in modules.items():
        label = f"{component}.{module}"
        if not tensors.has_pair_part:
            continue  # an `.alpha` without factors changes nothing (Diffusers drops it too)
        factors = checked_factors(label, tensors, source)
        if factors is None:
            unsupported.extend(tensors.all_keys())
            continue
        down, up = factors
        alpha = tensors.alpha(source)
        if alpha is None:
            alpha = _alpha_without_tensor(
                config_for(configs, component, source), fill.get(component), module, down, label, source
            )
        targets[label] = LoraWeights(down, up, alpha)
    for component in {label.split(".", 1)[0] for label in targets}:
        config = config_for(configs, component, source)
        if config is not None and config.use_dora:
            unsupported.append(f"{METADATA_KEY}:{component}.use_dora")
    return ConvertedLora(targets, "peft" if _has_peft_prefix(state_dict) else "diffusers", tuple(unsupported))


def _alpha_without_tensor(
    config: AdapterConfig | None, fill: float | None, module: str, down: torch.Tensor, label: str, source: str
) -> float | None:
    if config is not None:
        return config.module_alpha(module, int(down.shape[0]), label, source)
    return fill


def _has_peft_prefix(state_dict: Mapping[str, torch.Tensor]) -> bool:
    return any(key.startswith(PEFT_PREFIX) for key in state_dict)
