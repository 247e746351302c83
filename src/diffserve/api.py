"""`DiffGenerator`: the Python entry point. Loads a Diffusers folder once, generates many times."""

from __future__ import annotations

import difflib
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from tqdm.auto import tqdm

from diffserve.backends import DIFFUSERS_BACKEND_DISABLED
from diffserve.backends.diffusers_pipeline import (
    BackendFamily,
    DiffusersBackendPipeline,
    load_diffusers_pipeline,
    task_of,
)
from diffserve.backends.engine_checks import check_backend_args
from diffserve.configs.cache_settings import parse_cache
from diffserve.configs.engine_args import EngineArgs, LoraSpec, controlnet_specs
from diffserve.configs.option import keyword_values, option_keywords
from diffserve.configs.quality import check_default_quality, read_calibrated_policies
from diffserve.configs.sampling_params import (
    ControlNetChoice,
    LoraChoice,
    SamplingParams,
    controlnet_choices,
    lora_choices,
)
from diffserve.distributed.config import ParallelConfigError
from diffserve.distributed.launch import RankGroup, is_follower, start_ranks
from diffserve.distributed.state import ParallelState
from diffserve.distributed.worker import STOP, describe_error, receive_message, send_status
from diffserve.errors import InvalidRequestError, ModelLoadError, RequestCancelledError, UserError
from diffserve.image_inputs import ImageSource, load_images
from diffserve.layers.attention import AttentionBackend, resolve_attention_backend
from diffserve.loader.component_loader import LoadedComponent, load_components, supports_tensor_parallel
from diffserve.loader.controlnets import load_controlnets, without_folder_controlnet
from diffserve.loader.dit_weights import DitLoadOptions
from diffserve.loader.folder_defaults import read_folder_sampling_defaults
from diffserve.loader.model_index import ModelIndex, read_model_index
from diffserve.loader.quantize import check_quantization_device
from diffserve.logging_setup import shown_text
from diffserve.masks import pipeline_mask
from diffserve.offload import install_memory_plan, log_plan, plan_memory, weight_residency
from diffserve.outputs import output_metadata, write_outputs
from diffserve.pipelines.base import Pipeline, PipelineContext
from diffserve.platforms import Platform, PlatformUnavailableError, resolve_platform
from diffserve.registry import DIT_FACTS, FAMILIES, PROMPT_PADDERS, ModelFamily, resolve_family
from diffserve.request import Req
from diffserve.runtime import Engine, MemoryModel, ScheduledRequest, SchedulerConfig
from diffserve.runtime.compile import (
    CompiledRegion,
    WarmupRun,
    compile_pipeline,
    compile_warmup_size,
    warm_up,
)
from diffserve.runtime.cuda_graph import (
    GraphRunner,
    check_cuda_graph_args,
    install_cuda_graphs,
    warmup_capture,
)
from diffserve.runtime.distributed_runner import DistributedRunner, follow_ops
from diffserve.runtime.lora_registry import LoraInfo, LoraRegistry, start_lora_registry
from diffserve.runtime.runner import ModelRunner
from diffserve.runtime.scheduler import default_max_batch_tokens
from diffserve.vae_tiling import enable_tiling_on

logger = logging.getLogger("diffserve")

_DTYPES = dict(
    float32=torch.float32, fp32=torch.float32, bfloat16=torch.bfloat16, bf16=torch.bfloat16,
    float16=torch.float16, fp16=torch.float16,
)  # fmt: skip


#: Seconds per step (not steps per second): the figure users compare between engines.
_BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_inv_fmt}]"


def parse_dtype(name: str | None, platform: Platform) -> torch.dtype:
    """A `--dtype` name as a torch dtype; None is the platform's default."""
    if name is None:
        return platform.default_dtype
    if name not in _DTYPES:
        raise UserError(f"unknown dtype {name!r}; choose one of: {', '.join(_DTYPES)}")
    return _DTYPES[name]


@dataclass
class GeneratedAudio:
    """One output video's soundtrack (LTX-2): float32 samples in [-1, 1] of shape (channels, samples)."""

    waveform: np.ndarray
    sample_rate: int


@dataclass
class GenerationOutput:
    """One request's result: its images (or video frames), the parameters it ran with, and its figures."""

    images: list[Image.Image]
    params: SamplingParams
    request_id: str
    timings: dict[str, float]
    step_times: list[float]
    peak_memory_mb: float | None
    output_paths: list[str] = field(default_factory=list)
    total_seconds: float = 0.0
    #: Video families: one uint8 array of shape (frames, height, width, 3) per output video.
    frames: list[np.ndarray] = field(default_factory=list)
    #: Denoising steps that ran the DiT's blocks in full: fewer than all with an approximate quality tier.
    steps_computed_in_full: int = 0
    #: With a cache method or an approximate tier: the method, its settings and the steps and blocks it
    #: computed and reused (`RequestCache.report`); None on the exact path.
    cache: dict[str, Any] | None = None
    #: Families that make sound with their video (LTX-2): one soundtrack per output video.
    audio: list[GeneratedAudio] = field(default_factory=list)


