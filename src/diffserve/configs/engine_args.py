"""Engine-wide settings, fixed when the engine starts (one model, on one device or several ranks). Each
field is declared once (`configs/option.py`): the `generate`, `serve` and `calibrate-cache` flags and
`DiffGenerator.from_pretrained`'s keywords are made from these declarations."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from diffserve.configs.batching import BATCH_POLICIES
from diffserve.configs.cache_settings import cache_default_from_flag
from diffserve.configs.memory_options import (
    OFFLOAD_MODES,
    QUANTIZATION_MODES,
    check_transformer_weights,
    parse_size,
)
from diffserve.configs.option import OptionGroup, option
from diffserve.configs.quality import DEFAULT_QUALITY_CHOICES, EXACT, canonical_tier
from diffserve.distributed.config import ParallelConfig, ParallelConfigError
from diffserve.errors import UserError

#: `--backend` choices; "native" is the default.
BACKENDS = ("native", "diffusers")

PARALLEL = OptionGroup(
    "multi-device",
    "num-gpus = cfg (2 with --enable-cfg-parallel) x tp x ulysses x ring; on the CPU each 'gpu' is one rank "
    "process over gloo",
)
LORA = OptionGroup(
    "LoRA adapters", "diffusers/PEFT, kohya and FLUX community LoRA files (.safetensors), applied to the DiT"
)
MEMORY = OptionGroup("memory", "quantization, single-file weights and offload (docs/memory.md)")


def _cpu_offload(component: str, held: str, use: str) -> bool:
    """The off-by-default switch `--COMPONENT-cpu-offload`, whose help is "keep HELD in host memory; USE"."""
    return option(
        False, cli=f"--{component}-cpu-offload", group=MEMORY, help=f"keep {held} in host memory; {use}"
    )


@dataclass(frozen=True)
class LoraSpec:
    """An adapter loaded when the engine starts (`--lora [NAME=]PATH[:SCALE]`): its name (default: the
    file's stem), its file, and the scale `--lora-merge` merges it at (and `generate` applies it at)."""

    name: str
    path: str
    scale: float = 1.0


@dataclass(frozen=True)
class ControlNetSpec:
    """A ControlNet loaded when the engine starts (`--controlnet [NAME=]PATH`): the name requests give it
    (default: the folder's name, a file's without its suffix) and its Diffusers model folder (config.json
    and safetensors) or single `.safetensors` file (XLabs' original FLUX.1 layout)."""

    name: str
    path: str


def controlnet_specs(value: object) -> list[ControlNetSpec]:
    """`EngineArgs.controlnets` as specs: `--controlnet` texts `[NAME=]PATH`, `ControlNetSpec`s, or (from
    Python) a {name: path} mapping; each name once. UserError naming `--controlnet` otherwise."""
    if isinstance(value, dict):
        value = [ControlNetSpec(str(name), str(path)) for name, path in value.items()]
    specs: list[ControlNetSpec] = []
    for item in value or ():
        if isinstance(item, ControlNetSpec):
            spec = item
        elif isinstance(item, (str, Path)):
            name, sep, path = str(item).partition("=")
            if not sep:
                given = Path(str(item))
                name, path = (given.stem if given.suffix == ".safetensors" else given.name), str(item)
            spec = ControlNetSpec(name.strip(), path)
        else:
            raise UserError(f"--controlnet: expected NAME=PATH, got {item!r}")
        if not spec.name:
            raise UserError(f"--controlnet {spec.path!r}: the ControlNet's NAME is empty (NAME=PATH)")
        given = Path(spec.path).expanduser()
        if not (given.is_dir() or (given.is_file() and given.suffix == ".safetensors")):
            raise UserError(
                f"--controlnet {spec.name}={spec.path}: neither a directory (a Diffusers ControlNet folder) nor a "
                ".safetensors file (a single-file ControlNet: XLabs' FLUX.1 ones)"
            )
        if any(known.name == spec.name for known in specs):
            raise UserError(f"--controlnet: two ControlNets are named {spec.name!r}; give each its own NAME")
        specs.append(spec)
    return specs


def parse_resolution(text: str) -> tuple[int, int]:
    """'WIDTHxHEIGHT' (OpenAI's size order) -> (height, width)."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(part.strip().isdigit() and int(part) > 0 for part in parts):
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT such as 1024x768, got {text!r}")
    width, height = (int(part) for part in parts)
    return height, width


def check_revision(text: str, flag: str) -> str:
    """A Hub revision: any non-blank text."""
    if not text.strip():
        raise UserError(f"{flag} must not be empty (omit it for the repo's main branch)")
    return text


def canonical_default_quality(text: str, flag: str) -> str:
    """A `--default-quality` name as its canonical tier ("lossless" -> "high")."""
    if text not in DEFAULT_QUALITY_CHOICES:
        raise UserError(f"{flag} must be one of {', '.join(DEFAULT_QUALITY_CHOICES)}, got {text!r}")
    return canonical_tier(text)


def check_lora_dir(text: str, flag: str) -> str:
    """An existing folder, as an absolute path."""
    folder = Path(text).expanduser()
    if not folder.is_dir():
        raise UserError(f"{flag} {text!r} is not a directory")
    return str(folder.absolute())


@dataclass
class EngineArgs:
    model_path: str = option(
        cli="--model-path",
        help="Diffusers model folder (with model_index.json) or Hugging Face repo id such as "
        "black-forest-labs/FLUX.1-dev (from the HF cache, else downloaded); "
        "default: the small demo model shipped with diffserve",
    )
    revision: str | None = option(
        None, cli="--revision", convert=check_revision,
        help="with a Hugging Face repo id: branch, tag or commit hash (default: main)",
    )  # fmt: skip
    device: str | None = option(
        None, cli="--device", help="platform: cpu, cuda, rocm, musa, xpu, npu, mps (default: detect)"
    )
    dtype: str | None = option(
        None, cli="--dtype", help="float32, bfloat16 or float16 (default: the platform's)"
    )
    text_encoder_dtype: str | None = option(
        None, cli="--text-encoder-dtype", help="dtype of the text encoders (default: --dtype)"
    )
    attention_backend: str | None = option(
        None, cli="--attention-backend",
        help="auto, sdpa, flash_attn_3, flash_attn, sage_attn, sdpa_cudnn or sdpa_efficient; a named one that "
        "cannot run here is an error (default: auto: the fastest exact one installed and supported, logged)",
    )  # fmt: skip
    output_path: str = option(
        "outputs", cli="--output-path", commands=("generate", "serve"),
        help="directory for output files: generate's images and videos, serve's response_format='url' images "
        "and /v1/videos jobs (default: outputs/)",
    )  # fmt: skip
    #: `diffserve.backends`; the extra `diffserve[diffusers]`.
    backend: str = option(
        "native", cli="--backend", choices=BACKENDS,
        help="native: diffserve's own pipelines; diffusers: run the folder's Diffusers pipeline class through "
        "diffusers (pipelines diffserve has not ported; one request at a time, exact quality only; needs "
        "pip install 'diffserve[diffusers]') (default: native)",
    )  # fmt: skip
    # The engine's step scheduler (diffserve.runtime.scheduler), for the server, the CLI and the API alike.
    max_running_requests: int = option(
        8, cli="--max-running-requests", min=1, commands=("serve",),
        help="requests running at once, sharing denoising steps as one DiT batch per shape (default: 8)",
    )  # fmt: skip
    #: None: `diffserve.runtime.scheduler.default_max_batch_tokens`.
    max_batch_tokens: int | None = option(
        None, cli="--max-batch-tokens", min=1, commands=("serve",),
        help="cap on running latent tokens x CFG branches x outputs (default: 65536; 16384 on CPU)",
    )  # fmt: skip
    #: `diffserve.runtime.batch_policy`: how many running requests share a DiT step.
    batch_policy: str = option(
        "auto", cli="--batch-policy", choices=BATCH_POLICIES, commands=("serve", "generate"),
        help="how many running requests share a denoising step: auto (as many as the measured step times say "
        "pays in throughput, else fewer: shortest remaining first), throughput (every request of a shape, "
        "shapes in turn) or latency (one at a time, shortest remaining first) (default: auto)",
    )  # fmt: skip
    #: The admission budget: a share of the free memory measured after warm-up.
    mem_fraction: float = option(
        0.9, cli="--mem-fraction", gt=0, max=1, commands=("serve", "generate"),
        help="share of the free memory after warm-up running requests may use; 413 if one never fits "
        "(default: 0.9)",
    )  # fmt: skip
    #: More is refused with a 400.
    max_inference_steps: int = option(
        1000, cli="--max-inference-steps", min=1, metavar="N",
        help="most denoising steps a request may ask for (default: 1000)",
    )  # fmt: skip
    #: Regional: one compiled graph per block class.
    compile: bool = option(
        False, cli="--compile",
        help="torch.compile the DiT's repeated blocks (dynamic shapes), compiled by a start-up warm-up",
    )  # fmt: skip
    #: `runtime/cuda_graph/`: the DiT's blocks captured per (batch bucket, token bucket) and replayed.
    enable_cuda_graph: bool = option(
        False, cli="--enable-cuda-graph",
        help="breakable CUDA graphs: capture the DiT's blocks per batch and prompt-length bucket during the "
        "warm-up (--warmup-resolutions; without it, on first use) and replay them; NVIDIA GPUs, FLUX.1, "
        "Qwen-Image and Z-Image DiTs; shapes not captured run eager (logged)",
    )  # fmt: skip
    #: (height, width) sizes; empty: none (the server still runs its 1-step warm-up).
    warmup_resolutions: list[tuple[int, int]] = option(
        default_factory=list, cli="--warmup-resolutions", parse=parse_resolution, metavar="WxH",
        help="sizes generated once at startup, e.g. 1024x1024 768x1344 (default: none)",
    )  # fmt: skip
    #: `configs/quality.py`; stored canonical ("high", not "lossless", in /server_info).
    default_quality: str = option(
        EXACT, cli="--default-quality", choices=DEFAULT_QUALITY_CHOICES, convert=canonical_default_quality,
        help="what quality='auto' means: high (exact; also hd, lossless) or a faster tier: medium, low, draft "
        "(default: high)",
    )  # fmt: skip
    #: `configs/cache_settings.py`; kept as the settings' JSON text (None: no default).
    cache_default: str | None = option(
        None, cli="--cache-default", convert=cache_default_from_flag, metavar="METHOD[:KEY=VALUE,...]|JSON",
        commands=("serve",),
        help="the cache accelerator of requests that set neither cache nor an approximate quality, as --cache "
        "takes it (default: none, the exact path)",
    )  # fmt: skip
    #: `Platform.prepare_process`. Off by default: its effect depends on the host.
    tune_allocator: bool = option(
        False, cli="--tune-allocator",
        help="CPU (glibc): keep activation buffers mapped between steps (measure: host-dependent)",
    )  # fmt: skip
    #: None: automatic (`CpuPlatform.configure_threads`; the README's hardware notes).
    cpu_threads: int | None = option(
        None, cli="--cpu-threads", min=1, metavar="N",
        help="torch CPU threads (intra- and inter-op) (default: automatic: on the CPU platform the whole CPUs "
        "this process may use, after its affinity mask and cgroup quota, shared among its ranks; OMP_NUM_THREADS "
        "if set)",
    )  # fmt: skip
    # Multi-device (`diffserve.distributed.config.ParallelConfig`; SGLang's flag names).
    num_gpus: int = option(
        1, cli="--num-gpus", min=1, metavar="N", group=PARALLEL,
        help="ranks (devices) one request runs on (default: 1)",
    )  # fmt: skip
    ulysses_degree: int | None = option(
        None, cli="--ulysses-degree", min=1, metavar="N", group=PARALLEL,
        help="Ulysses sequence parallel degree (default: what --num-gpus leaves: N / (cfg x tp x ring))",
    )  # fmt: skip
    ring_degree: int = option(
        1, cli="--ring-degree", min=1, metavar="N", group=PARALLEL, help="Ring attention degree (default: 1)"
    )
    enable_cfg_parallel: bool = option(
        False, cli="--enable-cfg-parallel", group=PARALLEL,
        help="run the positive and negative CFG branches on different ranks (cfg degree 2)",
    )  # fmt: skip
    tp_size: int = option(
        1, cli="--tp-size", min=1, metavar="N", group=PARALLEL, help="tensor parallel degree (default: 1)"
    )
    nnodes: int = option(
        1, cli="--nnodes", min=1, metavar="N", group=PARALLEL, help="machines the ranks span (default: 1)"
    )
    node_rank: int = option(
        0, cli="--node-rank", min=0, metavar="K", group=PARALLEL,
        help="this machine's index in [0, nnodes) (default: 0)",
    )  # fmt: skip
    dist_init_addr: str | None = option(
        None, cli="--dist-init-addr", metavar="HOST:PORT", group=PARALLEL,
        help="node 0's rendezvous address for multi-node runs (default: a free loopback port, or torchrun's)",
    )  # fmt: skip
    #: Covers a step's exchange and rank 0 waiting for a rank's reply: then the request fails, not hangs.
    dist_timeout: int = option(
        600, cli="--dist-timeout", min=1, metavar="SECONDS", group=PARALLEL,
        help="most seconds a rank waits for the others in one exchange (default: 600)",
    )  # fmt: skip
    # LoRA adapters (`runtime/lora_registry.py`; the flags' cross-checks: `cli/lora_flags.py`).
    #: Requests name them; with `lora_merge`, merged into the weights instead. From Python: {name: path}.
    loras: list[LoraSpec] = option(
        default_factory=list, cli="--lora", repeat=True, parse=str, metavar="[NAME=]PATH[:SCALE]", group=LORA,
        commands=("generate", "serve"),
        help="a LoRA file, as [NAME=]PATH[:SCALE] (NAME: the file's stem; SCALE: 1.0); repeatable. generate "
        "applies it to every prompt at SCALE (e.g. --lora ink.safetensors:0.8 --lora detail.safetensors); "
        'serve loads it at start as NAME, which requests apply with "loras": [{"name": NAME, "scale": 0.8}] '
        "(SCALE only matters with --lora-merge)",
    )  # fmt: skip
    lora_dir: str | None = option(
        None, cli="--lora-dir", convert=check_lora_dir, metavar="DIR", group=LORA, commands=("serve",),
        help="folder of LoRA files: requests may name any NAME.safetensors in it (read on first use) and "
        "POST /v1/loras loads files from it; nothing outside it is read (default: none)",
    )  # fmt: skip
    #: No per-step cost; requests cannot choose adapters.
    lora_merge: bool = option(
        False, cli="--lora-merge", group=LORA, commands=("serve",),
        help="merge the --lora adapters into the weights at their SCALE at start: no per-step cost, but "
        "requests cannot choose adapters",
    )  # fmt: skip
    #: Past it the least recently used unpinned adapter is evicted.
    max_lora_memory: int = option(
        2 * 2**30, cli="--max-lora-memory", min=1, convert=parse_size, metavar="SIZE", group=LORA,
        commands=("serve",),
        help="device memory the loaded adapters may take, in bytes or with a unit (512MiB, 2GiB); past it the "
        "least recently used idle one is unloaded (read again when named). Kept out of the requests' memory "
        "budget while LoRA is on (default: 2GiB)",
    )  # fmt: skip
    #: Loaded with --lora or POST /v1/loras, or named by requests from --lora-dir (those are forgotten when
    #: idle to make room). Bounds what a restarted engine replays, and the server's file handles.
    max_loras: int = option(
        64, cli="--max-loras", min=1, max=4096, metavar="N", group=LORA, commands=("serve",),
        help="most LoRA adapters the server knows at once (loaded, or named by requests from --lora-dir); "
        "loading one more is refused with 409 until one is unloaded (default: 64)",
    )  # fmt: skip
    #: ControlNets (FLUX.1, Qwen-Image, SD3) requests apply by name (`SamplingParams.controlnets`); from Python: {name: path}.
    controlnets: list[ControlNetSpec] = option(
        default_factory=list, cli="--controlnet", repeat=True, parse=str, metavar="[NAME=]PATH",
        commands=("serve", "generate"),
        help="a Diffusers FluxControlNetModel, QwenImageControlNetModel or SD3ControlNetModel folder, or an XLabs FLUX.1 ControlNet's original single .safetensors file, loaded at start as NAME (default: the folder's or file's name); "
        'repeatable. Requests apply it with "controlnets": [{"name": NAME, "image": ..., "scale": 0.7}]; '
        "generate applies it with --control-image (FLUX.1, Qwen-Image and SD3 text-to-image only)",
    )  # fmt: skip
    # Memory: quantization, single-file weights, offload (docs/memory.md).
    quantization: str | None = option(
        None, cli="--quantization", choices=QUANTIZATION_MODES, group=MEMORY,
        help="quantization of the DiT's Linears at load, per output channel (norms, embeddings and the final "
        "layer stay in full precision): int8 / fp8 weight-only, or fp8-dynamic: FP8 compute with per-token "
        "activation scales (NVIDIA compute capability >= 8.9, bf16); default: none",
    )  # fmt: skip
    #: The rest of the pipeline comes from the folder.
    transformer_weights: str | None = option(
        None, cli="--transformer-weights", convert=check_transformer_weights, metavar="PATH", group=MEMORY,
        help="a single-file DiT checkpoint replacing the folder's DiT weights: .safetensors (original "
        "BFL/ComfyUI or Diffusers key names, FP8 included) or .gguf (Q8_0, Q4_K, F16, ...)",
    )  # fmt: skip
    #: Components kept in host memory that move to the device for their stage (`offload/`).
    text_encoder_cpu_offload: bool = _cpu_offload(
        "text-encoder", "the text encoders", "they move to the device to encode"
    )
    image_encoder_cpu_offload: bool = _cpu_offload(
        "image-encoder", "the image encoder", "it moves to the device to encode"
    )
    vae_cpu_offload: bool = _cpu_offload("vae", "the VAE", "it moves to the device to encode or decode")
    #: `models/vaes/tiling.py`; off, a decode is tiled only when the memory model says it would not fit
    #: untiled (one device; `runtime/memory.py`).
    vae_tiling: bool = option(
        False, cli="--vae-tiling", group=MEMORY,
        help="decode (and encode) in overlapping tiles, as Diffusers' enable_tiling: less memory, slightly "
        "different pixels; without it a decode is tiled only when it would not fit in memory",
    )  # fmt: skip
    dit_cpu_offload: bool = _cpu_offload("dit", "the DiT", "it moves to the device while requests denoise")
    dit_layerwise_offload: bool = option(
        False, cli="--dit-layerwise-offload", group=MEMORY,
        help="keep the DiT's blocks in host memory and stream them to the device one at a time, the next "
        "block's copy overlapping the current block's compute",
    )  # fmt: skip
    offload: str = option(
        "none", cli="--offload", choices=OFFLOAD_MODES, group=MEMORY,
        help="auto: keep resident what fits in the device's free memory and offload the rest, least costly "
        "first (the plan is logged); none: only the flags above (default)",
    )  # fmt: skip
    #: None: no cap (weights load whole).
    max_memory: int | None = option(
        None, cli="--max-memory", min=1, convert=parse_size, metavar="SIZE", group=MEMORY,
        help="host memory the model's weights may take (e.g. 8GiB); past it the DiT's weights stay in their "
        "files and stream per block (slower, logged). Default: no cap",
    )  # fmt: skip

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
