"""`Req`: the one object that flows through a pipeline's stages.

`Req` declares what every request carries, whatever its family: its params, the text states of its CFG
branches, its latents, its `Schedule`, its step state, its `RequestOutputs` and its `Timings`. What only
one family (or one kind of input) needs lives in `conditioning`: a typed `Conditioning` dataclass declared
in that family's package (`families/<name>/conditioning.py`), or, for conditioning several families share,
in `stages/`.

Code that treats fields generically does not list them by name: a field says through its `role(...)`
metadata how it is treated. `negative_of` pairs a negative (CFG) branch's field with its positive one
(CFG-parallel branch views swap them), `stepped` marks what a denoising step advances, `per_step` a table
indexed by step (cut with the schedule), and `batch` what requests sharing one DiT batch must agree on. The
same roles apply on `Req`, on `Schedule` and on every conditioning class, so a family with a new text
branch or a new per-step table declares it in its conditioning class and the runtime picks it up. Stages
name the fields they read and write (`needs`/`sets`, checked in `stages/base.py`): a `Req` field, or a
field of one of its grouped objects as "<group>.<field>" ("schedule.guidance", "outputs.images",
"conditioning.audio_latents"). Nothing is forwarded implicitly.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Hashable, Mapping
from dataclasses import Field, dataclass, field, fields, replace
from typing import Any, Literal, NamedTuple, TypeVar

import numpy as np
import torch
from PIL import Image

from diffserve.configs.sampling_params import SamplingParams
from diffserve.layers.lora_rows import AppliedLora
from diffserve.models.cache_methods.base import RequestCache

#: What requests batched into one DiT forward must agree on for a field: "shape", its shape past the
#: batch axis (None when unset); "value", the value itself (made hashable: lists become tuples).
BatchRule = Literal["shape", "value"]


@dataclass(frozen=True)
class FieldRole:
    """How generic code treats one field of `Req` or of a `Conditioning` (see the module docstring)."""

    #: This field holds the negative (CFG) branch's value of the named field of the same class.
    negative_of: str | None = None
    #: A denoising step advances it (CFG-parallel views copy it in before a step and back after).
    stepped: bool = False
    #: Indexed by denoising step on its first axis (a schedule's sigmas have one entry more, the end):
    #: image-to-image cuts it with the schedule (`stages/image_to_image.truncate_schedule`).
    per_step: bool = False
    #: Requests in one DiT batch must agree on it (`BatchRule`).
    batch: BatchRule | None = None


_ROLE = "diffserve.role"
_NO_ROLE = FieldRole()


def role(
    *,
    negative_of: str | None = None,
    stepped: bool = False,
    per_step: bool = False,
    batch: BatchRule | None = None,
) -> Mapping[str, FieldRole]:
    """The `metadata` of a field with this role: `field(default=None, metadata=role(...))`."""
    return {_ROLE: FieldRole(negative_of, stepped, per_step, batch)}


def field_role(declared: Field[object]) -> FieldRole:
    """The role a field declares (the empty role when it declares none)."""
    found = declared.metadata.get(_ROLE, _NO_ROLE)
    assert isinstance(found, FieldRole)
    return found


def negative_pairs(obj: Req | Conditioning) -> list[tuple[str, str]]:
    """(positive field, negative field) for every negative-branch field `obj`'s class declares."""
    declared = {f.name: f for f in fields(obj)}
    pairs = []
    for name, f in declared.items():
        positive = field_role(f).negative_of
        if positive is None:
            continue
        if positive not in declared:
            raise TypeError(
                f"{type(obj).__name__}.{name} is the negative of {positive!r}, which it does not have"
            )
        pairs.append((positive, name))
    return pairs


def one_branch(obj: Req | Conditioning, branch: int) -> dict[str, object]:
    """The values that make `obj` carry only `branch` (0: the prompt's, 1: the negative prompt's): with
    branch 1 each positive field takes its negative's value; every negative field is cleared."""
    values: dict[str, object] = {}
    for positive, negative in negative_pairs(obj):
        if branch == 1:
            values[positive] = getattr(obj, negative)
        values[negative] = None
    return values


