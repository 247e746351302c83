"""Building blocks of the LTX-2 audio-video DiT (`ltx2.py`) and its text connectors (`ltx2_connectors.py`),
with Diffusers' module and parameter names.

* `LTX2Attention`: q/k/v projections, RMSNorm over the full q and k width, RoPE over the full width
  (`ltx2_rope.py`), attention through the repo's `attention()` with an optional additive mask, an
  optional per-head output gate `2 * sigmoid(to_gate_logits(x))` (LTX-2.3), and the spatio-temporal
  guidance (STG) perturbation: the attention of perturbed rows is replaced by the value projection.
* `LTX2FeedForward`: Linear -> GELU -> Linear (`net.0.proj`, `net.2`), biases optional (LTX-2.5's video FFN
  has none).
* `LTX2AdaLayerNormSingle`: timestep sinusoids -> MLP (`emb.timestep_embedder`) -> SiLU -> `linear`, giving
  `num_mod_params` modulation vectors per timestep and the embedded timestep.
* `LTX2VideoTransformerBlock`: video and audio self-attention, text cross-attention, audio<->video
  cross-attention and FFNs with adaLN modulation (`forward` documents the order).

Everything runs in the activation dtype, as in Diffusers; only RoPE (float32) and the RMSNorm
statistics (float32) are computed wider.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from diffserve.layers.attention import attention
from diffserve.layers.attention_weights import AttentionWeights
from diffserve.layers.embeddings import TimestepEmbedding, timestep_sinusoids
from diffserve.layers.mlp import gelu_in_place
from diffserve.layers.norms import RMSNorm
from diffserve.models.dits.ltx2_rope import LTX2Rope, apply_ltx2_rope

#: Diffusers' `activation_fn` names this port implements, with their `F.gelu` approximation.
GELU_APPROXIMATIONS = {"gelu": "none", "gelu-approximate": "tanh"}
#: Sinusoid width of the timestep embedders (`PixArtAlphaCombinedTimestepSizeEmbeddings`).
TIMESTEP_CHANNELS = 256
#: Eps of the attention q/k RMSNorms (Diffusers never passes the model's `norm_eps` to them).
QK_NORM_EPS = 1e-6


def gelu_approximation(activation_fn: str) -> str:
    """`F.gelu`'s `approximate` for a Diffusers `activation_fn`; ValueError for the ones LTX-2 never uses."""
    if activation_fn not in GELU_APPROXIMATIONS:
        raise ValueError(f"activation_fn must be one of {sorted(GELU_APPROXIMATIONS)}, got {activation_fn!r}")
    return GELU_APPROXIMATIONS[activation_fn]


@dataclass(frozen=True)
class Perturbation:
    """STG for one attention call: `all_rows` skips the attention for every row (output = values);
    otherwise `mask` (batch, 1, 1), 1 = keep the attention, 0 = use the values, blends per row."""

    mask: torch.Tensor | None = None
    all_rows: bool = False

    def for_rows(self, rows: torch.Tensor) -> Perturbation:
        """This perturbation for batch rows `rows` only (a step cache runs the rows that compute)."""
        return self if self.mask is None else Perturbation(_rows(self.mask, rows), self.all_rows)


NO_PERTURBATION = Perturbation()


