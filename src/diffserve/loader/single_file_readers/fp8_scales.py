"""The scale tensors of pre-quantized FP8 safetensors checkpoints, as ComfyUI and Kijai publish them.

Three layouts exist: plain casts (`flux1-dev-fp8-e4m3fn.safetensors`: FP8 weights, no scales, weight =
the FP8 value); ComfyUI's legacy "scaled FP8" (a `scaled_fp8` marker tensor, and per weight
`<module>.scale_weight`, a scalar or per-output-row scale: weight = fp8 * scale; optional
`<module>.scale_input` for FP8 matmuls); and ComfyUI's current mixed-precision layout
(`<module>.weight_scale`, `<module>.comfy_quant` = JSON `{"format": "float8_e4m3fn"}`, optional
`<module>.input_scale`). Input scales only matter to an FP8 x FP8 matmul: weight-only dequantization
does not use them. Other formats of the mixed layout (NVFP4, MXFP8, int8 blocks) are refused by name.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from diffserve.errors import ModelLoadError

_WEIGHT_SCALES = (".scale_weight", ".weight_scale")
_INPUT_SCALES = (".scale_input", ".input_scale")
_MARKER = "scaled_fp8"
_QUANT_CONFIG = ".comfy_quant"
_FP8_FORMATS = ("float8_e4m3fn", "float8_e5m2")
_UNSUPPORTED = (".weight_scale_2",)  # NVFP4's second-level scale
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass
class Fp8Layout:
    """A file's FP8 bookkeeping: which tensor scales which weight, and the names that are not weights."""

    scales: dict[str, str] = field(default_factory=dict)  # weight name -> its scale tensor's name
    auxiliary: set[str] = field(default_factory=set)  # markers, configs and input scales: not loaded


def fp8_layout(names: list[str], read_small: Callable[[str], torch.Tensor], path: str) -> Fp8Layout:
    """Sort a safetensors file's `names` into weights, weight scales and auxiliary tensors.
    `read_small(name)` reads a (small) tensor: the `comfy_quant` configs are checked here."""
    layout = Fp8Layout()
    for name in names:
        if name == _MARKER or name.endswith("." + _MARKER):
            layout.auxiliary.add(name)
        elif name.endswith(_UNSUPPORTED):
            raise ModelLoadError(f"{path}: {name!r} is an NVFP4 scale; NVFP4 checkpoints are not supported")
        elif name.endswith(_QUANT_CONFIG):
            _check_config(name, read_small(name), path)
            layout.auxiliary.add(name)
        elif name.endswith(_INPUT_SCALES):
            layout.auxiliary.add(name)
        elif name.endswith(_WEIGHT_SCALES):
            module = name.rsplit(".", 1)[0]
            layout.scales[f"{module}.weight"] = name
    present = set(names)
    orphans = sorted(weight for weight in layout.scales if weight not in present)
    if orphans:
        raise ModelLoadError(f"{path}: scales without their weights: {', '.join(orphans[:8])}")
    return layout


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor | None, name: str, path: str) -> torch.Tensor:
    """`weight` (FP8, or already full precision when unscaled) times `scale` (scalar or one per row), in
    float32. A scale on a weight that is not FP8 is another quantization format: refused."""
    if scale is None:
        return weight.to(torch.float32) if weight.dtype in FP8_DTYPES else weight
    if weight.dtype not in FP8_DTYPES:
        raise ModelLoadError(
            f"{path}: {name!r} has a scale but is stored as {weight.dtype}; only FP8 weights with "
            "per-tensor or per-row scales are supported"
        )
    scale = scale.to(torch.float32)
    if scale.numel() == 1:
        return weight.to(torch.float32) * scale.reshape(())
    if scale.numel() == weight.shape[0]:
        return weight.to(torch.float32) * scale.reshape(-1, *([1] * (weight.dim() - 1)))
    raise ModelLoadError(
        f"{path}: the scale of {name!r} has shape {tuple(scale.shape)}; only per-tensor or per-row scales "
        f"of a {tuple(weight.shape)} weight are supported"
    )


def _check_config(name: str, raw: torch.Tensor, path: str) -> None:
    try:
        config = json.loads(bytes(raw.to(torch.uint8).flatten().tolist()).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: {name!r} is not a JSON quantization config ({exc})") from exc
    fmt = config.get("format") if isinstance(config, dict) else None
    if fmt not in _FP8_FORMATS:
        raise ModelLoadError(
            f"{path}: {name!r} declares quantization format {fmt!r}; only {', '.join(_FP8_FORMATS)} "
            "(weight-only) are supported"
        )
