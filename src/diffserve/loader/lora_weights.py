"""`LoraWeights` and `ConvertedLora`: one adapter file in the one form the rest of diffserve reads,
whatever format it was saved in (the converters in `loader/lora_formats/` produce it).

A LoRA adds to a Linear `y = W x + b` the low-rank term `scaling * up @ (down @ x)`, with
`scaling = alpha / rank` (PEFT's `lora_alpha / r`) times the scale a request gives the adapter. Targets
are named by the Diffusers module path, component first: `transformer.transformer_blocks.0.attn.to_q`,
`text_encoder.text_model.encoder.layers.0.self_attn.q_proj`. Native models keep Diffusers' module
names, so these paths are the native modules' too (fused projections map their parts, see
`runtime/lora_registry.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class LoraWeights:
    """One Linear's low-rank pair: `down` (rank, in_features), PEFT's `lora_A`, kohya's `lora_down`;
    `up` (out_features, rank), `lora_B` / `lora_up`; `alpha` None means alpha = rank (scaling 1), as
    PEFT and Diffusers assume when a file stores no alpha."""

    down: torch.Tensor
    up: torch.Tensor
    alpha: float | None = None

    def __post_init__(self) -> None:
        if self.down.dim() != 2 or self.up.dim() != 2 or self.down.shape[0] != self.up.shape[1]:
            raise ValueError(
                f"a LoRA pair needs down (rank, in) and up (out, rank), got down {tuple(self.down.shape)} "
                f"and up {tuple(self.up.shape)}"
            )

    @property
    def rank(self) -> int:
        return int(self.down.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.down.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.up.shape[0])

    @property
    def scaling(self) -> float:
        """alpha / rank: what the pair's product is multiplied by before the request's own scale."""
        return 1.0 if self.alpha is None else float(self.alpha) / self.rank

    @property
    def num_bytes(self) -> int:
        return self.down.numel() * self.down.element_size() + self.up.numel() * self.up.element_size()

    def delta_weight(self) -> torch.Tensor:
        """`scaling * up @ down` in fp32, (out_features, in_features): the change merging makes to W."""
        return (self.up.float() @ self.down.float()) * self.scaling


@dataclass(frozen=True)
class ConvertedLora:
    """An adapter file after conversion: `targets` maps each Diffusers module path (component first, see
    the module docstring) to its pair; `format` names what the file was (`"diffusers"`, `"kohya"`,
    `"flux-xlabs"`, ...); `unsupported` lists the file's keys that no converter could map (DoRA
    magnitudes, full-weight diffs, non-Linear targets), which loading refuses unless `strict=False`."""

    targets: dict[str, LoraWeights]
    format: str
    unsupported: tuple[str, ...] = field(default=())

    def components(self) -> set[str]:
        """The components the adapter targets (`transformer`, `text_encoder`, ...)."""
        return {path.split(".", 1)[0] for path in self.targets}
