"""Text (and, for edits, image) conditioning from Qwen2.5-VL: the last layer's states of the prompt in
the family's chat template (no LM head), real tokens only, minus the template's prefix. For edits the
processor expands `<|image_pad|>` into the input image's vision tokens."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from diffserve.request import Req
from diffserve.stages.base import Stage
from diffserve.stages.prompt_cache import PromptEmbeddingCache
from diffserve.stages.reference_images import ReferenceImages
from diffserve.stages.text_encoding import request_prompts, set_sequence_embeds


class QwenTextEncodingStage(Stage):
    needs = ("do_cfg",)
    sets = ("prompt_embeds",)
    #: Whether the states are cut to the request's `max_sequence_length` (Diffusers' text-to-image,
    #: image-to-image, inpainting and Layered pipelines cut them; its edit pipelines do not).
    truncates: ClassVar[bool] = True

    def __init__(
        self,
        tokenizer,
        text_encoder: nn.Module,
        template: str,
        prefix_tokens: int,
        tokenizer_max_length: int,
        output_dtype: torch.dtype,
        processor=None,
        image_prompt_template: str | None = None,
    ) -> None:
        """`processor`: the Qwen2-VL processor (edit pipelines, see `QwenEditTextEncodingStage`).
        `image_prompt_template`: text with one vision block put before the prompt per image (Edit-Plus)."""
        self.tokenizer = tokenizer
        self.text_encoder = text_encoder
        self.template = template
        self.prefix_tokens = prefix_tokens
        self.tokenizer_max_length = tokenizer_max_length
        self.output_dtype = output_dtype
        self.processor = processor
        self.image_prompt_template = image_prompt_template
        # Text-only prompts are cached; edits are not (their encoding depends on the input images).
        self.cache = PromptEmbeddingCache() if processor is None else None

    @torch.inference_mode()
    def encode(self, prompts: list[str], images: list | None = None) -> list[torch.Tensor]:
        """One (tokens, hidden) tensor per prompt; `images` (one per prompt) only with a processor."""
        texts = [self.template.format(p) for p in prompts]
        if self.processor is not None:
            inputs = self.processor(text=texts, images=images, padding=True, return_tensors="pt")
        else:
            inputs = self.tokenizer(
                texts,
                max_length=self.tokenizer_max_length + self.prefix_tokens,
                padding=True,
                truncation=True,
                return_tensors="pt",
            )
        inputs = inputs.to(next(self.text_encoder.parameters()).device)
        extra = {}
        if "pixel_values" in inputs:
            extra = {"pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"]}
        mask = inputs["attention_mask"].bool()
        hidden = self.text_encoder.model(input_ids=inputs["input_ids"], attention_mask=mask.long(), **extra)
        states = hidden.last_hidden_state
        return [states[i][mask[i]][self.prefix_tokens :].to(self.output_dtype) for i in range(len(prompts))]

    def forward(self, req: Req) -> Req:
        p = req.params
        prompts = request_prompts(req)
        images = None
        if self.processor is not None:
            images = [image for _ in prompts for image in ReferenceImages.of(req).condition_images]
        if self.image_prompt_template is not None:
            count = len(ReferenceImages.of(req).condition_images)
            prefix = "".join(self.image_prompt_template.format(i + 1) for i in range(count))
            prompts = [prefix + prompt for prompt in prompts]
        if self.cache is not None:
            embeds = self.cache.lookup(prompts, (p.max_sequence_length,), self.encode)
        else:
            embeds = self.encode(prompts, images)
        limit = p.max_sequence_length if self.truncates else None
        set_sequence_embeds(req, [e[None, :limit] for e in embeds])
        return req


class QwenEditTextEncodingStage(QwenTextEncodingStage):
    """The edit variant: the prompt is read together with the request's resized input images, and every
    state is kept. Diffusers' `QwenImageEditPipeline` and `QwenImageEditPlusPipeline` check
    `max_sequence_length` (at most 1024) but never cut the states to it: the input images' vision tokens
    come first in the user turn (over 1300 for a 1024x1024 image) and a cut at the default 512 would drop
    the rest of the image and the whole instruction."""

    needs = ("do_cfg", "conditioning.condition_images")
    truncates = False
