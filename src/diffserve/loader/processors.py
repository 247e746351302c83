"""Processors without torchvision: Qwen2-VL processors (tokenizer + image preprocessor) for the Qwen-Image
edit pipelines, built without the video processor that transformers' `from_pretrained` adds and that
needs torchvision (transformers learns a processor's parts from its constructor's parameters, hence a
subclass without a video one); and processors of which only the tokenizer is used (FLUX.2-dev's)."""

from __future__ import annotations

import json
from pathlib import Path

import transformers


def _image_only(cls: type) -> type:
    class ImageOnlyProcessor(cls):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs) -> None:
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    ImageOnlyProcessor.__name__ = ImageOnlyProcessor.__qualname__ = f"ImageOnly{cls.__name__}"
    return ImageOnlyProcessor


IMAGE_ONLY_PROCESSORS: dict[str, type] = {
    name: _image_only(getattr(transformers, name)) for name in ("Qwen2VLProcessor", "Qwen2_5_VLProcessor")
}


def load_image_text_processor(class_name: str, directory: str | Path):
    """The named processor from a `processor/` folder, image and text parts only."""
    cls = IMAGE_ONLY_PROCESSORS[class_name]
    image_processor = transformers.AutoImageProcessor.from_pretrained(str(directory), local_files_only=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    return cls(image_processor=image_processor, tokenizer=tokenizer)


#: Processors of which diffserve loads only the tokenizer, with the processor's chat template. FLUX.2-dev's
#: `tokenizer` is a PixtralProcessor: Diffusers shows it images only to upsample prompts, which diffserve
#: does not do, and transformers constructs a PixtralProcessor only with torchvision installed.
TOKENIZER_ONLY_PROCESSORS: frozenset[str] = frozenset({"PixtralProcessor"})

#: A processor's chat template files, in the order transformers' processors read them (the legacy JSON
#: holds {"chat_template": "..."}); they win over a template in tokenizer_config.json.
_PROCESSOR_TEMPLATE_JINJA = "chat_template.jinja"
_PROCESSOR_TEMPLATE_JSON = "chat_template.json"


def load_processor_tokenizer(directory: str | Path):
    """The tokenizer of a processor folder, carrying the chat template the processor would apply."""
    directory = Path(directory)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    jinja, legacy = directory / _PROCESSOR_TEMPLATE_JINJA, directory / _PROCESSOR_TEMPLATE_JSON
    if jinja.is_file():
        tokenizer.chat_template = jinja.read_text(encoding="utf-8")
    elif legacy.is_file():
        tokenizer.chat_template = json.loads(legacy.read_text(encoding="utf-8"))["chat_template"]
    if tokenizer.chat_template is None:
        raise ValueError(
            f"{directory} has no chat template ({_PROCESSOR_TEMPLATE_JINJA} or {_PROCESSOR_TEMPLATE_JSON})"
        )
    return tokenizer
