"""The pieces every LoRA layout shares: reading a key's suffix (which factor it holds), gathering a
module's down / up / alpha tensors, and checking them into a `LoraWeights`.

Suffix spellings, whatever the layout: PEFT's `lora_A` / `lora_B` (optionally with the adapter name,
`lora_A.default.weight`), kohya's `lora_down` / `lora_up`, the older Diffusers `lora.down` /
`lora.up` and `lora_linear_layer.down` / `.up`, and `alpha`. Keys that hold something a LoRA pair on
a Linear cannot express (PEFT's `lora_B.bias`, DoRA's `lora_magnitude_vector` / `dora_scale`, full
weight diffs `diff` / `diff_b`, LyCORIS LoKr / LoHa / LoCon factors) are recognised as unsupported.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum

import torch

from diffserve.errors import LoraError
from diffserve.loader.lora_weights import LoraWeights


class Role(Enum):
    """What a key holds for its module."""

    DOWN = "down"
    UP = "up"
    ALPHA = "alpha"
    UNSUPPORTED = "unsupported"


_SUFFIXES: tuple[tuple[str, Role], ...] = (
    (r"lora_(?:A|down)\.weight", Role.DOWN),
    (r"lora_(?:B|up)\.weight", Role.UP),
    (r"lora\.down\.weight", Role.DOWN),
    (r"lora\.up\.weight", Role.UP),
    (r"lora_linear_layer\.down\.weight", Role.DOWN),
    (r"lora_linear_layer\.up\.weight", Role.UP),
    (r"lora_A\.(?P<adapter>[^.]+)\.weight", Role.DOWN),
    (r"lora_B\.(?P<adapter>[^.]+)\.weight", Role.UP),
    (r"alpha", Role.ALPHA),
    (r"lora_(?:B|up)(?:\.[^.]+)?\.bias", Role.UNSUPPORTED),
    (r"diff(?:_b)?", Role.UNSUPPORTED),
    (r"lora_magnitude_vector(?:\.[^.]+)?(?:\.weight)?", Role.UNSUPPORTED),
    (r"dora_scale", Role.UNSUPPORTED),
    (r"(?:lokr|hada|loha)_\w+", Role.UNSUPPORTED),
    (r"lora_mid\.weight", Role.UNSUPPORTED),
)
_SUFFIX_PATTERNS = tuple((re.compile(rf"(?P<module>.+?)\.{s}"), role) for s, role in _SUFFIXES)


@dataclass(frozen=True)
class KeySuffix:
    """A key split into its module part (as the file writes it) and what it holds; `adapter` is the
    PEFT adapter name of `lora_A.<adapter>.weight` keys."""

    module: str
    role: Role
    adapter: str | None = None


def parse_suffix(key: str) -> KeySuffix | None:
    """The module and role of `key`, or None when its suffix is no LoRA spelling known here."""
    for pattern, role in _SUFFIX_PATTERNS:
        match = pattern.fullmatch(key)
        if match:
            return KeySuffix(match["module"], role, match.groupdict().get("adapter"))
    return None


def lora_error(source: str, message: str) -> LoraError:
    return LoraError(f"LoRA {source}: {message}")


def describe(keys: list[str] | tuple[str, ...], limit: int = 5) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > limit else "")


@dataclass
class ModuleTensors:
    """The tensors a file holds for one module, with the key each came from."""

    tensors: dict[Role, torch.Tensor] = field(default_factory=dict)
    keys: dict[Role, str] = field(default_factory=dict)

    def put(self, role: Role, tensor: torch.Tensor, key: str, label: str, source: str) -> None:
        if role in self.tensors:
            raise lora_error(
                source, f"keys {self.keys[role]} and {key} both give the {role.value} factor of {label}"
            )
        self.tensors[role] = tensor
        self.keys[role] = key

    @property
    def has_pair_part(self) -> bool:
        return Role.DOWN in self.tensors or Role.UP in self.tensors

    def all_keys(self) -> list[str]:
        return list(self.keys.values())

    def alpha(self, source: str) -> float | None:
        """The module's `.alpha` value, None when the file has none for it."""
        tensor = self.tensors.get(Role.ALPHA)
        if tensor is None:
            return None
        if tensor.numel() != 1:
            raise lora_error(
                source, f"{self.keys[Role.ALPHA]} must hold one number, it has shape {tuple(tensor.shape)}"
            )
        return float(tensor.item())


def checked_factors(
    label: str, module: ModuleTensors, source: str
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The module's (down, up), checked: both present with the same rank. None when they are not 2-D
    (a convolution's LoRA: no Linear to apply it to)."""
    down, up = module.tensors.get(Role.DOWN), module.tensors.get(Role.UP)
    if down is None or up is None:
        have, missing = ("down", "up") if up is None else ("up", "down")
        raise lora_error(
            source, f"{label} has a {have} factor ({describe(module.all_keys())}) but no {missing} factor"
        )
    if down.dim() != 2 or up.dim() != 2:
        return None
    if down.shape[0] != up.shape[1]:
        raise lora_error(
            source,
            f"{label}: the down factor {module.keys[Role.DOWN]} has rank {down.shape[0]} "
            f"(shape {tuple(down.shape)}) but the up factor {module.keys[Role.UP]} has rank {up.shape[1]} "
            f"(shape {tuple(up.shape)})",
        )
    return down, up


def split_pair(
    label: str, down: torch.Tensor, up: torch.Tensor, alpha: float | None, parts: int, source: str
) -> list[LoraWeights]:
    """A fused projection's pair as `parts` pairs: the up factor's rows in equal consecutive parts,
    each with the shared down factor (the product's rows split the same way)."""
    if up.shape[0] % parts:
        raise lora_error(
            source,
            f"{label}: a fused projection's up factor has {up.shape[0]} rows, not divisible by {parts}",
        )
    return [LoraWeights(down, chunk, alpha) for chunk in up.chunk(parts, dim=0)]