def _rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`t` restricted to batch rows `rows`; a one-row tensor (shared by the batch) stays as it is."""
    return t if t.shape[0] == 1 else t.index_select(0, rows)


class LTX2Attention(AttentionWeights):
    """Multi-head attention of the LTX-2 DiT and connectors; `context=None` is self-attention.

    `query_rope` rotates q (and k, unless `key_rope` is given: the audio<->video cross-attention
    rotates each side by its own timeline).
    """

    def __init__(
        self,
        query_dim: int,
        heads: int,
        dim_head: int,
        cross_attention_dim: int | None = None,
        bias: bool = True,
        out_bias: bool = True,
        gated: bool = False,
    ) -> None:
        # The QK-norms are over all heads together.
        norm = partial(RMSNorm, heads * dim_head, eps=QK_NORM_EPS, round_once=True)
        super().__init__(
            query_dim, heads, dim_head, norm, kv_dim=cross_attention_dim, bias=bias, out_bias=out_bias
        )
        self.heads = heads
        self.to_gate_logits = nn.Linear(query_dim, heads) if gated else None

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        query_rope: LTX2Rope | None = None,
        key_rope: LTX2Rope | None = None,
        perturbation: Perturbation = NO_PERTURBATION,
    ) -> torch.Tensor:
        """x (batch, q_len, query_dim), context (batch, kv_len, kv_dim); `attn_mask` is an additive bias
        broadcastable to (batch, heads, q_len, kv_len)."""
        context = x if context is None else context
        value = self.to_v(context)
        if perturbation.all_rows:
            out = value
        else:
            q = self.norm_q(self.to_q(x))
            k = self.norm_k(self.to_k(context))
            if query_rope is not None:
                q = apply_ltx2_rope(q, query_rope)
                k = apply_ltx2_rope(k, query_rope if key_rope is None else key_rope)
            out = attention(
                q.unflatten(-1, (self.heads, -1)),
                k.unflatten(-1, (self.heads, -1)),
                value.unflatten(-1, (self.heads, -1)),
                attn_mask=attn_mask,
            )
            out = out.flatten(2).to(q.dtype)
            if perturbation.mask is not None:
                out = torch.lerp(value, out, perturbation.mask.to(device=out.device, dtype=out.dtype))
        if self.to_gate_logits is not None:
            # 2 * sigmoid so that zero-initialised logits give gates of one.
            gates = 2.0 * torch.sigmoid(self.to_gate_logits(x))
            out = (out.unflatten(-1, (self.heads, -1)) * gates.unsqueeze(-1)).flatten(2)
        return self.to_out[0](out)


class _GeluProjection(nn.Module):
    """Linear then GELU; `proj` keeps Diffusers' `net.0.proj` name, the bias is optional."""

    def __init__(self, dim_in: int, dim_out: int, approximate: str, bias: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out, bias=bias)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_in_place(self.proj(x), self.approximate)


