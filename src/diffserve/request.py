"""`Req`: the one object that flows through a pipeline's stages.

Every field is declared here; stages read and set them by name and declare which ones they need
and set (see `stages/base.py`). Nothing is forwarded implicitly, so a reader can see everything a
request carries in one place.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image

from diffserve.configs.sampling_params import SamplingParams
from diffserve.layers.lora_rows import AppliedLora
from diffserve.models.step_cache import StepCacheState


def new_request_id() -> str:
    return uuid.uuid4().hex


@dataclass
class Req:
    params: SamplingParams
    request_id: str = field(default_factory=new_request_id)

    # Set when the request starts (the engine's LoRA registry pins them until the request ends): the LoRA
    # adapters it applies, by registry id, with its scales.
    loras: tuple[AppliedLora, ...] = ()

    # Set by input validation.
    generator: torch.Generator | None = None
    do_cfg: bool | None = None  # run a negative branch: FLUX's true CFG, SD3's classic CFG
    cfg_scale: float = 1.0  # prediction = negative + cfg_scale * (positive - negative)

    # Set by text encoding: (batch, seq, dim) sequence embeddings and (batch, dim) pooled ones. For
    # families with variable-length text (Qwen-Image, Z-Image) the positive and negative sequences
    # keep their own lengths; the denoiser pads and masks them when it batches the branches.
    prompt_embeds: torch.Tensor | None = None
    pooled_prompt_embeds: torch.Tensor | None = None
    negative_prompt_embeds: torch.Tensor | None = None
    negative_pooled_prompt_embeds: torch.Tensor | None = None
    text_ids: torch.Tensor | None = None  # (text_seq, 3) position ids for FLUX's RoPE
    # Families whose DiT reads fixed-length padded text with its mask (HunyuanVideo 1.5): (batch, seq)
    # masks of the sequence embeddings (1 = real token), and a second encoder's sequence states with
    # their masks (HunyuanVideo 1.5's ByT5 states of the prompt's quoted text).
    prompt_embeds_mask: torch.Tensor | None = None
    negative_prompt_embeds_mask: torch.Tensor | None = None
    prompt_embeds_2: torch.Tensor | None = None
    prompt_embeds_mask_2: torch.Tensor | None = None
    negative_prompt_embeds_2: torch.Tensor | None = None
    negative_prompt_embeds_mask_2: torch.Tensor | None = None

    # Set by latent preparation: packed latents (batch, tokens, channels) and their position ids.
    latents: torch.Tensor | None = None
    image_ids: torch.Tensor | None = None
    latent_height: int | None = None  # in latent pixels (before 2x2 packing)
    latent_width: int | None = None

    # Set by a family's "before denoising" stage for edits: the input images as resized for the
    # text encoder, their packed VAE latents (batch, tokens, channels) appended to the image tokens,
    # and each one's (frames, rows, cols) token grid.
    condition_images: list[Image.Image] | None = None
    condition_latents: torch.Tensor | None = None
    condition_shapes: list[tuple[int, int, int]] = field(default_factory=list)
    # Image-to-video: the input image's CLIP vision states (batch, tokens, dim), cross-attended by the DiT.
    image_embeds: torch.Tensor | None = None
    # FLUX.1 Fill: per image token, the masked input image's packed latents and the packed mask pixels
    # (batch, tokens, channels), appended to the noisy tokens' channels (not to the token sequence).
    channel_condition: torch.Tensor | None = None
    # Joint audio-video families (LTX-2): the audio stream's packed latents (batch, tokens, channels) and its
    # text states per CFG branch (the video stream's are `latents`, `prompt_embeds`; both share the text
    # masks), then the decoded soundtrack: one (channels, samples) float32 CPU waveform per output, at
    # `audio_sample_rate` Hz.
    audio_latents: torch.Tensor | None = None
    audio_prompt_embeds: torch.Tensor | None = None
    negative_audio_prompt_embeds: torch.Tensor | None = None
    audio: list[torch.Tensor] | None = None
    audio_sample_rate: int | None = None

    # Image-to-image and inpainting (stages/image_to_image.py, stages/mask_preparation.py), None without an
    # input image: its VAE latents in the latents' layout (one copy per output), the initial noise they were
    # noised with (the inpainting blend re-noises them with it after every step), and the mask on the latent
    # grid in the same layout (1 = edit, 0 = keep the input image).
    init_latents: torch.Tensor | None = None
    noise: torch.Tensor | None = None
    mask_latents: torch.Tensor | None = None

    # Set by timestep preparation, float32 on the latents' device, so that a step indexes them without a
    # host-to-device copy (a host sync on accelerators): sigmas has num_steps + 1 entries.
    sigmas: torch.Tensor | None = None
    timesteps: torch.Tensor | None = None
    guidance: torch.Tensor | None = None  # (batch,) embedded guidance, when the DiT takes it
    # The same sigmas on the CPU, for host-side reads: previews, and UniPC's data prediction, which
    # multiplies by a CPU scalar as Diffusers does (a kernel argument, neither a copy nor a sync).
    host_sigmas: torch.Tensor | None = None
    # Families whose DiT takes its own time axis rather than `timesteps` (Z-Image: 1 - t / 1000,
    # computed on the CPU as before and moved with the schedule), per step, on the latents' device.
    dit_timesteps: torch.Tensor | None = None

    # Set by the denoiser at the request's first step: the DiT's embedding of its text branches
    # (positive, then negative with CFG), which no step changes, so later steps skip the embedder.
    # Family-specific: FLUX keeps a tensor, Wan an `EmbeddedContext` (text with I2V's image states),
    # Z-Image a list of `RefinedCaption`s (its captions after the context refiner, one per row).
    dit_context: object | None = None

    # Advanced by the denoising step function (with the multistep scheduler's history, if it keeps one).
    step_index: int = 0
    scheduler_state: object | None = None
    # The guided velocity the last step was taken with (after any family sign flip, as the scheduler
    # saw it): a reference, not a copy. Previews rebuild the predicted clean latent from it.
    last_prediction: torch.Tensor | None = None
    # Approximate quality tiers only: this request's step cache (reused DiT residuals and counts).
    step_cache: StepCacheState | None = None

    # Set by decoding / output writing.
    images: list[Image.Image] | None = None
    frames: list[np.ndarray] | None = None  # video families: (frames, height, width, 3) uint8 per output
    output_paths: list[str] = field(default_factory=list)

    # Bookkeeping.
    timings: dict[str, float] = field(default_factory=dict)
    step_times: list[float] = field(default_factory=list)

    # Control from outside the pipeline (the server's engine loop): set `cancel_event` to stop the
    # request at the next step boundary; `on_step(req)` is called after every denoising step.
    cancel_event: threading.Event | None = None
    on_step: Callable[[Req], None] | None = None

    @property
    def cancelled(self) -> bool:
        return self.cancel_event is not None and self.cancel_event.is_set()

    @property
    def batch_size(self) -> int:
        """Samples this request contributes to a DiT batch (before CFG doubling)."""
        return self.params.num_outputs_per_prompt

    @property
    def num_steps(self) -> int:
        return 0 if self.timesteps is None else int(self.timesteps.shape[0])

    @property
    def steps_computed_in_full(self) -> int:
        """Steps that ran every DiT block: all of them unless an approximate quality tier reused some."""
        return self.step_index if self.step_cache is None else self.step_cache.steps_computed

    @property
    def is_denoised(self) -> bool:
        return self.timesteps is not None and self.step_index >= self.num_steps
