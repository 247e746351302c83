"""LTX-2 audio-video transformer (Lightricks), native, loading Diffusers `LTX2VideoTransformer3DModel` weights
unchanged. Covers LTX-2.0, LTX-2.3 (gated attention, cross-attention adaLN, STG-perturbable attention,
text already projected by the connectors) and LTX-2.5 (bias-free video FFN, static text K/V modulation,
keyframe position embedding) through the config keys Diffusers reads.

Two token streams run side by side through every block (`ltx2_blocks.py`):

    x    = proj_in(video latent tokens)                  (batch, Tv, inner)   Tv = F*H*W, patch 1 in practice
    a    = audio_proj_in(audio latent tokens)            (batch, Ta, audio_inner)
    text = caption_projection(video text), audio_caption_projection(audio text)   LTX-2.0 only
    mod  = adaLN-single of the timestep per modality: (batch, 1 or Tv, 6 or 9 vectors); a second set
           (4 + 1 vectors) for the audio<->video attention, from the same timestep or, with
           `use_cross_timestep`, from the other modality's sigma; LTX-2.3 adds 2 from sigma for the text K/V
    num_layers x block: self-attn (3-axis / 1-axis RoPE), text cross-attn (masked), audio<->video
                        cross-attn (temporal RoPE on both sides), FFN, all adaLN-modulated and gated
    out  = proj_out(LN(x) * (1 + scale) + shift), audio_proj_out(...) with per-modality output tables

`forward` keeps Diffusers' keyword arguments and returns Diffusers' `return_dict=False` tuple
(video prediction (batch, Tv, out_channels), audio prediction (batch, Ta, audio_out_channels)) on packed
tokens; patchifying the latents is the pipeline's job, as in Diffusers.

Numerics follow Diffusers: the activation dtype throughout (no fp32 upcast of the modulation), RoPE in
float32 from float64 frequencies, RMSNorm statistics in float32.

Cache methods (`step_cache`, `models/step_cache.py`): every method, on the residual of both streams packed
into one hidden state per row (`ltx2_cache.py`); DBCache's Fn/Bn count `transformer_blocks`.

Not implemented here (the model runs unsplit on one device): sequence and tensor parallelism. LoRA scaling through `attention_kwargs` is left to the engine's LoRA loader (a non-empty
`attention_kwargs` is rejected).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from diffserve.configs.cache_rule import ATTENTION_METHODS, BLOCK_RANGE_METHODS, WHOLE_SPAN_METHODS
from diffserve.layers.embeddings import GeluTanhTextProjection
from diffserve.layers.norms import LayerNorm
from diffserve.models.dits.base import DiffusersDiT, DiTConfig
from diffserve.models.dits.ltx2_blocks import (
    BlockConditioning,
    LTX2AdaLayerNormSingle,
    LTX2VideoTransformerBlock,
    Perturbation,
    gelu_approximation,
)
from diffserve.models.dits.ltx2_cache import LTX2Blocks, unpack
from diffserve.models.dits.ltx2_rope import LTX2RotaryPosEmbed, check_rope_type
from diffserve.models.step_cache import BatchStepCache, run_with_step_cache

#: Multiplicative masks become this additive bias where they are 0 (Diffusers' convention).
MASK_BIAS = -10000.0
OUTPUT_NORM_EPS = 1e-6


@dataclass(frozen=True)
class LTX2VideoTransformerConfig(DiTConfig):
    """The DiT's Diffusers config (`transformer/config.json`), one field per key, Diffusers' defaults.

    LTX-2.0: rope_type "split", use_prompt_embeddings True (caption projections in the DiT).
    LTX-2.3: additionally gated_attn / audio_gated_attn, cross_attn_mod / audio_cross_attn_mod and
    perturbed_attn True, use_prompt_embeddings False. LTX-2.5: ff_bias False and
    use_keyframes_abs_pos_embedding True on top of 2.3. `out_channels` / `audio_out_channels` None
    mean the input channels and are resolved here; sequences become tuples.
    """

    in_channels: int = 128
    out_channels: int | None = 128
    patch_size: int = 1
    patch_size_t: int = 1
    num_attention_heads: int = 32
    attention_head_dim: int = 128
    cross_attention_dim: int = 4096
    vae_scale_factors: tuple[int, int, int] = (8, 32, 32)
    pos_embed_max_pos: int = 20
    base_height: int = 2048
    base_width: int = 2048
    gated_attn: bool = False
    cross_attn_mod: bool = False
    audio_in_channels: int = 128
    audio_out_channels: int | None = 128
    audio_patch_size: int = 1
    audio_patch_size_t: int = 1
    audio_num_attention_heads: int = 32
    audio_attention_head_dim: int = 64
    audio_cross_attention_dim: int = 2048
    audio_scale_factor: int = 4
    audio_pos_embed_max_pos: int = 20
    audio_sampling_rate: int = 16000
    audio_hop_length: int = 160
    audio_gated_attn: bool = False
    audio_cross_attn_mod: bool = False
    num_layers: int = 48
    activation_fn: str = "gelu-approximate"
    qk_norm: str = "rms_norm_across_heads"
    norm_elementwise_affine: bool = False
    norm_eps: float = 1e-6
    caption_channels: int = 3840
    attention_bias: bool = True
    attention_out_bias: bool = True
    rope_theta: float = 10000.0
    rope_double_precision: bool = True
    causal_offset: int = 1
    timestep_scale_multiplier: int = 1000
    cross_attn_timestep_scale_multiplier: int = 1000
    rope_type: str = "interleaved"
    use_prompt_embeddings: bool = True
    perturbed_attn: bool = False
    ff_bias: bool = True
    audio_ff_bias: bool = True
    use_prompt_adaln_single: bool = True
    use_keyframes_abs_pos_embedding: bool = False

    def __post_init__(self) -> None:
        scale_factors = tuple(int(s) for s in self.vae_scale_factors)
        if len(scale_factors) != 3:
            raise ValueError(f"vae_scale_factors must be (frames, height, width), got {scale_factors}")
        if self.qk_norm != "rms_norm_across_heads":
            raise ValueError(
                f"qk_norm must be 'rms_norm_across_heads' (the only one Diffusers implements), got {self.qk_norm!r}"
            )
        check_rope_type(self.rope_type)
        gelu_approximation(self.activation_fn)
        audio_inner = self.audio_num_attention_heads * self.audio_attention_head_dim
        # Shapes Diffusers' forward needs without checking them itself.
        if self.audio_cross_attention_dim != audio_inner:
            raise ValueError(
                f"audio_cross_attention_dim ({self.audio_cross_attention_dim}) must equal audio_num_attention_heads "
                f"* audio_attention_head_dim ({audio_inner}): it is the width of the audio<->video RoPE tables"
            )
        if self.inner_dim % 2 or audio_inner % 2:
            raise ValueError(
                f"the video ({self.inner_dim}) and audio ({audio_inner}) widths must be even for RoPE"
            )
        if (self.use_prompt_embeddings or self.cross_attn_mod or self.audio_cross_attn_mod) and (
            self.cross_attention_dim != self.inner_dim
        ):
            raise ValueError(
                f"cross_attention_dim ({self.cross_attention_dim}) must equal num_attention_heads * "
                f"attention_head_dim ({self.inner_dim}) with use_prompt_embeddings or cross-attention modulation"
            )
        self._normalise(
            vae_scale_factors=scale_factors,
            out_channels=self.out_channels or self.in_channels,
            audio_out_channels=self.audio_out_channels or self.audio_in_channels,
        )

    @property
    def audio_inner_dim(self) -> int:
        """The audio stream's width."""
        return self.audio_num_attention_heads * self.audio_attention_head_dim

    @property
    def prompt_modulation(self) -> bool:
        """Whether either modality modulates its text cross-attention (LTX-2.3 and later)."""
        return self.cross_attn_mod or self.audio_cross_attn_mod


