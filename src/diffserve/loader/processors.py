"""Qwen2-VL processors (tokenizer + image preprocessor) for the Qwen-Image edit pipelines, built without
the video processor that transformers' `from_pretrained` adds and that needs torchvision. transformers
learns a processor's parts from its constructor's parameters, hence a subclass without a video one."""

from __future__ import annotations

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