def stepped_fields(obj: Req | Conditioning) -> list[str]:
    """The fields of `obj` a denoising step advances."""
    return [f.name for f in fields(obj) if field_role(f).stepped]


def per_step_fields(obj: Schedule | Conditioning) -> list[str]:
    """The fields of `obj` indexed by denoising step."""
    return [f.name for f in fields(obj) if field_role(f).per_step]


D = TypeVar("D", "Schedule", "Conditioning")


def from_step(obj: D, start: int) -> D:
    """A copy of `obj` whose per-step tables (the fields it declares `per_step`) start at step `start`;
    its other fields are shared. `obj` itself is unchanged."""
    tables = {name: getattr(obj, name) for name in per_step_fields(obj)}
    return replace(obj, **{name: table[start:] for name, table in tables.items() if table is not None})


def _batch_value(value: object, rule: BatchRule) -> Hashable:
    if rule == "shape":
        if value is None:
            return None
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"a field batched by shape must hold a tensor, not a {type(value).__name__}")
        return tuple(value.shape[1:])
    if isinstance(value, list):
        return tuple(value)
    assert isinstance(value, Hashable)
    return value


def batch_signature(obj: Req | Conditioning | None) -> tuple[Hashable, ...]:
    """What `obj` contributes to its request's batch key: each field with a `batch` rule, by that rule."""
    if obj is None:
        return ()
    return tuple(
        (f.name, _batch_value(getattr(obj, f.name), rule))
        for f in fields(obj)
        if (rule := field_role(f).batch) is not None
    )


C = TypeVar("C", bound="Conditioning")


@dataclass
class Conditioning:
    """Base of a family's typed per-request conditioning (`Req.conditioning`): a dataclass of what that
    family's stages set and its denoiser reads, with `role(...)` metadata where generic code must treat a
    field specially. Every field needs a default (a request starts with an empty one)."""

    @classmethod
    def of(cls: type[C], req: Req) -> C:
        """`req`'s conditioning of this class; a new empty one is attached when it has none (a stage run
        outside its pipeline). Another class's conditioning is a pipeline bug: TypeError."""
        if req.conditioning is None:
            req.conditioning = cls()
        found = req.conditioning
        if not isinstance(found, cls):
            raise TypeError(f"the request's conditioning is a {type(found).__name__}, not a {cls.__name__}")
        return found


def new_request_id() -> str:
    return uuid.uuid4().hex


@dataclass
class InputLatents:
    """Image-to-image and inpainting state (stages/image_to_image.py, stages/mask_preparation.py): the
    input image's VAE latents in the latents' layout (one copy per output), the initial noise they were
    noised with (the inpainting blend re-noises them with it after every step), and the mask on the latent
    grid in the same layout (1 = edit, 0 = keep the input image; None without a mask)."""

    latents: torch.Tensor
    noise: torch.Tensor | None = None
    mask: torch.Tensor | None = None


class LatentSize(NamedTuple):
    """A request's latent grid in latent pixels, before any 2x2 packing into tokens: equal sizes mean
    equal position ids, which packed latents of the same shape do not (48x80 and 80x48 pack alike)."""

    height: int
    width: int


