"""The `Qwen2VLProcessor` folder of tiny checkpoints whose pipelines name one (Qwen-Image's edit pipelines'
`processor/`, LongCat-Image's `text_processor/`), written and read without torchvision."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import Qwen2VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil


def write_qwen_vl_processor(directory: Path, tokenizer, max_pixels: int, min_pixels: int = 56 * 56) -> None:
    """Write a `Qwen2VLProcessor` folder in the released checkpoints' layout, without needing torchvision.

    Constructing a `Qwen2VLProcessor` needs its video processor, which transformers only provides with
    torchvision installed; the files are written directly instead (tokenizer files, the image
    processor's `preprocessor_config.json`, a `video_preprocessor_config.json`), as the released
    checkpoints' processor folders have them.
    """
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(directory)
    image_processor = Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels)
    image_processor.save_pretrained(directory)
    config_path = directory / "preprocessor_config.json"
    config = json.loads(config_path.read_text())
    config.update({"processor_class": "Qwen2VLProcessor", "min_pixels": min_pixels, "max_pixels": max_pixels})
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    video = {
        k: config[k]
        for k in (
            "do_convert_rgb",
            "do_normalize",
            "do_rescale",
            "do_resize",
            "image_mean",
            "image_std",
            "merge_size",
            "patch_size",
            "resample",
            "rescale_factor",
            "size",
            "temporal_patch_size",
            "min_pixels",
            "max_pixels",
        )
    }
    video.update({"video_processor_type": "Qwen2VLVideoProcessor", "processor_class": "Qwen2VLProcessor"})
    (directory / "video_preprocessor_config.json").write_text(
        json.dumps(video, indent=2, sort_keys=True) + "\n"
    )


def load_qwen_vl_processor(directory: str | Path) -> Qwen2VLProcessor:
    """Load a processor folder image-only, as diffserve's loader does (no torchvision needed); pass it
    as `processor=` to Diffusers' `QwenImageEdit*Pipeline.from_pretrained`, which would otherwise
    try to build the video half too."""
    from diffserve.loader.processors import load_image_text_processor

    return load_image_text_processor("Qwen2VLProcessor", directory)
