"""The stages of LongCat-Image-Edit: the input image's preparation, the prompt encoded together with it, and
the position ids of its tokens.

As Diffusers' `LongCatImageEditPipeline` does it: the input image is resized (Lanczos) to the output size
and VAE-encoded (the posterior's mode, shifted and scaled) into packed latents appended to the noisy tokens
(position ids with modality 2 on the same grid); a copy at half the sides is shown to Qwen2.5-VL, whose
vision tokens fill the template's `<|image_pad|>`. The kept states start at `<|vision_start|>`: the vision
block, then the prompt's `tokenizer_max_length` tokens.
"""

from __future__ import annotations

import torch
from PIL import Image
from torch import nn

from diffserve.families.longcat_image.conditioning import LongCatImageEditConditioning
from diffserve.families.longcat_image.stages import (
    REFERENCE_MODALITY,
    LongCatLatentPreparationStage,
    LongCatTextEncodingStage,
    image_position_ids,
    text_position_ids,
)
from diffserve.request import Req
from diffserve.stages.base import Stage
from diffserve.stages.reference_images import ReferenceImages, set_packed_reference
from diffserve.stages.text_encoding import request_prompts, set_sequence_embeds

IMAGE_PAD, VISION_START = "<|image_pad|>", "<|vision_start|>"


class LongCatEditPreparationStage(Stage):
    """The input image at the output's size as packed latents (one copy per output), and at half its sides
    for the text encoder."""

    needs = ("generator",)
    sets = ("conditioning.condition_images", "conditioning.condition_latents")

    def __init__(self, vae: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
        self.vae = vae
        self.device = device
        self.dtype = dtype

    @torch.inference_mode()
    def forward(self, req: Req) -> Req:
        p = req.params
        (original,) = p.input_images
        image = original.resize((p.width, p.height), Image.Resampling.LANCZOS)
        shown = image.resize((p.width // 2, p.height // 2), Image.Resampling.LANCZOS)
        set_packed_reference(req, self.vae, image, shown, self.device, self.dtype)
        return req


class LongCatEditTextEncodingStage(LongCatTextEncodingStage):
    """Each text with the input image's vision block before it; not cached (it depends on the image)."""

    needs = ("do_cfg", "conditioning.condition_images")

    def __init__(self, *args, image_processor, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.image_processor = image_processor
        self.template_prefix = kwargs["prefix"]
        self.vision_start_id = self.tokenizer.convert_tokens_to_ids(VISION_START)

    @torch.inference_mode()
    def encode_with_image(self, prompt: str, image: Image.Image) -> torch.Tensor:
        """(vision block + max_length, hidden): the states from `<|vision_start|>` to the suffix."""
        vision = self.image_processor(images=image, return_tensors="pt")
        grid = vision["image_grid_thw"]
        tokens = int(grid.prod()) // self.image_processor.merge_size**2
        prefix = self.template_prefix.replace(IMAGE_PAD, IMAGE_PAD * tokens)
        prefix_ids = self.tokenizer(prefix, add_special_tokens=False)["input_ids"]
        ids, mask = self.token_ids([prompt], prefix_ids)
        device = next(self.text_encoder.parameters()).device
        states = self.text_encoder.model(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            pixel_values=vision["pixel_values"].to(device),
            image_grid_thw=grid.to(device),
        ).last_hidden_state
        start, end = prefix_ids.index(self.vision_start_id), states.shape[1] - len(self.suffix_ids)
        return states[0, start:end].to(self.output_dtype)

    def forward(self, req: Req) -> Req:
        (image,) = ReferenceImages.of(req).condition_images
        embeds = [self.encode_with_image(prompt, image) for prompt in request_prompts(req)]
        set_sequence_embeds(req, [e[None] for e in embeds])
        length, device = req.prompt_embeds.shape[1], req.prompt_embeds.device
        LongCatImageEditConditioning.of(req).text_ids = text_position_ids(length, device)
        return req


class LongCatEditLatentPreparationStage(LongCatLatentPreparationStage):
    """The noise and its ids, then the input image's ids (modality 2, after the text, its own grid)."""

    def reference_ids(self, req: Req, text_length: int) -> list[torch.Tensor]:
        return [
            image_position_ids(rows, cols, text_length, self.device, modality=REFERENCE_MODALITY)
            for _, rows, cols in ReferenceImages.of(req).condition_shapes
        ]