def _additive_mask(mask: torch.Tensor | None, dtype: torch.dtype, name: str) -> torch.Tensor | None:
    """A text mask as the additive bias (batch, 1, 1, L): (batch, L) multiplicative masks become
    (1 - m) * -10000 as in Diffusers; a (batch, 1, L) tensor is already a bias."""
    if mask is None:
        return None
    if mask.ndim == 2:
        mask = ((1 - mask.to(dtype)) * MASK_BIAS).unsqueeze(1)
    if mask.ndim != 3:
        raise ValueError(
            f"{name} must be (batch, text_len) or an additive (batch, 1, text_len), got {tuple(mask.shape)}"
        )
    return mask.unsqueeze(1)


def _per_row(value: torch.Tensor, batch: int, tokens: int, name: str) -> torch.Tensor:
    """Check a timestep-like input has one entry per sample or per token (batch * 1 or batch * tokens)."""
    if value.numel() not in (batch, batch * tokens):
        raise ValueError(
            f"{name} must hold one value per sample ({batch}) or per token ({batch} x {tokens}), "
            f"got shape {tuple(value.shape)}"
        )
    return value


class LTX2VideoTransformer3DModel(DiffusersDiT):
    """The LTX-2 audio-video DiT on packed latent tokens (see the module docstring).

    Built from an `LTX2VideoTransformerConfig` (`DiffusersDiT`). `rope` / `audio_rope` expose Diffusers'
    `prepare_video_coords` / `prepare_audio_coords`.
    """

    diffusers_class_name: ClassVar[str] = "LTX2VideoTransformer3DModel"
    config_class = LTX2VideoTransformerConfig
    cache_methods: ClassVar[frozenset[str]] = WHOLE_SPAN_METHODS | BLOCK_RANGE_METHODS | ATTENTION_METHODS
    cache_block_lists: ClassVar[tuple[str, ...]] = ("transformer_blocks",)

    def __init__(self, config: LTX2VideoTransformerConfig) -> None:
        super().__init__(config)
        c = config
        inner, audio_inner = c.inner_dim, c.audio_inner_dim

        self.proj_in = nn.Linear(c.in_channels, inner)
        self.audio_proj_in = nn.Linear(c.audio_in_channels, audio_inner)
        if c.use_keyframes_abs_pos_embedding:
            self.keyframes_abs_pos_embedding = nn.Parameter(torch.zeros(1, inner))
        if c.use_prompt_embeddings:
            self.caption_projection = GeluTanhTextProjection(c.caption_channels, inner)
            self.audio_caption_projection = GeluTanhTextProjection(c.caption_channels, audio_inner)

        self.time_embed = LTX2AdaLayerNormSingle(inner, 9 if c.cross_attn_mod else 6)
        self.audio_time_embed = LTX2AdaLayerNormSingle(audio_inner, 9 if c.audio_cross_attn_mod else 6)
        self.av_cross_attn_video_scale_shift = LTX2AdaLayerNormSingle(inner, 4)
        self.av_cross_attn_audio_scale_shift = LTX2AdaLayerNormSingle(audio_inner, 4)
        self.av_cross_attn_video_a2v_gate = LTX2AdaLayerNormSingle(inner, 1)
        self.av_cross_attn_audio_v2a_gate = LTX2AdaLayerNormSingle(audio_inner, 1)
        self.scale_shift_table = nn.Parameter(torch.zeros(2, inner))
        self.audio_scale_shift_table = nn.Parameter(torch.zeros(2, audio_inner))
        if c.prompt_modulation and c.use_prompt_adaln_single:
            self.prompt_adaln = LTX2AdaLayerNormSingle(inner, 2)
            self.audio_prompt_adaln = LTX2AdaLayerNormSingle(audio_inner, 2)

        shared = {
            "theta": c.rope_theta,
            "causal_offset": c.causal_offset,
            "double_precision": c.rope_double_precision,
            "rope_type": c.rope_type,
            "base_height": c.base_height,
            "base_width": c.base_width,
            "sampling_rate": c.audio_sampling_rate,
            "hop_length": c.audio_hop_length,
        }
        video_patch = {"patch_size": c.patch_size, "patch_size_t": c.patch_size_t}
        audio_patch = {"patch_size": c.audio_patch_size, "patch_size_t": c.audio_patch_size_t}
        cross_max_pos = max(c.pos_embed_max_pos, c.audio_pos_embed_max_pos)
        self.rope = LTX2RotaryPosEmbed(
            dim=inner, base_num_frames=c.pos_embed_max_pos, scale_factors=c.vae_scale_factors, modality="video",
            num_attention_heads=c.num_attention_heads, **video_patch, **shared,
        )  # fmt: skip
        self.audio_rope = LTX2RotaryPosEmbed(
            dim=audio_inner, base_num_frames=c.audio_pos_embed_max_pos, scale_factors=(c.audio_scale_factor,),
            modality="audio", num_attention_heads=c.audio_num_attention_heads, **audio_patch, **shared,
        )  # fmt: skip
        # The audio<->video tables are temporal only and as wide as the audio attention. Diffusers builds
        # the video-side one for the video head count (split layout) and never reads their scale factors.
        self.cross_attn_rope = LTX2RotaryPosEmbed(
            dim=c.audio_cross_attention_dim, base_num_frames=cross_max_pos, scale_factors=c.vae_scale_factors,
            modality="video", num_attention_heads=c.num_attention_heads, **video_patch, **shared,
        )  # fmt: skip
        self.cross_attn_audio_rope = LTX2RotaryPosEmbed(
            dim=c.audio_cross_attention_dim, base_num_frames=cross_max_pos, scale_factors=c.vae_scale_factors,
            modality="audio", num_attention_heads=c.audio_num_attention_heads, **audio_patch, **shared,
        )  # fmt: skip

        self.transformer_blocks = nn.ModuleList(
            [
                LTX2VideoTransformerBlock(
                    dim=inner,
                    num_attention_heads=c.num_attention_heads,
                    attention_head_dim=c.attention_head_dim,
                    cross_attention_dim=c.cross_attention_dim,
                    audio_dim=audio_inner,
                    audio_num_attention_heads=c.audio_num_attention_heads,
                    audio_attention_head_dim=c.audio_attention_head_dim,
                    audio_cross_attention_dim=c.audio_cross_attention_dim,
                    video_gated_attn=c.gated_attn,
                    video_cross_attn_adaln=c.cross_attn_mod,
                    audio_gated_attn=c.audio_gated_attn,
                    audio_cross_attn_adaln=c.audio_cross_attn_mod,
                    activation_fn=c.activation_fn,
                    attention_bias=c.attention_bias,
                    attention_out_bias=c.attention_out_bias,
                    eps=c.norm_eps,
                    elementwise_affine=c.norm_elementwise_affine,
                    perturbed_attn=c.perturbed_attn,
                    ff_bias=c.ff_bias,
                    audio_ff_bias=c.audio_ff_bias,
                )
                for _ in range(c.num_layers)
            ]
        )
        self.norm_out = LayerNorm(inner, eps=OUTPUT_NORM_EPS, elementwise_affine=False)
        self.proj_out = nn.Linear(inner, c.out_channels)
        self.audio_norm_out = LayerNorm(audio_inner, eps=OUTPUT_NORM_EPS, elementwise_affine=False)
        self.audio_proj_out = nn.Linear(audio_inner, c.audio_out_channels)

    def forward(
        self,
        hidden_states: torch.Tensor,
        audio_hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        audio_encoder_hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        audio_timestep: torch.Tensor | None = None,
        sigma: torch.Tensor | None = None,
        audio_sigma: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        audio_encoder_attention_mask: torch.Tensor | None = None,
        num_frames: int | None = None,
        height: int | None = None,
        width: int | None = None,
        fps: float = 24.0,
        audio_num_frames: int | None = None,
        video_coords: torch.Tensor | None = None,
        audio_coords: torch.Tensor | None = None,
        isolate_modalities: bool = False,
        spatio_temporal_guidance_blocks: Sequence[int] | None = None,
        perturbation_mask: torch.Tensor | None = None,
        use_cross_timestep: bool = False,
        attention_kwargs: Mapping[str, Any] | None = None,
        video_self_attention_mask: torch.Tensor | None = None,
        video_keyframes_mask: torch.Tensor | None = None,
        return_dict: bool = False,
        step_cache: BatchStepCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Predict the video and audio velocities (Diffusers' arguments and meaning).

        Args:
            hidden_states: packed video latents (batch, Tv, in_channels).
            audio_hidden_states: packed audio latents (batch, Ta, audio_in_channels).
            encoder_hidden_states / audio_encoder_hidden_states: the connectors' text states (batch, L, ...):
                caption_channels wide when `use_prompt_embeddings` (LTX-2.0), else cross_attention_dim /
                audio_cross_attention_dim.
            timestep: (batch,) or per video token (batch, Tv), already scaled to [0, timestep_scale_multiplier].
            audio_timestep: (batch,) or (batch, Ta); None means `timestep`.
            sigma / audio_sigma: (batch,) for the LTX-2.3 text K/V modulation and `use_cross_timestep`;
                audio_sigma None means sigma.
            encoder_attention_mask / audio_encoder_attention_mask: (batch, L) multiplicative (1 = keep) or an
                additive (batch, 1, L) bias.
            num_frames, height, width, fps, audio_num_frames: the latent grid, used only to build RoPE
                coordinates when `video_coords` / `audio_coords` are None.
            video_coords: (batch, 3, Tv, 2) patch bounds; audio_coords: (batch, 1, Ta, 2).
            isolate_modalities: skip the audio<->video attention in every block (modality guidance).
            spatio_temporal_guidance_blocks: block indices whose self-attentions are perturbed (STG) when
                the model has `perturbed_attn`; perturbation_mask (batch,) / (batch, 1, 1): 0 = perturb the
                row, 1 = keep; None with STG blocks perturbs every row.
            use_cross_timestep: modulate the audio<->video attention by the other modality's sigma (LTX-2.3).
            attention_kwargs: must be None or empty (Diffusers only reads a LoRA `scale` there).
            video_self_attention_mask: (batch, Tv, Tv) multiplicative weights in [0, 1] for the video
                self-attention (IC-LoRA), applied as (1 - m) * -10000.
            video_keyframes_mask: (batch, Tv, 1), non-zero on tokens that get `keyframes_abs_pos_embedding`
                (ignored unless the model has it).
            return_dict: must be False; the native model returns Diffusers' tuple.
            step_cache: the rows of requests with a cache method, which may reuse the blocks' residual of
                both streams from an earlier step (`ltx2_cache.py`); None runs every block (exact).

        Returns:
            (video prediction (batch, Tv, out_channels), audio prediction (batch, Ta, audio_out_channels)),
            in the activation dtype.
        """
        if return_dict:
            raise ValueError("return_dict=True is not supported: the native model returns (video, audio)")
        if attention_kwargs:
            raise ValueError(
                f"attention_kwargs {sorted(attention_kwargs)} are not supported; LoRA scales are set by "
                "the engine's LoRA loader"
            )
        c = self.config
        batch, video_tokens = hidden_states.shape[:2]
        audio_tokens = audio_hidden_states.shape[1]
        dtype, audio_dtype = hidden_states.dtype, audio_hidden_states.dtype
        audio_timestep = timestep if audio_timestep is None else audio_timestep
        audio_sigma = sigma if audio_sigma is None else audio_sigma
        _per_row(timestep, batch, video_tokens, "timestep")
        _per_row(audio_timestep, batch, audio_tokens, "audio_timestep")
        if sigma is None and (use_cross_timestep or (c.prompt_modulation and c.use_prompt_adaln_single)):
            raise ValueError(
                "sigma is required with use_cross_timestep or on models that modulate the text cross-attention "
                "by timestep (cross_attn_mod / audio_cross_attn_mod with use_prompt_adaln_single)"
            )

        encoder_attention_mask = _additive_mask(encoder_attention_mask, dtype, "encoder_attention_mask")
        audio_encoder_attention_mask = _additive_mask(
            audio_encoder_attention_mask, audio_dtype, "audio_encoder_attention_mask"
        )
        if video_self_attention_mask is not None:
            video_self_attention_mask = ((1 - video_self_attention_mask.to(dtype)) * MASK_BIAS).unsqueeze(1)

        if video_coords is None:
            if num_frames is None or height is None or width is None:
                raise ValueError("pass video_coords or the latent num_frames, height and width")
            video_coords = self.rope.prepare_video_coords(
                batch, num_frames, height, width, hidden_states.device, fps=fps
            )
        if audio_coords is None:
            if audio_num_frames is None:
                raise ValueError("pass audio_coords or audio_num_frames")
            audio_coords = self.audio_rope.prepare_audio_coords(
                batch, audio_num_frames, audio_hidden_states.device
            )
        video_coords = video_coords.to(hidden_states.device)
        audio_coords = audio_coords.to(audio_hidden_states.device)

        x = self.proj_in(hidden_states)
        a = self.audio_proj_in(audio_hidden_states)
        if c.use_keyframes_abs_pos_embedding and video_keyframes_mask is not None:
            marker = (video_keyframes_mask > 0).to(x.dtype)
            x = x + marker * self.keyframes_abs_pos_embedding.to(x.dtype)

        temb, embedded_timestep = self.time_embed(timestep, batch, dtype)
        temb_audio, audio_embedded_timestep = self.audio_time_embed(audio_timestep, batch, audio_dtype)
        temb_prompt = temb_prompt_audio = None
        if c.prompt_modulation and c.use_prompt_adaln_single:
            temb_prompt = self.prompt_adaln(sigma, batch, dtype)[0]
            temb_prompt_audio = self.audio_prompt_adaln(audio_sigma, batch, audio_dtype)[0]
        gate_factor = c.cross_attn_timestep_scale_multiplier / c.timestep_scale_multiplier
        video_ca_t = audio_sigma.flatten() if use_cross_timestep else timestep.flatten()
        audio_ca_t = sigma.flatten() if use_cross_timestep else audio_timestep.flatten()

        if c.use_prompt_embeddings:
            encoder_hidden_states = self.caption_projection(encoder_hidden_states)
            audio_encoder_hidden_states = self.audio_caption_projection(audio_encoder_hidden_states)

        cond = BlockConditioning(
            encoder_hidden_states=encoder_hidden_states,
            audio_encoder_hidden_states=audio_encoder_hidden_states,
            temb=temb,
            temb_audio=temb_audio,
            temb_ca_scale_shift=self.av_cross_attn_video_scale_shift(video_ca_t, batch, dtype)[0],
            temb_ca_audio_scale_shift=self.av_cross_attn_audio_scale_shift(audio_ca_t, batch, audio_dtype)[0],
            temb_ca_gate=self.av_cross_attn_video_a2v_gate(video_ca_t * gate_factor, batch, dtype)[0],
            temb_ca_audio_gate=self.av_cross_attn_audio_v2a_gate(
                audio_ca_t * gate_factor, batch, audio_dtype
            )[0],
            temb_prompt=temb_prompt,
            temb_prompt_audio=temb_prompt_audio,
            video_rope=self.rope(video_coords),
            audio_rope=self.audio_rope(audio_coords),
            ca_video_rope=self.cross_attn_rope(video_coords[:, 0:1]),
            ca_audio_rope=self.cross_attn_audio_rope(audio_coords[:, 0:1]),
            encoder_attention_mask=encoder_attention_mask,
            audio_encoder_attention_mask=audio_encoder_attention_mask,
            video_self_attention_mask=video_self_attention_mask,
            cross_modal=not isolate_modalities,
        )

        stg_blocks = set(spatio_temporal_guidance_blocks or ())
        perturbation = self._perturbation(perturbation_mask, batch) if stg_blocks else Perturbation()
        if step_cache is None:
            for index, block in enumerate(self.transformer_blocks):
                x, a = block(x, a, cond, perturbation if index in stg_blocks else Perturbation())
        else:
            blocks = LTX2Blocks(self.transformer_blocks, x, a, cond, stg_blocks, perturbation)
            packed = run_with_step_cache(
                step_cache,
                blocks.packed,
                lambda: self.transformer_blocks[0].modulated_video_input(x, cond),
                blocks.run_whole,
                blocks=lambda: blocks,
            )
            x, a = unpack(packed, x.shape, a.shape)

        shift, scale = (self.scale_shift_table[None, None] + embedded_timestep[:, :, None]).unbind(2)
        video = self.proj_out(self.norm_out(x) * (1 + scale) + shift)
        a_shift, a_scale = (
            self.audio_scale_shift_table[None, None] + audio_embedded_timestep[:, :, None]
        ).unbind(2)
        audio = self.audio_proj_out(self.audio_norm_out(a) * (1 + a_scale) + a_shift)
        return video, audio

    @staticmethod
    def _perturbation(mask: torch.Tensor | None, batch: int) -> Perturbation:
        """STG for the listed blocks: every row perturbed when `mask` is None or all zero (the attention is
        skipped), else a per-row blend (batch, 1, 1)."""
        if mask is None:
            return Perturbation(all_rows=True)
        if mask.numel() != batch:
            raise ValueError(
                f"perturbation_mask must be (batch,) or (batch, 1, 1) with batch={batch}, got {tuple(mask.shape)}"
            )
        if mask.ndim == 1:
            mask = mask[:, None, None]
        if bool(torch.all(mask == 0)):
            return Perturbation(all_rows=True)
        return Perturbation(mask=mask)