@dataclass
class LoadedModel:
    """A loaded pipeline and what it was loaded with (every rank loads one)."""

    pipeline: Pipeline | DiffusersBackendPipeline  # the latter with `--backend diffusers`
    family: ModelFamily | BackendFamily
    index: ModelIndex
    components: dict[str, LoadedComponent]
    dtype: torch.dtype
    attention_backend: AttentionBackend
    loras: LoraRegistry | None  # the LoRA adapters this rank's model serves (None: the backend takes none)
    compiled_regions: list[CompiledRegion] = field(default_factory=list)  # `--compile`: blocks compiled
    cuda_graphs: list[GraphRunner] = field(default_factory=list)  # `--enable-cuda-graph`: one per DiT


def check_tensor_parallel(index: ModelIndex, family: ModelFamily, tp_size: int) -> None:
    """`--tp-size` above 1 needs a DiT whose class shards itself (`supports_tensor_parallel`: every native
    DiT): else a ParallelConfigError naming the family, raised before anything loads. Text
    encoders and VAEs stay whole on every rank."""
    if tp_size == 1:
        return
    spec = index.components.get("transformer")
    dit = family.native_classes.models.get(spec.class_name) if spec is not None else None
    if dit is None or not supports_tensor_parallel(dit):
        what = spec.class_name if spec is not None else "no transformer component"
        supported = [
            f.name
            for f in FAMILIES
            if any(supports_tensor_parallel(c) for c in f.native_classes.models.values())
        ]
        raise ParallelConfigError(
            f"--tp-size {tp_size}: tensor parallelism is implemented for the DiTs of {', '.join(supported)}, "
            f"not for the {family.name} family's DiT ({what}); split its requests with --ulysses-degree / "
            "--ring-degree / --enable-cfg-parallel instead"
        )


def check_sequence_parallel(index: ModelIndex, family: ModelFamily, sp_degree: int) -> None:
    """Sequence parallelism (`--ulysses-degree` x `--ring-degree` above 1) needs a DiT that splits its
    sequence (`sequence_parallel`, true for every native DiT but those that declare otherwise): else a
    ParallelConfigError naming the family, raised before anything loads."""
    if sp_degree == 1:
        return
    spec = index.components.get("transformer")
    dit = family.native_classes.models.get(spec.class_name) if spec is not None else None
    if dit is not None and not getattr(dit, "sequence_parallel", True):
        raise ParallelConfigError(
            f"--ulysses-degree x --ring-degree = {sp_degree}: sequence parallelism is not implemented for the "
            f"{family.name} family's DiT ({spec.class_name}); use --tp-size or --enable-cfg-parallel instead"
        )


