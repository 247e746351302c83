"""Tokenizers and processors a model_index.json names, resolved by name through transformers (so a class a
newer transformers saves under a new name, as transformers 5's `TokenizersBackend`, is known without a list
to update); and processors without torchvision: Qwen2-VL processors (tokenizer + image preprocessor) for the
Qwen-Image edit pipelines, built without the video processor that transformers' `from_pretrained` adds and
that needs torchvision (transformers learns a processor's parts from its constructor's parameters, hence a
subclass without a video one); and processors of which only the tokenizer is used (FLUX.2-dev's)."""

from __future__ import annotations

import functools
import inspect
import json
from pathlib import Path
from typing import Literal

import transformers

Role = Literal["tokenizer", "processor", "image_processor"]

#: Qwen2-VL image processors (`smart_resize`) refuse an image whose long side is more than this many times
#: its short side: the families that give their input images to one check them against it at submission.
QWEN2_VL_MAX_ASPECT_RATIO = 200

#: The module transformers would import a class from (`tokenization_clip`, `processing_pixtral`, ...) -> the
#: class's role, for the placeholders transformers hands out for classes whose backend (torchvision,
#: sentencepiece) is not installed. Longest prefix first: `image_processing_` before `processing_`.
_MODULE_ROLES: tuple[tuple[str, Role], ...] = (
    ("image_processing_", "image_processor"),
    ("processing_", "processor"),
    ("tokenization_", "tokenizer"),
)


def transformers_class(class_name: str) -> type | None:
    """transformers' public class `class_name`, or None when transformers has none by that name."""
    if not class_name.isidentifier() or class_name.startswith("_"):
        return None
    try:
        cls = getattr(transformers, class_name, None)
    except (ImportError, RuntimeError):  # its module fails to import (a broken optional dependency)
        return None
    return cls if isinstance(cls, type) else None


def needs_missing_backend(cls: type) -> bool:
    """Whether `cls` is transformers' placeholder for a class whose backend is not installed."""
    return getattr(cls, "_backends", None) is not None and not _real_role(cls)


def _real_role(cls: type) -> Role | None:
    if issubclass(cls, transformers.PreTrainedTokenizerBase):
        return "tokenizer"
    if issubclass(cls, transformers.ProcessorMixin):
        return "processor"
    if issubclass(cls, transformers.ImageProcessingMixin):
        return "image_processor"
    return None


@functools.cache
def transformers_role(class_name: str) -> Role | None:
    """What the transformers class `class_name` loads: "tokenizer" (any `PreTrainedTokenizerBase`),
    "processor" (any `ProcessorMixin`) or "image_processor" (any `ImageProcessingMixin`); None for any
    other name (a model class, or a name transformers does not have). A class whose backend is not
    installed is judged by the module transformers would import it from."""
    cls = transformers_class(class_name)
    if cls is None:
        return None
    role = _real_role(cls)
    if role is None and getattr(cls, "_backends", None) is not None:
        module = cls.__module__.rsplit(".", 1)[-1]
        role = next((role for prefix, role in _MODULE_ROLES if module.startswith(prefix)), None)
    return role


def load_named_tokenizer(class_name: str, directory: str | Path):
    """The tokenizer class `class_name` from `directory`; when transformers has it only as a placeholder
    (its backend, e.g. sentencepiece, is not installed), whatever tokenizer transformers can load from the
    folder's files (a tokenizer.json needs no backend)."""
    cls = transformers_class(class_name)
    if cls is None or needs_missing_backend(cls):
        cls = transformers.AutoTokenizer
    return cls.from_pretrained(str(directory), local_files_only=True)


def load_named_image_processor(class_name: str, directory: str | Path):
    """The image processor class `class_name` from `directory`; when its backend (torchvision) is not
    installed, the one transformers' `AutoImageProcessor` picks for the folder's config (its PIL twin)."""
    cls = transformers_class(class_name)
    if cls is None or needs_missing_backend(cls):
        cls = transformers.AutoImageProcessor
    return cls.from_pretrained(str(directory), local_files_only=True)


def _image_only(cls: type) -> type:
    class ImageOnlyProcessor(cls):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs) -> None:
            super().__init__(
                image_processor=image_processor,
                tokenizer=tokenizer,
                video_processor=None,
                chat_template=chat_template,
                **kwargs,
            )

    ImageOnlyProcessor.__name__ = ImageOnlyProcessor.__qualname__ = f"ImageOnly{cls.__name__}"
    return ImageOnlyProcessor


#: The Qwen-VL processors built from their image and text parts only (`_image_only`).
IMAGE_ONLY_PROCESSOR_NAMES: frozenset[str] = frozenset({"Qwen2VLProcessor", "Qwen2_5_VLProcessor"})


@functools.cache
def image_only_processor(class_name: str) -> type:
    """`_image_only` of transformers' `class_name`, built on first use: reading the class imports
    transformers' processing modules, which every process that imports this loader would pay for at start."""
    return _image_only(getattr(transformers, class_name))


def load_image_text_processor(class_name: str, directory: str | Path):
    """The named processor from a `processor/` folder. One with a video part (the Qwen-VL processors) is
    built from its image and text parts only, as the video processor needs torchvision; another is the
    processor transformers' `from_pretrained` builds."""
    cls = image_only_processor(class_name) if class_name in IMAGE_ONLY_PROCESSOR_NAMES else None
    if cls is None:
        named = transformers_class(class_name)
        if named is None or needs_missing_backend(named):
            backends = ", ".join(getattr(named, "_backends", ())) or "a library"
            raise ValueError(f"transformers needs {backends} (not installed) to build a {class_name}")
        if "video_processor" not in inspect.signature(named.__init__).parameters:
            return named.from_pretrained(str(directory), local_files_only=True)
        cls = _image_only(named)
    image_processor = transformers.AutoImageProcessor.from_pretrained(str(directory), local_files_only=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    return cls(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=processor_chat_template(directory)
    )


#: Processors of which diffserve loads only the tokenizer, with the processor's chat template. FLUX.2-dev's
#: `tokenizer` is a PixtralProcessor: Diffusers shows it images only to upsample prompts, which diffserve
#: does not do, and transformers constructs a PixtralProcessor only with torchvision installed.
TOKENIZER_ONLY_PROCESSORS: frozenset[str] = frozenset({"PixtralProcessor"})

#: A processor's chat template files, in the order transformers' processors read them (the legacy JSON
#: holds {"chat_template": "..."}); they win over a template in tokenizer_config.json.
_PROCESSOR_TEMPLATE_JINJA = "chat_template.jinja"
_PROCESSOR_TEMPLATE_JSON = "chat_template.json"


def processor_chat_template(directory: str | Path) -> str | None:
    """The chat template a processor folder ships (`chat_template.jinja`, else the legacy JSON), or None."""
    jinja, legacy = Path(directory) / _PROCESSOR_TEMPLATE_JINJA, Path(directory) / _PROCESSOR_TEMPLATE_JSON
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    if legacy.is_file():
        return json.loads(legacy.read_text(encoding="utf-8"))["chat_template"]
    return None


def load_processor_tokenizer(directory: str | Path):
    """The tokenizer of a processor folder, carrying the chat template the processor would apply."""
    directory = Path(directory)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    if (template := processor_chat_template(directory)) is not None:
        tokenizer.chat_template = template
    if tokenizer.chat_template is None:
        raise ValueError(
            f"{directory} has no chat template ({_PROCESSOR_TEMPLATE_JINJA} or {_PROCESSOR_TEMPLATE_JSON})"
        )
    return tokenizer
