"""HunyuanVideo image-to-video's text encoding, as Diffusers' `HunyuanVideoImageToVideoPipeline.encode_prompt`
does it:

- Llava (`LlavaForConditionalGeneration`): the prompt in the image-to-video template, padded and truncated to
  `max_sequence_length + crop_start` tokens; the template's one `<image>` token widened to the image's
  `image_emb_len` vision tokens (the attention mask then marks every non-pad token, the positions count
  them), read with the image's `CLIPImageProcessor` pixels; the states of the hidden layer
  `hidden_layers_to_skip` before the last, in the encoder's dtype.
- Cropping: the text states are those after the template's first `crop_start` tokens, without the
  assistant turn's header (the 4 tokens before the last `<|end_header_id|>`'s successor), the mask cropped
  alike; the image tokens' states (every `interleave`-th) go first, with a mask of ones.
- CLIP: the pooled output of the prompt, as text-to-video.

The prompt's image tokens keep every `image_embed_interleave`-th (the request's `extra` setting, else the
DiT's default). The negative prompt (true CFG) is read with a black image of the output size and interleave
2, as Diffusers encodes it. One prompt and image per Llava call, as Diffusers' pipeline (its crop is
written for one row).
"""

from __future__ import annotations

import torch
from PIL import Image
from torch import nn

from diffserve.families.hunyuan_video.conditioning import HunyuanVideoConditioning
from diffserve.families.hunyuan_video.image_to_video_config import (
    HunyuanVideoImageToVideoPipelineConfig,
    hunyuan_video_i2v_settings,
)
from diffserve.families.hunyuan_video.text_encoding import HunyuanVideoTextEncodingStage
from diffserve.request import Req


def widen_image_token(
    ids: torch.Tensor, image_token: int, pad_token: int, position: int, width: int
) -> dict[str, torch.Tensor]:
    """Llava's inputs for one row of token `ids` (1, L) whose only `image_token` is at `position`: the ids
    with that token repeated `width` times, the attention mask of every non-`pad_token` id and the
    positions counting the unmasked ids (1 where masked), as Diffusers' `_expand_input_ids_with_image_tokens`."""
    found = (ids[0] == image_token).nonzero().flatten().tolist()
    if found != [position]:
        raise ValueError(
            f"the image-to-video template must hold one <image> token at position {position} (found at "
            f"{found}): is there an <image> in the prompt, or a tokenizer other than the checkpoint's?"
        )
    image = ids.new_full((1, width), image_token)
    expanded = torch.cat([ids[:, :position], image, ids[:, position + 1 :]], dim=1)
    mask = (expanded != pad_token).long()
    positions = (mask.cumsum(-1) - 1).masked_fill_(mask == 0, 1)
    return {"input_ids": expanded, "attention_mask": mask, "position_ids": positions}


class HunyuanVideoImageTextEncodingStage(HunyuanVideoTextEncodingStage):
    """Sets what the text-to-video stage sets, from the prompt and the request's input image."""

    def __init__(
        self,
        tokenizer,
        text_encoder: nn.Module,
        clip_tokenizer,
        clip_encoder: nn.Module,
        image_processor,
        config: HunyuanVideoImageToVideoPipelineConfig,
        output_dtype: torch.dtype,
        image_embed_interleave: int,
    ) -> None:
        super().__init__(tokenizer, text_encoder, clip_tokenizer, clip_encoder, config, output_dtype)
        self.config: HunyuanVideoImageToVideoPipelineConfig = config
        self.image_processor = image_processor
        self.image_embed_interleave = image_embed_interleave
        self.end_header_id = int(tokenizer.convert_tokens_to_ids(config.end_header_token))

    def assistant_start(self, ids: torch.Tensor) -> int:
        """The position after the last `<|end_header_id|>` of the row (the assistant turn's text); when the
        prompt's truncation cut the assistant header, after the last token, as Diffusers does."""
        found = (ids[0] == self.end_header_id).nonzero().flatten().tolist()
        if len(found) == 2:
            found.append(ids.shape[1] - 1)
        return found[-1] + 1

    @torch.inference_mode()
    def encode_llava(
        self, prompt: str, image: Image.Image, max_sequence_length: int, interleave: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(1, image tokens + max_sequence_length - 4, dim) states in the encoder's dtype and their bool mask."""
        c = self.config
        device = next(self.text_encoder.parameters()).device
        tokens = self.tokenizer(
            [c.prompt_template.format(prompt)],
            max_length=max_sequence_length + c.crop_start,
            padding="max_length",
            truncation=True,
            return_tensors="pt",
            return_attention_mask=True,
        )
        ids, mask = tokens.input_ids.to(device), tokens.attention_mask.to(device)
        pixels = self.image_processor(image, return_tensors="pt").pixel_values.to(device)
        llava = self.text_encoder.config
        inputs = widen_image_token(
            ids, llava.image_token_index, llava.pad_token_id, c.image_emb_start, c.image_emb_len
        )
        hidden = self.text_encoder(**inputs, pixel_values=pixels, output_hidden_states=True).hidden_states
        states = hidden[-(c.hidden_layers_to_skip + 1)][0]

        # In the widened row, token i > image_emb_start sits at i + image_emb_len - 1.
        shift = c.image_emb_len - 1
        assistant = self.assistant_start(ids)
        header = c.assistant_header_tokens
        text = torch.cat(
            [states[c.crop_start + shift : assistant + shift - header], states[assistant + shift :]]
        )
        text_mask = torch.cat([mask[0, c.crop_start : assistant - header], mask[0, assistant:]])
        image_states = states[c.image_emb_start : c.image_emb_end]
        if 0 < interleave < 6:  # Diffusers' bounds
            image_states = image_states[::interleave]
        image_mask = text_mask.new_ones(image_states.shape[0])
        return torch.cat([image_states, text])[None], torch.cat([image_mask, text_mask])[None].bool()

    def encode_with_image(
        self, prompt: str, image: Image.Image, max_sequence_length: int, interleave: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One prompt's (Llava states, mask, pooled CLIP text), the states and pooled in `output_dtype`."""
        states, mask = self.encode_llava(prompt, image, max_sequence_length, interleave)
        pooled = self.encode_clip([prompt])
        return states.to(self.output_dtype), mask, pooled.to(self.output_dtype)

    def forward(self, req: Req) -> Req:
        p = req.params
        msl, n = p.max_sequence_length, p.num_outputs_per_prompt
        conditioning = HunyuanVideoConditioning.of(req)
        interleave = hunyuan_video_i2v_settings(p).interleave(self.image_embed_interleave)
        states, mask, pooled = self.encode_with_image(p.prompt, p.input_images[0], msl, interleave)
        req.prompt_embeds, conditioning.text_mask = states.repeat(n, 1, 1), mask.repeat(n, 1)
        req.pooled_prompt_embeds = pooled.repeat(n, 1)
        if req.do_cfg:
            black = Image.new("RGB", (p.width, p.height), 0)
            interleave = self.config.negative_image_embed_interleave
            states, mask, pooled = self.encode_with_image(p.negative_prompt, black, msl, interleave)
            req.negative_prompt_embeds = states.repeat(n, 1, 1)
            conditioning.negative_text_mask = mask.repeat(n, 1)
            req.negative_pooled_prompt_embeds = pooled.repeat(n, 1)
        return req