def load_model(
    engine_args: EngineArgs, platform: Platform, parallel_state: ParallelState | None = None
) -> LoadedModel:
    """Resolve the family of `engine_args.model_path` and load its pipeline onto `platform`'s device.
    With a `parallel_state` whose TP size is above 1, the DiT loads as this rank's tensor-parallel shard."""
    dtype = parse_dtype(engine_args.dtype, platform)
    text_dtype = parse_dtype(engine_args.text_encoder_dtype or engine_args.dtype, platform)
    logger.info("Platform: %s (%s), dtype: %s", platform.name, platform.device_name(), dtype)
    check_quantization_device(engine_args.quantization, platform, dtype)  # FP8 compute: before any loading
    check_cuda_graph_args(engine_args)
    try:
        attention_backend: AttentionBackend = resolve_attention_backend(
            engine_args.attention_backend, platform.device_type, platform.default_attention_backend,
            dtype=dtype, device=platform.device(),
        )  # fmt: skip
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    index = read_model_index(engine_args.model_path, engine_args.revision)
    if engine_args.backend == "diffusers":
        if engine_args.controlnets:
            raise UserError(
                "--controlnet: per-request ControlNets need the native backend (not --backend diffusers)"
            )
        return load_through_diffusers(index, platform, dtype, attention_backend)
    # A ControlNet pipeline folder: its base pipeline, with its ControlNet served as "default".
    index, folder_controlnet = without_folder_controlnet(index)
    # ControlNets run whole on every rank (CFG-parallel: each rank on its branch's rows; sequence
    # parallelism: each rank adds its image shard's slice of the residuals; TP: the DiT's image stream is
    # whole on every rank), so every parallel mode takes them.
    controlnet_specs_given = controlnet_specs(engine_args.controlnets)
    family = resolve_family(index.pipeline_class_name)
    tp_size = parallel_state.tp_size if parallel_state is not None else 1
    check_tensor_parallel(index, family, tp_size)
    check_sequence_parallel(index, family, parallel_state.sp_degree if parallel_state is not None else 1)
    pipeline_cls = family.pipeline_cls
    logger.info(
        "Resolved pipeline: %s -> diffserve %s (%s, native)",
        index.pipeline_class_name, pipeline_cls.__name__, family.name,
    )  # fmt: skip
    memory_plan = plan_memory(
        index, engine_args, platform, dtype, text_dtype,
        (*pipeline_cls.required_components, *pipeline_cls.optional_components),
    )  # fmt: skip
    log_plan(memory_plan)
    dit_options = DitLoadOptions(
        transformer_weights=None
        if engine_args.transformer_weights is None
        else Path(engine_args.transformer_weights),
        quantization=engine_args.quantization,
        mmap_weights=memory_plan.mmap_dit,
        facts=DIT_FACTS,
    )
    components = load_components(
        index, pipeline_cls.required_components, family.native_classes, platform, dtype, text_dtype,
        optional=pipeline_cls.optional_components, tensor_parallel=parallel_state,
        host_components=memory_plan.host_components, dit_options=dit_options,
    )  # fmt: skip
    folder_defaults = read_folder_sampling_defaults(index.root)
    if folder_defaults:
        logger.info("Sampling defaults from the model folder's diffserve.json: %s", folder_defaults)
    try:
        default_quality = check_default_quality(engine_args.default_quality)  # "lossless" -> "high"
        calibrated = read_calibrated_policies(index.root, family.name)
        default_cache = parse_cache(engine_args.cache_default)  # JSON text (or a mapping) -> settings
        pipeline = pipeline_cls(
            PipelineContext(
                components, platform, dtype, folder_sampling_defaults=folder_defaults,
                pipeline_options=index.options, default_quality=default_quality,
                calibrated_step_cache=calibrated, default_cache=default_cache,
            )
        )  # fmt: skip
    except InvalidRequestError as exc:  # a default tier or cache this family does not have
        flag = "--cache-default" if exc.param == "cache" else "--default-quality"
        raise UserError(f"{flag}: {exc}") from exc
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    load_controlnets(controlnet_specs_given, folder_controlnet, pipeline, family.name, platform, dtype)
    install_memory_plan(memory_plan, components, platform)  # before LoRA wraps the DiT's Linears
    if engine_args.vae_tiling:
        tiled = enable_tiling_on({n: c.value for n, c in components.items()})
        logger.info("VAE tiling (--vae-tiling) on: %s", ", ".join(tiled) or "no component has the switch")
    loras = start_lora_registry(
        {n: c.value for n, c in components.items()}, family.name, index.components["transformer"].class_name,
        DIT_FACTS, platform.device(), dtype, engine_args.loras, engine_args.lora_dir, engine_args.lora_merge,
        engine_args.max_lora_memory, compiled=engine_args.compile, max_count=engine_args.max_loras,
    )  # fmt: skip
    compiled = compile_pipeline({n: c.value for n, c in components.items()}) if engine_args.compile else []
    graphs = (
        install_cuda_graphs({n: c.value for n, c in components.items()}, platform, PROMPT_PADDERS)
        if engine_args.enable_cuda_graph
        else []
    )
    return LoadedModel(pipeline, family, index, components, dtype, attention_backend, loras, compiled, graphs)


def load_through_diffusers(
    index: ModelIndex, platform: Platform, dtype: torch.dtype, attention_backend: AttentionBackend
) -> LoadedModel:
    """`--backend diffusers`: the folder's Diffusers pipeline class, loaded and run by diffusers itself."""
    name = index.pipeline_class_name
    pipeline = load_diffusers_pipeline(index.root, platform, dtype)
    family = BackendFamily(f"diffusers:{name}", name, task_of(pipeline))
    logger.info(
        "Resolved pipeline: %s -> %s (backend diffusers, %s); disabled: %s",
        name, pipeline.describe(), family.task, "; ".join(DIFFUSERS_BACKEND_DISABLED),
    )  # fmt: skip
    components = pipeline.context.components
    return LoadedModel(pipeline, family, index, components, dtype, attention_backend, loras=None)


def serve_rank(state: ParallelState, engine_args: EngineArgs, platform: Platform) -> None:
    """A worker rank's life after joining the group: load the same model, report ready (the `ready`
    exchange of `DiffGenerator._wait_for_ranks`), then run rank 0's ops until it says stop."""
    try:
        model = load_model(engine_args, platform, state)
    except Exception as exc:
        logger.exception("rank %d: loading the model failed", state.rank)
        send_status(state, describe_error(exc))
        if receive_message(state) != STOP:  # rank 0 stops every rank after a failed load
            raise RuntimeError("rank 0 sent an op after this rank failed to load the model") from exc
        return
    send_status(state, None)
    runner = ModelRunner(model.pipeline, platform, model.attention_backend, parallel_state=state)
    runner.loras = model.loras
    follow_ops(state, runner)


