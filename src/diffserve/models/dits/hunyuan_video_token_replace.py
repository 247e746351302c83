"""HunyuanVideo (1.0) image-to-video's "token replace" conditioning (`image_condition_type="token_replace"`,
the released `HunyuanVideo-I2V` DiT): the clean first frame's latent tokens ride at timestep 0.

The pipeline puts the input image's latents in the first latent frame; inside the DiT, the first frame's
tokens (the first `height' * width'` video tokens) are modulated by a second temb, that of timestep 0
(`MLP(sinusoids(0)) + MLP(pooled text)`, no guidance), while the other video tokens and the context keep
the request's temb. Every block's adaLN shift, scale and gate is split the same way; attention, norms and
MLPs run over the whole sequence. The blocks' weights are the plain blocks' (same names).

The split is Diffusers' own (modulate / gate each part, concatenate), so the numbers are bit-identical.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from diffserve.layers.embeddings import CombinedTimestepTextEmbedding, timestep_sinusoids
from diffserve.layers.modulation import Modulate
from diffserve.layers.residual import attention_mlp_residuals, gated_residual
from diffserve.models.dits.hunyuan_shared import FirstFrame, JointBlockInputs
from diffserve.models.dits.hunyuan_video15 import HunyuanVideo15TransformerBlock
from diffserve.models.dits.hunyuan_video_single_block import HunyuanVideoSingleTransformerBlock


def first_frame(inputs: JointBlockInputs) -> FirstFrame:
    """The first frame a token_replace block modulates apart; refused when the DiT passes none."""
    if inputs.first is None:
        raise ValueError("a token_replace block needs the first frame's temb (JointBlockInputs.first)")
    return inputs.first


def first_frame_temb(
    embed: CombinedTimestepTextEmbedding, timestep: torch.Tensor, pooled: torch.Tensor
) -> torch.Tensor:
    """The first frame's temb, (batch, inner): the timestep embedder at t = 0 plus the pooled text's
    projection (Diffusers' `token_replace_emb`; the guidance embedding is not part of it)."""
    zeros = timestep_sinusoids(torch.zeros_like(timestep), embed.num_channels).to(pooled.dtype)
    return embed.timestep_embedder(zeros) + embed.text_embedder(pooled)


def modulate_split(
    modulate: Modulate,
    x: torch.Tensor,
    tokens: int,
    first: tuple[torch.Tensor, torch.Tensor],
    rest: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """`x` (batch, seq, dim) modulated by (scale, shift) `first` on its leading `tokens`, `rest` after."""
    return torch.cat(
        [
            modulate(x[:, :tokens], scale=first[0], shift=first[1]),
            modulate(x[:, tokens:], scale=rest[0], shift=rest[1]),
        ],
        dim=1,
    )


def gated_residual_split(
    residual: torch.Tensor, x: torch.Tensor, tokens: int, gate_first: torch.Tensor, gate_rest: torch.Tensor
) -> torch.Tensor:
    """`residual + gate * x`, the (batch, dim) gate `gate_first` on the leading `tokens`, `gate_rest` after."""
    return torch.cat(
        [
            gated_residual(residual[:, :tokens], gate_first.unsqueeze(1), x[:, :tokens]),
            gated_residual(residual[:, tokens:], gate_rest.unsqueeze(1), x[:, tokens:]),
        ],
        dim=1,
    )


class HunyuanVideoTokenReplaceTransformerBlock(HunyuanVideo15TransformerBlock):
    """The double-stream block with the video stream's adaLN split at the first frame (Diffusers'
    `HunyuanVideoTokenReplaceTransformerBlock`); the context stream is the plain block's."""

    def forward(
        self, x: torch.Tensor, ctx: torch.Tensor, inputs: JointBlockInputs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(video, context) after the block; `inputs.first` is required."""
        temb_act, first = inputs.temb_act, first_frame(inputs)
        n = first.tokens
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1.linear(temb_act).chunk(
            6, 1
        )
        f_shift_msa, f_scale_msa, f_gate_msa, f_shift_mlp, f_scale_mlp, f_gate_mlp = self.norm1.linear(
            first.temb_act
        ).chunk(6, 1)
        norm_x = modulate_split(
            self.modulate, self.norm1.norm(x), n, (f_scale_msa, f_shift_msa), (scale_msa, shift_msa)
        )
        norm_c, *ctx_mods = self.norm1_context(ctx, temb_act)
        attn_x, attn_c = self.attn(norm_x, norm_c, inputs.rope, inputs.key_mask)
        x = gated_residual_split(x, attn_x, n, f_gate_msa, gate_msa)
        ff_in = modulate_split(
            self.modulate, self.norm2(x), n, (f_scale_mlp, f_shift_mlp), (scale_mlp, shift_mlp)
        )
        x = gated_residual_split(x, self.ff(ff_in), n, f_gate_mlp, gate_mlp)
        ctx = attention_mlp_residuals(
            ctx, attn_c, ctx_mods, self.norm2_context, self.ff_context, self.modulate
        )
        return x, ctx


class HunyuanVideoTokenReplaceSingleTransformerBlock(HunyuanVideoSingleTransformerBlock):
    """The single-stream block with its adaLN split at the first frame (Diffusers'
    `HunyuanVideoTokenReplaceSingleTransformerBlock`)."""

    def forward(
        self, x: torch.Tensor, ctx: torch.Tensor, inputs: JointBlockInputs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(video, context) after the block; `inputs.first` is required."""
        temb_act, first = inputs.temb_act, first_frame(inputs)
        n, video_len = first.tokens, x.shape[1]
        h = torch.cat([x, ctx], dim=1)
        shift, scale, gate = self.norm.linear(temb_act).chunk(3, dim=1)
        f_shift, f_scale, f_gate = self.norm.linear(first.temb_act).chunk(3, dim=1)
        norm_h = modulate_split(self.norm.modulate, self.norm.norm(h), n, (f_scale, f_shift), (scale, shift))
        mlp = F.gelu(self.proj_mlp(norm_h), approximate="tanh")
        attn = self.attn(norm_h, video_len, inputs.rope, inputs.key_mask)
        h = gated_residual_split(h, self.proj_out(torch.cat([attn, mlp], dim=2)), n, f_gate, gate)
        return h[:, :video_len], h[:, video_len:]
