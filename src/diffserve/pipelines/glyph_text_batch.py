"""What the denoising steps of the pipelines whose DiT reads Qwen2.5-VL text states and ByT5 glyph states
(`glyph_text_encoding.py`: HunyuanImage 2.1's and HunyuanVideo 1.5's) gather alike: the components they
load, and the DiT inputs of one step, branch by branch, as Diffusers' pipelines pass them."""

from __future__ import annotations

import torch

from diffserve.pipelines.cfg_batch import next_timesteps
from diffserve.request import Req

#: The components such a pipeline loads (a family adds its own, its guider, say).
GLYPH_TEXT_COMPONENTS = (
    "text_encoder",
    "tokenizer",
    "text_encoder_2",
    "tokenizer_2",
    "transformer",
    "vae",
    "scheduler",
)

#: One branch's (text states, text mask, glyph states, glyph mask), as `GlyphTextConditioning.text_branches`.
TextBranch = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class GlyphTextBatch:
    """The DiT inputs of one step over a list of requests, one entry per text branch in row order: latents,
    timesteps (in the DiT's dtype), MeanFlow's next timesteps when the DiT reads them, and the branch's
    text and glyph states with their masks."""

    def __init__(self, meanflow: bool, dtype: torch.dtype) -> None:
        self.meanflow = meanflow
        self.dtype = dtype
        self.latents: list[torch.Tensor] = []
        self.timesteps: list[torch.Tensor] = []
        self.timesteps_r: list[torch.Tensor] = []
        self.text: list[torch.Tensor] = []
        self.text_mask: list[torch.Tensor] = []
        self.glyph: list[torch.Tensor] = []
        self.glyph_mask: list[torch.Tensor] = []

    def add(self, req: Req, latents: torch.Tensor, branch: TextBranch) -> None:
        """One branch of `req`, read at its current step with these (DiT-dtype) latents."""
        states, mask, states_2, mask_2 = branch
        self.latents.append(latents)
        self.timesteps.append(req.schedule.timesteps[req.step_index].expand(req.batch_size).to(self.dtype))
        if self.meanflow:
            self.timesteps_r.append(next_timesteps(req).expand(req.batch_size).to(self.dtype))
        self.text.append(states)
        self.text_mask.append(mask)
        self.glyph.append(states_2)
        self.glyph_mask.append(mask_2)

    def dit_kwargs(self) -> dict[str, torch.Tensor | None]:
        """The DiT's keyword arguments for the gathered rows (`timestep_r` None without MeanFlow)."""
        return {
            "hidden_states": torch.cat(self.latents),
            "timestep": torch.cat(self.timesteps),
            "encoder_hidden_states": torch.cat(self.text),
            "encoder_attention_mask": torch.cat(self.text_mask),
            "timestep_r": torch.cat(self.timesteps_r) if self.timesteps_r else None,
            "encoder_hidden_states_2": torch.cat(self.glyph),
            "encoder_attention_mask_2": torch.cat(self.glyph_mask),
        }