class DiffGenerator:
    """Generate images from a Diffusers-format model folder with diffserve's native pipelines. With
    `num_gpus > 1` it starts the other ranks (`diffserve.distributed.launch`): use it as a context manager,
    or call `close()`, to stop them (they also exit when this process does). Its engine admits requests by
    the memory model the server's does (`build_memory_model`), built at the end of loading unless
    `memory_model=False` (the server's engine process builds it after its own warm-up)."""

    def __init__(
        self, engine_args: EngineArgs, show_progress: bool = True, *, memory_model: bool = True
    ) -> None:
        start = time.perf_counter()
        self.engine_args = engine_args
        parallel = engine_args.parallel_config()  # ParallelConfigError before anything starts or loads
        check_backend_args(engine_args)  # `--backend diffusers` with a flag it cannot honour: refused now
        sp_degree = parallel.sequence_parallel_degree
        if parallel.is_distributed and (parallel.tp_size > 1 or sp_degree > 1):  # refused before any start
            index = read_model_index(engine_args.model_path, engine_args.revision)
            index = without_folder_controlnet(index)[0]
            family = resolve_family(index.pipeline_class_name)
            check_tensor_parallel(index, family, parallel.tp_size)
            check_sequence_parallel(index, family, sp_degree)
        try:
            platform = self.platform = resolve_platform(engine_args.device)
        except PlatformUnavailableError as exc:
            raise UserError(str(exc)) from exc
        if engine_args.tune_allocator:
            platform.prepare_process()
        # Before the ranks start: they take this process's thread count.
        platform.configure_threads(engine_args.cpu_threads, processes=parallel.ranks_per_node)
        #: With several ranks: the other ranks' processes and the process group (None on one device).
        self.ranks: RankGroup | None = None
        if parallel.is_distributed:
            if is_follower(parallel):
                raise UserError(
                    "this process is not rank 0: run diffserve.distributed.launch.run_follower(engine_args, "
                    "diffserve.api.serve_rank) here instead of creating a DiffGenerator (the CLI does)"
                )
            self.ranks = start_ranks(engine_args, platform, serve_rank)
        try:
            model = load_model(engine_args, platform, self.ranks.state if self.ranks is not None else None)
            self._wait_for_ranks(None)
        except BaseException as exc:
            self._wait_for_ranks(exc)
            self.close()
            raise
        self.pipeline: Pipeline | DiffusersBackendPipeline = model.pipeline
        self.family: ModelFamily | BackendFamily = model.family
        self.dtype, self.attention_backend = model.dtype, model.attention_backend
        #: The model as named (a folder, or a Hub repo id), as outputs' metadata and the server show it.
        self.model_path = model.index.name
        #: The local folder the components were loaded from (for a Hub repo id: its cached snapshot).
        self.model_folder = model.index.root
        self.show_progress = show_progress
        max_tokens = engine_args.max_batch_tokens or default_max_batch_tokens(platform.device_type)
        # The diffusers backend runs one request at a time: its call keeps per-call state on the pipeline.
        one_at_a_time = engine_args.backend == "diffusers"
        scheduler = SchedulerConfig(
            max_running_requests=1 if one_at_a_time else engine_args.max_running_requests,
            max_batch_tokens=max_tokens,
            max_inference_steps=engine_args.max_inference_steps,
            batch_policy=engine_args.batch_policy,
        )
        runner = (
            DistributedRunner(self.pipeline, platform, self.attention_backend, self.ranks)
            if self.ranks is not None
            else None
        )
        #: The request loop every generation runs through (the server's engine process runs one too).
        self.engine = Engine(
            self.pipeline, platform, scheduler, attention_backend=self.attention_backend, runner=runner
        )
        self.engine.runner.loras = model.loras
        logger.info("Pipeline ready in %.2f seconds", time.perf_counter() - start)
        #: `--compile`: the block lists compiled; `--warmup-resolutions`: the warm-up generations run.
        self.compiled_regions = model.compiled_regions
        #: `--enable-cuda-graph`: the DiTs' breakable CUDA graphs (captured in the warm-up below).
        self.cuda_graphs = model.cuda_graphs
        sizes = list(engine_args.warmup_resolutions)
        if engine_args.compile and not sizes:  # the graphs are size-generic: one small warm-up builds them
            facts = self.pipeline.facts
            sizes = [facts.probe_size or compile_warmup_size(facts.pixel_multiple)]
        with warmup_capture(self.cuda_graphs, sizes_given=bool(engine_args.warmup_resolutions)):
            self.warmup_runs: list[WarmupRun] = self.warm_up(sizes) if sizes else []
        if memory_model:
            self.build_memory_model()

    def build_memory_model(self, calibrate: bool = False) -> MemoryModel:
        """Build the engine's memory model from the loaded components (`Engine.build_memory_model`, the one
        the server's engine uses): a request that can never fit the budget (free memory now x
        `mem_fraction`, less the LoRA reserve) is refused with the server's 413 message, and a decode that
        would not fit untiled is tiled. `calibrate` measures it with probe requests (the server does after
        its warm-up); else it is estimated from the DiT's width. Call again to measure the budget anew."""
        components = {name: c.value for name, c in self.pipeline.context.components.items()}
        weights = weight_residency(components)  # offloaded components: what moves in for a stage
        return self.engine.build_memory_model(self.engine_args, weights, components.get("vae"), calibrate)

    def _wait_for_ranks(self, error: BaseException | None) -> None:
        """The `ready` exchange: every rank says whether its pipeline loaded; a rank that failed is a
        ModelLoadError naming it (rank 0's own `error` is re-raised by the caller)."""
        if self.ranks is None or self.ranks.failure is not None or self.ranks.closed:
            return
        statuses = self.ranks.gather(None if error is None else describe_error(error))
        failed = [(rank, text) for rank, text in enumerate(statuses) if text is not None and rank != 0]
        if failed and error is None:
            rank, text = failed[0]
            raise ModelLoadError(f"rank {rank} could not load the model: {text}")

    def close(self) -> None:
        """Stop the other ranks and join their processes (idempotent; nothing to do on one device).
        The generator cannot generate after this with several ranks."""
        if self.ranks is not None:
            self.ranks.close()

    def __enter__(self) -> DiffGenerator:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def warm_up(self, resolutions: Sequence[tuple[int, int]]) -> list[WarmupRun]:
        """Short generations at each (height, width) (every batch kind of `WARMUP_KINDS` at the first), so
        compilation (`--compile`) and allocator growth happen now rather than in the first requests."""
        start = time.perf_counter()
        args, lora = self.engine_args, None
        if args.compile and not args.lora_merge and (args.loras or args.lora_dir is not None):
            # LoRA batches trace graphs of their own (layers/trace_scope.py): warm them up with an adapter
            # loaded at start-up, or say when they will compile.
            if args.loras:
                lora = LoraChoice(args.loras[0].name)
            else:
                logger.info("--compile: no adapter loaded at start-up; LoRA batches compile on first use")
        runs = warm_up(self.generate_from_params, self.pipeline.facts, resolutions, lora)
        logger.info(
            "Warm-up of %d size(s) done in %.2f seconds", len(resolutions), time.perf_counter() - start
        )
        return runs

    @classmethod
    @option_keywords(EngineArgs, skip=("model_path",))
    def from_pretrained(
        cls, model_path: str | Path, *, show_progress: bool = True, **options: object
    ) -> DiffGenerator:
        """Load a Diffusers folder, or a Hugging Face repo id (`"owner/name"`: from the local HF cache,
        else downloaded; `revision` picks a branch, tag or commit). The keywords are `EngineArgs`' fields,
        each as its CLI flag (`compile=True` is `--compile`), checked as the flag is (a value out of its
        bounds or choices: UserError naming the keyword; any other keyword: TypeError). Besides: `loras`
        is a {name: path} mapping (or `LoraSpec`s) of adapters loaded now, and paths may be `Path`s.
        `num_gpus` > 1 starts the other ranks: `close()` the generator, or use it in a `with` block.
        Memory options: docs/memory.md; `backend="diffusers"`: pipelines diffserve has not ported."""
        values = keyword_values(EngineArgs, options, "from_pretrained", accepted=("show_progress",))
        loras, sizes = values.get("loras"), values.get("warmup_resolutions")
        if isinstance(loras, Mapping):
            values["loras"] = [LoraSpec(str(name), os.fspath(path)) for name, path in loras.items()]
        if isinstance(sizes, Sequence):
            values["warmup_resolutions"] = [(int(height), int(width)) for height, width in sizes]
        args = EngineArgs(model_path=os.fspath(model_path), **values)  # type: ignore[arg-type]
        return cls(args, show_progress=show_progress)

    # -- LoRA adapters (README, "LoRA") --------------------------------------------------------------

    def load_lora(self, name: str, path: str | Path, strict: bool = True) -> LoraInfo:
        """Load a LoRA file (diffusers/PEFT, kohya or a FLUX community format) as adapter `name`, which
        requests then apply with `loras=[{"name": name, "scale": 0.8}]`. `strict=False` applies what
        matches this model and logs what it ignored; else such a file is an error (LoraError). The file
        is read and checked here, on the caller's thread; only registering it waits for a step boundary."""
        registry = self.engine.runner.loras
        if registry is not None:
            registry.prepare(name, path, strict)
        return self.engine.run_exclusive(lambda: self.engine.runner.load_lora(name, str(path), strict))

    def unload_lora(self, name: str) -> None:
        """Unload adapter `name` (LoraError while a running request uses it)."""
        self.engine.run_exclusive(lambda: self.engine.runner.unload_lora(name))

    def loras(self) -> list[LoraInfo]:
        """The adapters this generator knows: name, file, family, format, rank, bytes, targets, in use."""
        return self.engine.runner.lora_infos()

    def generate(
        self,
        prompt: str | Sequence[str] = "",
        *,
        image: ImageSource | Sequence[ImageSource] | None = None,
        mask: ImageSource | None = None,
        video: Sequence[ImageSource | np.ndarray] | np.ndarray | None = None,
        save_output: bool = False,
        output_path: str | None = None,
        output_file_name: str | None = None,
        save_frames: bool = False,
        **params: Any,
    ) -> GenerationOutput | list[GenerationOutput]:
        """Generate for one prompt, or for each prompt of a list (then a list of outputs, in order).
        Keyword args are SamplingParams fields; `save_frames` also writes each video's frames as PNGs.
        Thread-safe; the requests of one call, and of concurrent calls, share DiT batches. `image`
        (`input_images`, one or several) and `mask` (`mask_image`, one): each a file path, encoded bytes,
        a PIL image or a base64 data URL (never an http(s) URL). On FLUX.1, SD3, Z-Image and Qwen-Image
        folders an `image` runs image-to-image (`strength=`, 0-1, the SamplingParams field) and a `mask`
        inpaints; FLUX.1 Fill needs both. A mask's transparent pixels, or without alpha its white ones,
        mark the area to repaint (`diffserve.masks`). `video` (`input_video`): the frames of a video to
        extend (SkyReels-V2 diffusion forcing's video-to-video folders; other families refuse it), as a
        sequence of images (each as `image` takes it, or a uint8 (H, W, 3) array) or a uint8 (F, H, W, 3)
        array (a video file: decode it with `diffserve.video_inputs.load_video`, as `diffserve generate
        --video PATH` and POST /v1/videos' `video` do)."""
        if video is not None:
            if "input_video" in params:
                raise UserError("pass the input video as either video= or input_video=, not both")
            params["input_video"] = _video_frames(video)
        if image is not None:
            if "input_images" in params:
                raise UserError("pass the input images as either image= or input_images=, not both")
            params["input_images"] = load_images(image, param="image", keep_alpha=True)
        if mask is not None:
            if isinstance(mask, (list, tuple)):
                raise UserError("mask: pass one mask image, not a list")
            params["mask_image"] = load_images(mask, param="mask", as_mask=True)[0]
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise UserError("prompt: pass a string or a non-empty list of strings")
        control = {name: params.pop(name) for name in CONTROLNET_KEYWORDS if name in params}
        check_generate_keywords(params)
        if "loras" in params:
            params["loras"] = lora_choices(params["loras"])
        if control or "controlnets" in params:
            loaded = list(getattr(self.pipeline, "controlnets", {}))
            params["controlnets"] = controlnet_entries(params.get("controlnets"), control, loaded)
        sampling = [SamplingParams(prompt=p, **params) for p in prompts]
        outputs = self.generate_many(sampling, save_output, output_path, output_file_name, save_frames)
        return outputs[0] if isinstance(prompt, str) else outputs

    def generate_from_params(
        self,
        params: SamplingParams,
        save_output: bool = False,
        output_path: str | None = None,
        file_name: str | None = None,
        request: Req | None = None,
        save_frames: bool = False,
    ) -> GenerationOutput:
        """Run one request. Pass `request` (a `Req` over `params`) to control it from another thread:
        its `cancel_event` stops it at the next step boundary, its `on_step` reports progress."""
        requests = [request] if request is not None else None
        return self.generate_many([params], save_output, output_path, file_name, save_frames, requests)[0]

    def generate_many(
        self,
        params: Sequence[SamplingParams],
        save_output: bool = False,
        output_path: str | None = None,
        file_name: str | None = None,
        save_frames: bool = False,
        requests: Sequence[Req] | None = None,
    ) -> list[GenerationOutput]:
        """Run several requests through the engine together (they share DiT batches where their shapes
        allow) and return their outputs in order. Every request is validated before any model work: one
        invalid request fails the call before the others start."""
        start = time.perf_counter()
        reqs = list(requests) if requests is not None else [Req(params=p) for p in params]
        if len(reqs) != len(params):
            raise ValueError("requests and params must have the same length")
        scheduled: list[ScheduledRequest] = []
        try:
            for req in reqs:
                scheduled.append(self.engine.prepare(req))  # validates and costs each (fail fast)
        except BaseException:
            for sr in scheduled:  # prepared, never queued: what they hold is let go
                self.engine.discard(sr)
            raise
        for sr in scheduled:
            log_sampling_params(sr.req.params)
        # One seconds-per-step bar over the denoising steps of these requests (the CLI's bar).
        total_steps = sum(int(sr.req.params.num_inference_steps or 0) for sr in scheduled)
        with tqdm(
            total=total_steps, disable=not self.show_progress, unit="step", bar_format=_BAR_FORMAT
        ) as bar:
            for sr in scheduled:
                sr.req.on_step = _with_progress(sr.req.on_step, bar)
                self.engine.enqueue(sr)
            self.engine.run_to_completion(scheduled)
        outputs = []
        for sr in scheduled:
            if sr.state == "cancelled":
                raise RequestCancelledError(f"request {sr.request_id} cancelled at step {sr.req.step_index}")
            if sr.state != "finished":
                assert sr.error is not None
                raise sr.error
            outputs.append(self._output(sr, start, save_output, output_path, file_name, save_frames))
        return outputs

    def _output(
        self, sr: ScheduledRequest, start: float, save_output: bool, output_path: str | None,
        file_name: str | None, save_frames: bool,
    ) -> GenerationOutput:  # fmt: skip
        req = sr.req
        peak_mb = sr.peak_memory_bytes / 2**20 if sr.peak_memory_bytes is not None else None
        if peak_mb is not None:
            where = "process RSS" if self.platform.name == "cpu" else "device"
            logger.info("Peak memory: %.2f MB (%s)", peak_mb, where)
        paths: list[str] = []
        audio = [
            GeneratedAudio(w.numpy(), int(req.outputs.audio_sample_rate)) for w in req.outputs.audio or []
        ]
        if save_output:
            written = write_outputs(
                Path(output_path or self.engine_args.output_path), req.params, req.request_id,
                output_metadata(self.model_path, self.family.diffusers_pipeline, req.params),
                images=req.outputs.images or [], videos=req.outputs.frames or [],
                file_name=file_name, save_frames=save_frames,
                audio=[a.waveform for a in audio], audio_sample_rate=req.outputs.audio_sample_rate,
            )  # fmt: skip
            for path in written:
                logger.info("Output saved to %s", path)
            paths = [str(path) for path in written]
        total = time.perf_counter() - start
        logger.info("Pixel data generated in %.2f seconds", total)
        return GenerationOutput(
            images=req.outputs.images or [],
            frames=req.outputs.frames or [],
            params=req.params,
            request_id=req.request_id,
            timings=dict(req.timings.stages),
            step_times=list(req.timings.steps),
            peak_memory_mb=peak_mb,
            output_paths=paths,
            total_seconds=total,
            steps_computed_in_full=req.steps_computed_in_full,
            cache=req.cache_report,
            audio=audio,
        )


