"""Engine-wide settings, fixed when the engine starts (one model, one device)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class EngineArgs:
    model_path: str
    device: str | None = None  # platform name ("cpu", "cuda", ...); None: detect
    dtype: str | None = None  # "float32", "bfloat16", "float16"; None: the platform's default
    text_encoder_dtype: str | None = None  # None: same as dtype
    attention_backend: str | None = None  # None: the platform's default
    output_path: str = "outputs"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