class LTX2FeedForward(nn.Module):
    """dim -> 4 dim -> dim GELU MLP (Diffusers' `FeedForward(dim, activation_fn, bias=bias)`)."""

    def __init__(self, dim: int, activation_fn: str = "gelu-approximate", bias: bool = True) -> None:
        super().__init__()
        self.net = nn.ModuleList(
            [
                _GeluProjection(dim, 4 * dim, gelu_approximation(activation_fn), bias),
                nn.Identity(),
                nn.Linear(4 * dim, dim, bias=bias),
            ]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[2](self.net[0](x))


class _TimestepEmbedder(nn.Module):
    """Sinusoids of the timestep through an MLP; Diffusers' `PixArtAlphaCombinedTimestepSizeEmbeddings`
    without size conditions (the `timestep_embedder` name is kept)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.timestep_embedder = TimestepEmbedding(TIMESTEP_CHANNELS, dim)

    def forward(self, timestep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.timestep_embedder(timestep_sinusoids(timestep, TIMESTEP_CHANNELS).to(dtype))


class LTX2AdaLayerNormSingle(nn.Module):
    """Timesteps -> (`num_mod_params` x dim modulation, embedded timestep), Diffusers' names."""

    def __init__(self, dim: int, num_mod_params: int) -> None:
        super().__init__()
        self.num_mod_params = num_mod_params
        self.emb = _TimestepEmbedder(dim)
        self.linear = nn.Linear(dim, num_mod_params * dim)

    def forward(
        self, timestep: torch.Tensor, batch: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Timesteps with batch * k entries (k = 1, or one per token) -> (batch, k, n * dim), (batch, k, dim);
        the sinusoids are rounded to `dtype` before the MLP, as in Diffusers."""
        embedded = self.emb(timestep.flatten(), dtype)
        modulation = self.linear(F.silu(embedded))
        return modulation.view(batch, -1, modulation.shape[-1]), embedded.view(batch, -1, embedded.shape[-1])


def modulation(table: torch.Tensor, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-layer `table` (n, dim) plus the global modulation `temb` (batch, k, n * dim): n tensors (batch, k, dim)."""
    values = table[None, None].to(temb.device) + temb.unflatten(-1, (table.shape[0], -1))
    return values.unbind(dim=2)


def modulate(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """adaLN: x * (1 + scale) + shift."""
    return x * (1 + scale) + shift


def _text_cross_attention(
    attn: LTX2Attention,
    query: torch.Tensor,
    text: torch.Tensor,
    attn_mask: torch.Tensor | None,
    query_mod: Sequence[torch.Tensor] | None,
) -> torch.Tensor:
    """One modality's text cross-attention output (what its residual adds), from its normed states
    `query`. With `query_mod` = (shift, scale, gate) (LTX-2.3's cross-attention adaLN) the query is
    modulated and the output gated; without it (LTX-2) neither."""
    if query_mod is None:
        return attn(query, text, attn_mask=attn_mask)
    shift_q, scale_q, gate_q = query_mod
    return attn(modulate(query, scale_q, shift_q), text, attn_mask=attn_mask) * gate_q


@dataclass(frozen=True)
class BlockConditioning:
    """What every block of one forward reads besides the hidden states (built once per forward).

    Modulations are (batch, 1 or tokens, n * dim); masks are additive biases (batch, 1, q or 1, kv) or None;
    `temb_prompt*` are None unless the model modulates the text keys/values by timestep (LTX-2.3).
    """

    encoder_hidden_states: torch.Tensor
    audio_encoder_hidden_states: torch.Tensor
    temb: torch.Tensor
    temb_audio: torch.Tensor
    temb_ca_scale_shift: torch.Tensor
    temb_ca_audio_scale_shift: torch.Tensor
    temb_ca_gate: torch.Tensor
    temb_ca_audio_gate: torch.Tensor
    temb_prompt: torch.Tensor | None
    temb_prompt_audio: torch.Tensor | None
    video_rope: LTX2Rope
    audio_rope: LTX2Rope
    ca_video_rope: LTX2Rope
    ca_audio_rope: LTX2Rope
    encoder_attention_mask: torch.Tensor | None
    audio_encoder_attention_mask: torch.Tensor | None
    video_self_attention_mask: torch.Tensor | None
    cross_modal: bool

    def for_rows(self, rows: torch.Tensor) -> BlockConditioning:
        """These inputs for batch rows `rows` only (a step cache runs the rows that compute): every
        per-row tensor and RoPE table sliced, shared ones (one row) kept."""
        values = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                value = _rows(value, rows)
            elif isinstance(value, LTX2Rope):
                value = dataclasses.replace(value, cos=_rows(value.cos, rows), sin=_rows(value.sin, rows))
            values[f.name] = value
        return BlockConditioning(**values)


class LTX2VideoTransformerBlock(nn.Module):
    """One audio-video block (Diffusers' `LTX2VideoTransformerBlock` names).

    `*_cross_attn_adaln` (LTX-2.3) adds three modulation rows (shift, scale, gate of the text
    cross-attention query) to the block table, and, when either modality has it, a per-layer
    (shift, scale) table for the text keys/values of both modalities.
    """

    def __init__(
        self,
        dim: int,
        num_attention_heads: int,
        attention_head_dim: int,
        cross_attention_dim: int,
        audio_dim: int,
        audio_num_attention_heads: int,
        audio_attention_head_dim: int,
        audio_cross_attention_dim: int,
        video_gated_attn: bool,
        video_cross_attn_adaln: bool,
        audio_gated_attn: bool,
        audio_cross_attn_adaln: bool,
        activation_fn: str,
        attention_bias: bool,
        attention_out_bias: bool,
        eps: float,
        elementwise_affine: bool,
        perturbed_attn: bool,
        ff_bias: bool,
        audio_ff_bias: bool,
    ) -> None:
        super().__init__()
        self.perturbed_attn = perturbed_attn
        self.video_cross_attn_adaln = video_cross_attn_adaln
        self.audio_cross_attn_adaln = audio_cross_attn_adaln
        self.cross_attn_adaln = video_cross_attn_adaln or audio_cross_attn_adaln

        def norm(width: int) -> RMSNorm:
            return RMSNorm(width, eps=eps, elementwise_affine=elementwise_affine)

        def attn(query_dim: int, heads: int, head_dim: int, kv_dim: int | None, gated: bool) -> LTX2Attention:
            return LTX2Attention(
                query_dim, heads, head_dim, kv_dim, attention_bias, attention_out_bias, gated
            )

        video = (num_attention_heads, attention_head_dim)
        audio = (audio_num_attention_heads, audio_attention_head_dim)
        self.norm1 = norm(dim)
        self.attn1 = attn(dim, *video, None, video_gated_attn)
        self.audio_norm1 = norm(audio_dim)
        self.audio_attn1 = attn(audio_dim, *audio, None, audio_gated_attn)
        self.norm2 = norm(dim)
        self.attn2 = attn(dim, *video, cross_attention_dim, video_gated_attn)
        self.audio_norm2 = norm(audio_dim)
        self.audio_attn2 = attn(audio_dim, *audio, audio_cross_attention_dim, audio_gated_attn)
        # Both directions of the audio<->video attention use the audio heads.
        self.audio_to_video_norm = norm(dim)
        self.audio_to_video_attn = attn(dim, *audio, audio_dim, video_gated_attn)
        self.video_to_audio_norm = norm(audio_dim)
        self.video_to_audio_attn = attn(audio_dim, *audio, dim, audio_gated_attn)
        self.norm3 = norm(dim)
        self.ff = LTX2FeedForward(dim, activation_fn, ff_bias)
        self.audio_norm3 = norm(audio_dim)
        self.audio_ff = LTX2FeedForward(audio_dim, activation_fn, audio_ff_bias)

        self.scale_shift_table = nn.Parameter(torch.zeros(9 if video_cross_attn_adaln else 6, dim))
        self.audio_scale_shift_table = nn.Parameter(
            torch.zeros(9 if audio_cross_attn_adaln else 6, audio_dim)
        )
        if self.cross_attn_adaln:
            self.prompt_scale_shift_table = nn.Parameter(torch.zeros(2, dim))
            self.audio_prompt_scale_shift_table = nn.Parameter(torch.zeros(2, audio_dim))
        # Rows: a2v scale, a2v shift, v2a scale, v2a shift, gate.
        self.video_a2v_cross_attn_scale_shift_table = nn.Parameter(torch.zeros(5, dim))
        self.audio_a2v_cross_attn_scale_shift_table = nn.Parameter(torch.zeros(5, audio_dim))

    def _prompt_kv_modulation(
        self, table: torch.Tensor, temb_prompt: torch.Tensor | None, like: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """(shift, scale) of the text keys/values: timestep-dependent when `temb_prompt` is given, else the
        static per-layer table (`use_prompt_adaln_single=False`)."""
        if temb_prompt is not None:
            return modulation(table, temb_prompt)
        return table[None, None].to(device=like.device, dtype=like.dtype).unbind(dim=2)

    def forward(
        self,
        x: torch.Tensor,
        a: torch.Tensor,
        cond: BlockConditioning,
        perturbation: Perturbation = NO_PERTURBATION,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Video tokens x (batch, Tv, dim) and audio tokens a (batch, Ta, audio_dim) through the block:

        1. self-attention of each modality (RoPE; STG `perturbation` when the model has `perturbed_attn`);
        2. text cross-attention of each modality (LTX-2.3: modulated query, gated output, modulated text);
        3. unless `cond.cross_modal` is False (modality isolation): audio->video attention (video queries,
           audio keys) and video->audio attention, both from the norms of the states after step 2;
        4. the FFNs.
        """
        if not self.perturbed_attn:
            perturbation = NO_PERTURBATION
        video_mod = modulation(self.scale_shift_table, cond.temb)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = video_mod[:6]
        audio_mod = modulation(self.audio_scale_shift_table, cond.temb_audio)
        a_shift_msa, a_scale_msa, a_gate_msa, a_shift_mlp, a_scale_mlp, a_gate_mlp = audio_mod[:6]

        # 1. Self-attention.
        h = self.attn1(
            modulate(self.norm1(x), scale_msa, shift_msa),
            attn_mask=cond.video_self_attention_mask,
            query_rope=cond.video_rope,
            perturbation=perturbation,
        )
        x = x + h * gate_msa
        h = self.audio_attn1(
            modulate(self.audio_norm1(a), a_scale_msa, a_shift_msa),
            query_rope=cond.audio_rope,
            perturbation=perturbation,
        )
        a = a + h * a_gate_msa

        # 2. Text cross-attention.
        text, audio_text = cond.encoder_hidden_states, cond.audio_encoder_hidden_states
        if self.cross_attn_adaln:
            shift_kv, scale_kv = self._prompt_kv_modulation(
                self.prompt_scale_shift_table, cond.temb_prompt, x
            )
            a_shift_kv, a_scale_kv = self._prompt_kv_modulation(
                self.audio_prompt_scale_shift_table, cond.temb_prompt_audio, a
            )
            text = modulate(text, scale_kv, shift_kv)
            audio_text = modulate(audio_text, a_scale_kv, a_shift_kv)
        x = x + _text_cross_attention(
            self.attn2,
            self.norm2(x),
            text,
            cond.encoder_attention_mask,
            video_mod[6:9] if self.video_cross_attn_adaln else None,
        )
        a = a + _text_cross_attention(
            self.audio_attn2,
            self.audio_norm2(a),
            audio_text,
            cond.audio_encoder_attention_mask,
            audio_mod[6:9] if self.audio_cross_attn_adaln else None,
        )

        # 3. Audio <-> video cross-attention.
        if cond.cross_modal:
            x, a = self._audio_video_attention(x, a, cond)

        # 4. FFNs.
        x = x + self.ff(modulate(self.norm3(x), scale_mlp, shift_mlp)) * gate_mlp
        a = a + self.audio_ff(modulate(self.audio_norm3(a), a_scale_mlp, a_shift_mlp)) * a_gate_mlp
        return x, a

    def modulated_video_input(self, x: torch.Tensor, cond: BlockConditioning) -> torch.Tensor:
        """The video self-attention's input, `norm1(x) * (1 + scale) + shift`: the cheap, timestep-aware
        value TeaCache and the step cache watch (one LayerNorm and the block's modulation)."""
        shift_msa, scale_msa = modulation(self.scale_shift_table, cond.temb)[:2]
        return modulate(self.norm1(x), scale_msa, shift_msa)

    def _audio_video_attention(
        self, x: torch.Tensor, a: torch.Tensor, cond: BlockConditioning
    ) -> tuple[torch.Tensor, torch.Tensor]:
        norm_x = self.audio_to_video_norm(x)
        norm_a = self.video_to_audio_norm(a)
        v_table, a_table = (
            self.video_a2v_cross_attn_scale_shift_table,
            self.audio_a2v_cross_attn_scale_shift_table,
        )
        v_a2v_scale, v_a2v_shift, v_v2a_scale, v_v2a_shift = modulation(v_table[:4], cond.temb_ca_scale_shift)
        a_a2v_scale, a_a2v_shift, a_v2a_scale, a_v2a_shift = modulation(
            a_table[:4], cond.temb_ca_audio_scale_shift
        )
        (a2v_gate,) = modulation(v_table[4:], cond.temb_ca_gate)
        (v2a_gate,) = modulation(a_table[4:], cond.temb_ca_audio_gate)

        h = self.audio_to_video_attn(
            modulate(norm_x, v_a2v_scale, v_a2v_shift),
            modulate(norm_a, a_a2v_scale, a_a2v_shift),
            query_rope=cond.ca_video_rope,
            key_rope=cond.ca_audio_rope,
        )
        x_out = x + a2v_gate * h
        h = self.video_to_audio_attn(
            modulate(norm_a, a_v2a_scale, a_v2a_shift),
            modulate(norm_x, v_v2a_scale, v_v2a_shift),
            query_rope=cond.ca_audio_rope,
            key_rope=cond.ca_video_rope,
        )
        return x_out, a + v2a_gate * h
