"""Engine-wide settings, fixed when the engine starts (one model, one device)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from diffserve.configs.quality import EXACT


@dataclass
class EngineArgs:
    #: A Diffusers model folder, or a Hugging Face repo id (`owner/name`) resolved from the local HF
    #: cache or downloaded (`diffserve.loader.hub`); either way the name the model is shown and served as.
    model_path: str
    #: Hub revision of a repo id (branch, tag or commit hash); None: `main`. An error with a local folder.
    revision: str | None = None
    device: str | None = None  # platform name ("cpu", "cuda", ...); None: detect
    dtype: str | None = None  # "float32", "bfloat16", "float16"; None: the platform's default
    text_encoder_dtype: str | None = None  # None: same as dtype
    attention_backend: str | None = None  # None: the platform's default
    output_path: str = "outputs"
    # The engine's step scheduler (diffserve.runtime.scheduler), for the server, the CLI and the API alike.
    #: Requests denoising at once, sharing DiT batches (1: one request at a time).
    max_running_requests: int = 8
    #: Cap on the running requests' latent tokens x CFG branches x outputs; None: the platform's default
    #: (`diffserve.runtime.scheduler.default_max_batch_tokens`).
    max_batch_tokens: int | None = None
    #: Share of the free memory measured after warm-up that running requests may use (admission budget).
    mem_fraction: float = 0.9
    #: Most denoising steps a request may ask for (`--max-inference-steps`); more is refused with a 400.
    max_inference_steps: int = 1000
    #: torch.compile the DiT's repeated blocks (regional: one compiled graph per block class).
    compile: bool = False
    #: (height, width) sizes generated once at startup so compilation and allocator warm-up happen
    #: before the first request; empty: none (the server still runs its 1-step warm-up).
    warmup_resolutions: list[tuple[int, int]] = field(default_factory=list)
    #: What a request's `quality="auto"` (or no quality) means: "high" (exact), "medium", "low" or "draft"
    #: (`configs/quality.py`; "lossless" and "hd" are accepted for "high").
    default_quality: str = EXACT
    #: Platform tuning of the process's memory allocator (`Platform.prepare_process`; on glibc CPUs:
    #: keep activation buffers mapped between steps). Off by default: its effect depends on the host.
    tune_allocator: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
