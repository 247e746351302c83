"""Engine-wide settings, fixed when the engine starts (one model, on one device or several ranks)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from diffserve.configs.quality import EXACT
from diffserve.distributed.config import ParallelConfig, ParallelConfigError


@dataclass(frozen=True)
class LoraSpec:
    """An adapter loaded when the engine starts (`--lora [NAME=]PATH[:SCALE]`): its name (default: the
    file's stem), its file, and the scale `--lora-merge` merges it at (and `generate` applies it at)."""

    name: str
    path: str
    scale: float = 1.0


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
    #: "native" (diffserve's own pipelines) or "diffusers": run the folder's Diffusers pipeline class through
    #: diffusers itself, one request at a time (`diffserve.backends`; the extra `diffserve[diffusers]`).
    backend: str = "native"
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
    # Multi-device (`diffserve.distributed.config.ParallelConfig`; SGLang's flag names): num_gpus ranks
    # = cfg (2 with enable_cfg_parallel) x tp_size x ulysses_degree x ring_degree. On the CPU each "gpu"
    # is one rank process over gloo.
    num_gpus: int = 1
    ulysses_degree: int | None = None  # None: num_gpus / (cfg x tp x ring)
    ring_degree: int = 1
    enable_cfg_parallel: bool = False
    tp_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None  # "host:port" of node 0 (multi-node); None: a loopback port
    #: Seconds a rank waits in one collective (a step's exchange, rank 0 waiting for a rank's reply)
    #: before the request fails with a timeout instead of hanging.
    dist_timeout: int = 600
    # LoRA adapters (`runtime/lora_registry.py`).
    #: Adapters loaded at start; requests name them. With `lora_merge`, merged into the weights instead.
    loras: list[LoraSpec] = field(default_factory=list)
    #: A folder whose `*.safetensors` requests and `POST /v1/loras` may name (nothing outside it).
    lora_dir: str | None = None
    #: Merge `loras` into the weights at start (no per-step cost; requests cannot choose adapters).
    lora_merge: bool = False
    #: Device bytes the resident adapters may take; past it the least recently used unpinned one is evicted.
    max_lora_memory: int = 2 * 2**30
    # Memory: quantization, single-file weights, offload (docs/memory.md).
    #: Weight-only quantization of the DiT's Linears at load: "int8" or "fp8"; None: full precision.
    quantization: str | None = None
    #: A single-file DiT checkpoint replacing the folder's DiT weights: a `.safetensors` with original
    #: (BFL / ComfyUI) or Diffusers key names, or a `.gguf`. The rest of the pipeline comes from the folder.
    transformer_weights: str | None = None
    #: Components kept in host memory that move to the device for their stage (`offload/`).
    text_encoder_cpu_offload: bool = False
    image_encoder_cpu_offload: bool = False
    vae_cpu_offload: bool = False
    #: Every VAE encode / decode in tiles (`models/vaes/tiling.py`); off, a decode is tiled only when the
    #: memory model says it would not fit untiled (one device; `runtime/memory.py`).
    vae_tiling: bool = False
    dit_cpu_offload: bool = False
    #: The DiT's blocks live in host memory and stream to the device one at a time, the next one's copy
    #: overlapping the current one's compute.
    dit_layerwise_offload: bool = False
    #: "auto": choose the offloads above from the device's free memory and the components' sizes;
    #: "none": only the flags above.
    offload: str = "none"
    #: Bytes of model weights the process may hold in host memory; past it the DiT's weights stay in their
    #: files and stream per block. None: no cap (weights load whole).
    max_memory: int | None = None

    def parallel_config(self) -> ParallelConfig:
        """The validated parallel layout (ParallelConfigError, a UserError, naming the flags)."""
        config = ParallelConfig.resolve(
            self.num_gpus, self.ulysses_degree, self.ring_degree, self.enable_cfg_parallel,
            self.tp_size, self.nnodes, self.node_rank, self.dist_init_addr,
        )  # fmt: skip
        if self.compile and config.tp_size > 1:
            # Untested with inductor (the row-parallel all-reduce inside compiled blocks).
            raise ParallelConfigError(
                f"--compile does not work with tensor parallelism yet (--tp-size {config.tp_size}); drop one"
            )
        if self.compile and config.sequence_parallel_degree > 1:
            # Compiled blocks cannot read which shard they run on (`distributed/sequence_split.py`).
            raise ParallelConfigError(
                "--compile does not work with sequence parallelism yet (ulysses x ring = "
                f"{config.sequence_parallel_degree}); drop --compile or use --enable-cfg-parallel"
            )
        return config

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
