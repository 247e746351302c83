"""Qwen-Image 2.1's prompt states from Qwen3-VL, as Diffusers' `QwenImage21Pipeline` reads them.

The prompt goes into the raw text-to-image template (an empty prompt becomes " ": Qwen has no BOS token to
read), through the processor (left padding) and the language model with its attention mask. The states
kept are the last decoder layer's output *before* the model's final RMSNorm (what the DiT was trained on;
transformers 5 would return them normalised, so the norm is bypassed for the call), of the real tokens,
minus the leading system turn: as many tokens as the processor's chat template gives the system message
alone (Diffusers' `_drop_idx`). Each prompt is encoded on its own, as Diffusers encodes one prompt per call.

With condition images (`QwenImage21Conditioning.vision_images`), each image's vision slots go at the start
of the user turn (" "-separated, before the prompt), the processor expands each into its image tokens and
the vision tower fills them; the states of those tokens stay in place, and where each image's run of them
starts is recorded per branch (the DiT puts the image's latents there). Such prompts bypass the cache.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from PIL import Image
from torch import nn

from diffserve.families.qwen_image21.conditioning import QwenImage21Conditioning
from diffserve.request import Req
from diffserve.stages.base import Stage
from diffserve.stages.prompt_cache import PromptEmbeddingCache
from diffserve.stages.text_encoding import request_prompts, set_sequence_embeds


def system_token_count(processor: Callable, system_prompt: str) -> int:
    """Tokens of the system message alone under the processor's chat template (Diffusers' `_drop_idx`);
    a ValueError where the processor has none (the folder's `chat_template.jinja`), as the count cannot be
    known."""
    if getattr(processor, "chat_template", None) is None:
        raise ValueError(
            "QwenImage21Pipeline: the processor folder has no chat template (chat_template.jinja or .json), "
            "which sets how many system-turn states are dropped"
        )
    message = [{"role": "system", "content": [{"type": "text", "text": system_prompt}]}]
    return len(processor.apply_chat_template(message, tokenize=True, return_dict=False)[0])


def language_model(text_encoder: nn.Module) -> nn.Module:
    """The decoder stack of a Qwen3-VL model (its `language_model`)."""
    return getattr(text_encoder.model, "language_model", text_encoder.model)


class QwenImage21TextEncodingStage(Stage):
    needs = ("do_cfg", "conditioning.vision_images")
    sets = ("prompt_embeds", "conditioning.slots")

    def __init__(
        self,
        processor: Callable,
        text_encoder: nn.Module,
        template: str,
        image_slot: str,
        system_prompt: str,
        dtype: torch.dtype,
    ) -> None:
        self.processor = processor
        self.text_encoder = text_encoder
        self.template = template
        self.image_slot = image_slot
        self.image_token = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
        self.dtype = dtype
        self.drop = system_token_count(processor, system_prompt)
        self.cache = PromptEmbeddingCache()

    def image_template(self, count: int) -> str:
        """The template with `count` images' vision slots before the prompt."""
        slots = " ".join(self.image_slot.format(i) for i in range(1, count + 1))
        return self.template.replace("<|im_start|>user\n", f"<|im_start|>user\n{slots}", 1)

    def encode_one(self, prompt: str) -> torch.Tensor:
        """(tokens, hidden) states of one prompt."""
        return self.encode_with_images(prompt, [])[0]

    @torch.inference_mode()
    def encode_with_images(
        self, prompt: str, images: list[Image.Image]
    ) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """(tokens, hidden) states of one prompt with `images` in its vision slots, and each image's
        (first slot, slot count) among those states."""
        template = self.image_template(len(images)) if images else self.template
        text = template.format(prompt or " ")
        extra_inputs = {"images": list(images)} if images else {}
        inputs = self.processor(
            text=[text], padding=True, padding_side="left", return_tensors="pt", **extra_inputs
        )
        inputs = inputs.to(next(self.text_encoder.parameters()).device)
        extra = {"mm_token_type_ids": inputs["mm_token_type_ids"]} if "mm_token_type_ids" in inputs else {}
        if images:
            extra["pixel_values"] = inputs["pixel_values"]
            extra["image_grid_thw"] = inputs["image_grid_thw"]
        norm = language_model(self.text_encoder).norm
        handle = norm.register_forward_hook(lambda _module, args, _output: args[0])  # the pre-norm states
        try:
            states = self.text_encoder.model(
                input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], **extra
            ).last_hidden_state
        finally:
            handle.remove()
        mask = inputs["attention_mask"][0].bool()
        is_slot = (inputs["input_ids"][0][mask][self.drop :] == self.image_token).tolist()
        return states[0][mask][self.drop :].to(self.dtype), slot_runs(is_slot, len(images))

    def encode(self, prompts: list[str]) -> list[torch.Tensor]:
        return [self.encode_one(prompt) for prompt in prompts]

    def forward(self, req: Req) -> Req:
        conditioning = QwenImage21Conditioning.of(req)
        images = conditioning.vision_images
        if not images:
            embeds = self.cache.lookup(request_prompts(req), (), self.encode)
        else:
            encoded = [self.encode_with_images(p, images) for p in request_prompts(req)]
            embeds = [states for states, _ in encoded]
            conditioning.slots = [slots for _, slots in encoded]
        set_sequence_embeds(req, [e[None] for e in embeds])
        return req


def slot_runs(is_slot: list[bool], count: int) -> list[tuple[int, int]]:
    """(start, length) of each run of image tokens, in order; a ValueError unless there are `count`."""
    runs: list[tuple[int, int]] = []
    for index, flag in enumerate(is_slot):
        if not flag:
            continue
        if runs and runs[-1][0] + runs[-1][1] == index:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((index, 1))
    if len(runs) != count:
        raise ValueError(
            f"QwenImage21Pipeline: {count} condition images but {len(runs)} runs of image tokens"
        )
    return runs