#: `DiffGenerator.generate`'s own keyword arguments, besides the SamplingParams fields.
#: Diffusers' `FluxControlNetPipeline` keywords `generate` takes, turned into `controlnets` entries
#: (`control_mask`: that of Diffusers' ControlNet inpainting pipelines, for an inpainting ControlNet).
CONTROLNET_KEYWORDS = (
    "control_image",
    "controlnet_conditioning_scale",
    "control_guidance_start",
    "control_guidance_end",
    "control_mode",
    "control_mask",
)
_GENERATE_KEYWORDS = (
    "image", "mask", "video", "save_output", "output_path", "output_file_name", "save_frames", *CONTROLNET_KEYWORDS,
)  # fmt: skip


def _per_entry(name: str, value: object, count: int) -> list[object]:
    """A Diffusers ControlNet keyword's value for each of `count` entries: one value for all, or a list of
    `count` (InvalidRequestError naming the keyword otherwise)."""
    if not isinstance(value, (list, tuple)):
        return [value] * count
    if len(value) != count:
        raise InvalidRequestError(
            f"{name} lists {len(value)} values for {count} control image(s); give one, or one per image",
            param=name,
        )
    return list(value)


def controlnet_entries(
    entries: object, keywords: Mapping[str, object], loaded: Sequence[str]
) -> list[ControlNetChoice]:
    """`generate`'s ControlNet arguments as `controlnets` entries, their images decoded: `controlnets=[...]`
    (dicts or `ControlNetChoice`s, each image a path, bytes, PIL image or data URL), or Diffusers' keywords
    (`control_image`, one image or a list, with `controlnet_conditioning_scale`, `control_guidance_start`,
    `control_guidance_end`, `control_mode` and an inpainting ControlNet's `control_mask`, each one value or
    one per image), which apply the one loaded ControlNet (with several loaded, name them in `controlnets`).
    A mask (white or, with alpha, transparent = repaint) is decoded like an image, then made what the
    pipelines read (`pipeline_mask`: 255 = repaint), as the server's `controlnets[i].mask` is."""
    if keywords:
        if entries:
            raise InvalidRequestError(
                "pass ControlNets either as controlnets=[...] or as control_image= and its keywords, not both",
                param="controlnets",
            )
        if "control_image" not in keywords:
            raise InvalidRequestError(
                f"{', '.join(keywords)} without control_image: pass the control image", param="control_image"
            )
        if len(loaded) != 1:
            have = ", ".join(map(repr, loaded)) or "none"
            raise InvalidRequestError(
                f"control_image applies the one loaded ControlNet, but {len(loaded)} are loaded ({have}): name "
                'each in controlnets=[{"name": ..., "image": ...}]',
                param="control_image",
            )
        images = keywords["control_image"]
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        n = len(images)
        columns = {
            "image": images,
            "scale": _per_entry("controlnet_conditioning_scale", keywords.get("controlnet_conditioning_scale", 1.0), n),
            "start": _per_entry("control_guidance_start", keywords.get("control_guidance_start", 0.0), n),
            "end": _per_entry("control_guidance_end", keywords.get("control_guidance_end", 1.0), n),
            "mode": _per_entry("control_mode", keywords.get("control_mode"), n),
            "mask": _per_entry("control_mask", keywords.get("control_mask"), n),
        }  # fmt: skip
        entries = [{"name": loaded[0], **{k: v[i] for k, v in columns.items()}} for i in range(n)]
    choices = controlnet_choices(entries)
    decoded = []
    for i, choice in enumerate(choices):
        image, mask = choice.image, choice.mask
        if image is not None:
            image = load_images(image, param=f"controlnets[{i}].image")[0]
        if mask is not None:
            mask = pipeline_mask(load_images(mask, param=f"controlnets[{i}].mask", as_mask=True)[0])
        decoded.append(replace(choice, image=image, mask=mask))
    return decoded