@dataclass(frozen=True, eq=False)
class Schedule:
    """A request's sampling schedule, set once by timestep preparation and replaced whole, never edited:
    CFG-parallel branch views share it with their request. (Compared by identity: its fields are tensors.)

    Its tables are float32; `sigmas`, `timesteps` and `guidance` are on the latents' device, so that a step
    indexes them without a host-to-device copy (a host sync on accelerators). Each table is `per_step`, so
    image-to-image cuts them with the rest of the request's per-step tables."""

    #: num_steps + 1 entries, the last the end of the last step.
    sigmas: torch.Tensor = field(metadata=role(per_step=True))
    #: num_steps entries: the DiT's time input at each step.
    timesteps: torch.Tensor = field(metadata=role(per_step=True))
    #: `sigmas` on the CPU, for host-side reads: previews, and UniPC's data prediction, which multiplies by
    #: a CPU scalar as Diffusers does (a kernel argument, neither a copy nor a sync).
    host_sigmas: torch.Tensor = field(metadata=role(per_step=True))
    #: (batch,) guidance scale the DiT embeds (FLUX, FLUX.2-dev, SANA-Sprint, ...); None for the others.
    guidance: torch.Tensor | None = None
    #: `timesteps` on the CPU, for host-side reads: the timestep ranges of attention-reuse cache methods
    #: (PAB, FasterCache), compared as diffusers compares its pipeline's current timestep. None: not kept.
    host_timesteps: torch.Tensor | None = field(default=None, metadata=role(per_step=True))

    @classmethod
    def of_length(cls, num_steps: int) -> Schedule:
        """A placeholder of `num_steps` steps for a pipeline that runs its own sampling loop (the Diffusers
        backend, test doubles): only its length is read, for step counting."""
        return cls(torch.zeros(num_steps + 1), torch.zeros(num_steps), torch.zeros(num_steps + 1))

    @property
    def num_steps(self) -> int:
        return int(self.timesteps.shape[0])


@dataclass(eq=False)
class RequestOutputs:
    """What decoding makes of a request: images, or for video families frames (and LTX-2's soundtrack).
    Writing them to files is the caller's business (`outputs/`), so their paths are not kept here."""

    images: list[Image.Image] | None = None
    frames: list[np.ndarray] | None = None  # video families: (frames, height, width, 3) uint8 per output
    #: Families with a soundtrack (LTX-2): one (channels, samples) float32 CPU waveform per output, at
    #: `audio_sample_rate` Hz.
    audio: list[torch.Tensor] | None = None
    audio_sample_rate: int | None = None


@dataclass
class Timings:
    """Where a request's time went, in seconds: per stage by stage name (`stages/base.py`), and per
    denoising step (`runtime/runner.py`, from `StepTimer` marks)."""

    stages: dict[str, float] = field(default_factory=dict)
    steps: list[float] = field(default_factory=list)


@dataclass
class GeneratedShape:
    """What a family generates a request as, set by its input validation where it differs from the
    params: the memory model and `--max-batch-tokens` cost this."""

    #: (height, width) the request is generated at when the family's rule changes the size after `resolve`
    #: (SANA's and SANA-Video's resolution bins: the output is resized back to the size asked); None (also a
    #: pipeline without that stage, e.g. `--backend diffusers`): the params' own height x width.
    size: tuple[int, int] | None = None
    #: Images one output's DiT sequence generates, each a full image of tokens decoded on its own (1; a
    #: family that makes several per output says how many, e.g. Qwen-Image-Layered's layers and composite).
    images: int = 1


