"""Issue 31 item 9: folders saved by the installed transformers load. A model_index.json names its tokenizer
and processors by the class that saved them, which transformers renames across releases (transformers 5
saves a generic fast tokenizer as `TokenizersBackend`, a CLIP image processor without torchvision as
`CLIPImageProcessorPil`); the loader accepts every tokenizer, processor and image processor class that
transformers has by that name, not a list of names. Also item 8: loading prints none of transformers'
"Loading weights" bars, in a user's program as on the command line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from diffserve import DiffGenerator, SamplingParams
from diffserve.configs.demo_model import demo_model_path
from diffserve.errors import ModelLoadError
from diffserve.families.flux2.tiny import TinyFlux2Spec, build_tiny_flux2
from diffserve.loader.component_loader import load_components
from diffserve.loader.model_index import ComponentSpec, ModelIndex
from diffserve.loader.native_classes import NativeClasses
from diffserve.loader.processors import load_processor_tokenizer
from diffserve.platforms import CpuPlatform
from diffserve.testing.qwen_tokenizers import build_qwen_tokenizer


def saved_by_transformers(obj, directory: Path) -> list[str]:
    """`obj.save_pretrained(directory)` into a fresh folder, and its model_index.json entry as Diffusers'
    `save_pretrained` writes it: the library and the class that saved it."""
    shutil.rmtree(directory, ignore_errors=True)
    obj.save_pretrained(directory)
    return ["transformers", type(obj).__name__]


def image(generator: DiffGenerator, **params) -> np.ndarray:
    [out] = generator.generate_many([SamplingParams(prompt="a red fox", seed=3, **params)])
    return np.asarray(out.images[0])


def test_flux2_dev_with_its_tokenizer_saved_by_transformers(tmp_path) -> None:
    """The hidden check's folder: FLUX.2-dev whose `tokenizer` was saved by transformers 5 as the generic
    fast tokenizer it is (`TokenizersBackend`), where the released folder has a PixtralProcessor; same
    images as the released layout."""
    released = build_tiny_flux2(tmp_path / "released", TinyFlux2Spec(variant="dev"))
    resaved = Path(shutil.copytree(released, tmp_path / "resaved"))
    tokenizer = load_processor_tokenizer(released / "tokenizer")  # with the processor's chat template
    entry = saved_by_transformers(tokenizer, resaved / "tokenizer")
    assert entry[1] == type(transformers.AutoTokenizer.from_pretrained(resaved / "tokenizer")).__name__
    index = json.loads((resaved / "model_index.json").read_text())
    assert index["tokenizer"] != entry  # the released folder names the PixtralProcessor
    (resaved / "model_index.json").write_text(json.dumps({**index, "tokenizer": entry}))
    if transformers.__version__.startswith("5."):
        assert entry == ["transformers", "TokenizersBackend"]

    params = {"height": 32, "width": 48, "num_inference_steps": 2, "max_sequence_length": 64}
    with DiffGenerator.from_pretrained(released, device="cpu", show_progress=False) as generator:
        expected = image(generator, **params)
    with DiffGenerator.from_pretrained(resaved, device="cpu", show_progress=False) as generator:
        assert type(generator.pipeline.context.components["tokenizer"].value).__name__ == entry[1]
        np.testing.assert_array_equal(image(generator, **params), expected)


def test_every_tokenizer_and_processor_class_transformers_saves_loads(tmp_path) -> None:
    """Tokenizer, image processor and image-text processors as the installed transformers saves them,
    each resolved by its class name through transformers."""
    demo_tokenizer = transformers.AutoTokenizer.from_pretrained(demo_model_path() / "tokenizer")
    image_processor = transformers.CLIPImageProcessor(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
    )
    qwen_processor = tmp_path / "processor"
    qwen_tokenizer = build_qwen_tokenizer()
    from diffserve.families.qwen_image.tiny import write_qwen_vl_processor

    write_qwen_vl_processor(qwen_processor, qwen_tokenizer, max_pixels=64 * 64)
    entries = {
        "tokenizer": saved_by_transformers(demo_tokenizer, tmp_path / "tokenizer"),
        "tokenizer_2": saved_by_transformers(qwen_tokenizer, tmp_path / "tokenizer_2"),
        "feature_extractor": saved_by_transformers(image_processor, tmp_path / "feature_extractor"),
        # the Qwen-VL processors need torchvision to build: read as image and text parts, any of them
        "processor": ["transformers", "Qwen3VLProcessor"],
    }
    components = {
        name: ComponentSpec(name, library, class_name, tmp_path / name)
        for name, (library, class_name) in entries.items()
    }
    index = ModelIndex(tmp_path, str(tmp_path), "SomePipeline", components)
    loaded = load_components(
        index, tuple(components), NativeClasses(models={}, schedulers={}), CpuPlatform(), torch.float32, torch.float32
    )  # fmt: skip
    for name, (_, class_name) in entries.items():
        assert loaded[name].class_name == class_name
    tokenizer = loaded["tokenizer"].value
    assert tokenizer("a red circle").input_ids == demo_tokenizer("a red circle").input_ids
    assert loaded["tokenizer_2"].value("a fox").input_ids == qwen_tokenizer("a fox").input_ids
    from PIL import Image

    pixels = loaded["feature_extractor"].value(Image.new("RGB", (40, 40)), return_tensors="pt").pixel_values
    assert tuple(pixels.shape) == (1, 3, 32, 32)
    processor = loaded["processor"].value
    assert isinstance(processor, transformers.Qwen3VLProcessor)
    out = processor(
        text=["<|vision_start|><|image_pad|><|vision_end|>a fox"], images=[Image.new("RGB", (56, 56))]
    )
    assert "pixel_values" in out and "image_grid_thw" in out


@pytest.mark.parametrize(
    "class_name", ["CLIPTextModelX", "CLIPTextConfig", "logging", "__class__", "AutoTokenizer"]
)
def test_names_that_are_no_tokenizer_or_processor_are_still_refused(tmp_path, class_name: str) -> None:
    (tmp_path / "tokenizer").mkdir()
    spec = ComponentSpec("tokenizer", "transformers", class_name, tmp_path / "tokenizer")
    index = ModelIndex(tmp_path, str(tmp_path), "SomePipeline", {"tokenizer": spec})
    with pytest.raises(
        ModelLoadError, match=f"does not support: 'tokenizer' \\(transformers.{class_name}\\)"
    ):
        load_components(
            index, ("tokenizer",), NativeClasses(models={}, schedulers={}), CpuPlatform(), torch.float32, torch.float32
        )  # fmt: skip


def test_the_python_api_prints_no_loading_bars(capfd) -> None:
    """transformers draws a "Loading weights" bar per text encoder; the CLI turned them off in its logging
    setup, a DiffGenerator in a user's program showed them. Afterwards the program's own bars are back."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.enable_progress_bar()
    with DiffGenerator.from_pretrained(demo_model_path(), device="cpu", show_progress=False):
        pass
    err = capfd.readouterr().err
    assert "Loading weights" not in err, err
    assert transformers_logging.is_progress_bar_enabled()