def _video_frames(video: Sequence[ImageSource | np.ndarray] | np.ndarray) -> list[Image.Image]:
    """`generate(video=...)`'s frames as RGB PIL images, in order: a uint8 (F, H, W, 3) array, or a sequence
    of frames, each a uint8 (H, W, 3) array or anything `load_images` reads (InvalidRequestError otherwise,
    or for no frame)."""
    frames = list(video)
    if not frames:
        raise InvalidRequestError("video: pass at least one frame", param="video")
    loaded = []
    for index, frame in enumerate(frames):
        if isinstance(frame, np.ndarray):
            if frame.dtype != np.uint8 or frame.ndim != 3 or frame.shape[2] != 3:
                raise InvalidRequestError(
                    f"video: frame {index} is a {frame.dtype} array of shape {frame.shape}; frames as arrays "
                    "must be uint8 (height, width, 3)",
                    param="video",
                )
            loaded.append(Image.fromarray(frame))
        else:
            loaded.extend(load_images(frame, param="video"))
    return loaded


def check_generate_keywords(params: Mapping[str, object]) -> None:
    """Refuse keywords of `generate` that are not SamplingParams fields, naming them and listing the valid
    ones (rather than Python's TypeError about `SamplingParams.__init__()`, a name the caller never used)."""
    valid = [f.name for f in fields(SamplingParams) if f.name != "prompt"]
    unknown = [name for name in params if name not in valid]
    if not unknown:
        return
    close = difflib.get_close_matches(unknown[0], [*valid, *_GENERATE_KEYWORDS], n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise InvalidRequestError(
        f"generate() got unknown keyword argument(s) {', '.join(map(repr, unknown))}{hint}; valid ones: "
        f"{', '.join([*valid, *_GENERATE_KEYWORDS])}",
        param=unknown[0],
    )


def _with_progress(on_step: Callable[[Req], None] | None, bar: tqdm) -> Callable[[Req], None]:
    def report(req: Req) -> None:
        bar.update(1)
        if on_step is not None:
            on_step(req)

    return report


def log_sampling_params(params: SamplingParams) -> None:
    """Log a request's parameters, one aligned line each."""
    shown = {k: v for k, v in params.to_dict().items() if k != "extra"}
    for key in ("prompt", "negative_prompt"):  # client text: quoted, escaped and cut for one log line
        if isinstance(shown.get(key), str):
            shown[key] = shown_text(shown[key])
    width = max(len(k) for k in shown)
    lines = "\n".join(f"    {k:>{width}}: {v}" for k, v in shown.items())
    logger.info("Sampling params:\n%s", lines)