@dataclass
class Req:
    """One generation request as the stages fill it in: what every family's request has, plus its
    family's `conditioning` (see the module docstring)."""

    params: SamplingParams
    request_id: str = field(default_factory=new_request_id)

    # Set when the request starts (the engine's LoRA registry pins them until the request ends): the LoRA
    # adapters it applies, by registry id, with its scales.
    loras: tuple[AppliedLora, ...] = ()

    # Set by input validation.
    generator: torch.Generator | None = None
    do_cfg: bool | None = None  # run a negative branch: FLUX's true CFG, SD3's classic CFG
    #: What the family generates the request as, where that differs from its params (the memory model
    #: costs it).
    generated: GeneratedShape = field(default_factory=GeneratedShape)
    cfg_scale: float = 1.0  # prediction = negative + cfg_scale * (positive - negative)

    # Set by text encoding: (batch, seq, dim) sequence embeddings and (batch, dim) pooled ones. For
    # families with variable-length text (Qwen-Image, Z-Image) the positive and negative sequences
    # keep their own lengths; the denoiser pads and masks them when it batches the branches.
    prompt_embeds: torch.Tensor | None = None
    pooled_prompt_embeds: torch.Tensor | None = None
    negative_prompt_embeds: torch.Tensor | None = field(
        default=None, metadata=role(negative_of="prompt_embeds")
    )
    negative_pooled_prompt_embeds: torch.Tensor | None = field(
        default=None, metadata=role(negative_of="pooled_prompt_embeds")
    )

    # Set by latent preparation: the initial latents in the family's layout (packed tokens or a latent
    # image) and their grid.
    latents: torch.Tensor | None = field(default=None, metadata=role(stepped=True))
    latent_size: LatentSize | None = None

    # Image-to-image and inpainting; None without an input image.
    input_latents: InputLatents | None = None

    # What only this request's family reads (its text masks, position ids, extra encoders' states,
    # input-image latents, audio stream, ...): that family's `Conditioning`, attached by its pipeline
    # before pre-denoising.
    conditioning: Conditioning | None = None

    # Set by timestep preparation.
    schedule: Schedule | None = None

    # Set by the denoiser at the request's first step: the DiT's embedding of its text branches
    # (positive, then negative with CFG), which no step changes, so later steps skip the embedder.
    # Family-specific: FLUX keeps a tensor, Wan an `EmbeddedContext` (text with I2V's image states),
    # Z-Image a list of `RefinedCaption`s (its captions after the context refiner, one per row).
    dit_context: object | None = None

    # Advanced by the denoising step function (with the multistep scheduler's history, if it keeps one).
    step_index: int = field(default=0, metadata=role(stepped=True))
    scheduler_state: object | None = field(default=None, metadata=role(stepped=True))
    # The guided velocity the last step was taken with (after any family sign flip, as the scheduler
    # saw it): a reference, not a copy. Previews rebuild the predicted clean latent from it.
    last_prediction: torch.Tensor | None = field(default=None, metadata=role(stepped=True))
    # An approximate quality tier's or a cache method's state (reused DiT residuals and counts); None on
    # the exact path.
    step_cache: RequestCache | None = None

    # Set by decoding.
    outputs: RequestOutputs = field(default_factory=RequestOutputs)

    # Bookkeeping.
    timings: Timings = field(default_factory=Timings)

    # Control from outside the pipeline (the server's engine loop): set `cancel_event` to stop the
    # request at the next step boundary; `on_step(req)` is called after every denoising step.
    cancel_event: threading.Event | None = None
    on_step: Callable[[Req], None] | None = None
    #: A streamed video job: called on the decode's thread with each temporal chunk's pixels as the VAE
    #: decodes them (vae_tiling.decode_output_scope; only where the VAE decodes the clip whole).
    on_decoded: Callable[[Any], None] | None = None

    @property
    def cancelled(self) -> bool:
        return self.cancel_event is not None and self.cancel_event.is_set()

    @property
    def batch_size(self) -> int:
        """Samples this request contributes to a DiT batch (before CFG doubling)."""
        return self.params.num_outputs_per_prompt

    @property
    def num_steps(self) -> int:
        return 0 if self.schedule is None else self.schedule.num_steps

    @property
    def steps_computed_in_full(self) -> int:
        """Steps that ran every DiT block: all of them unless an approximate quality tier reused some."""
        return self.step_index if self.step_cache is None else self.step_cache.steps_computed

    @property
    def cache_report(self) -> dict[str, Any] | None:
        """The cache's method, settings and steps and blocks computed vs reused; None without one."""
        return None if self.step_cache is None else self.step_cache.report()

    @property
    def host_timestep(self) -> float | None:
        """The timestep of the current step, from the schedule's CPU copy (no device sync); None where the
        schedule keeps none. Read only where a cache method compares timesteps with its ranges."""
        schedule = self.schedule
        if (
            schedule is None
            or schedule.host_timesteps is None
            or self.step_index >= len(schedule.host_timesteps)
        ):
            return None
        value = schedule.host_timesteps[self.step_index]
        return float(value) if value.numel() == 1 else None

    @property
    def is_denoised(self) -> bool:
        return self.schedule is not None and self.step_index >= self.num_steps
