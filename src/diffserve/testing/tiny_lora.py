"""Random LoRA files for a model folder's DiT, in the diffusers/PEFT layout that `save_lora_weights`
writes (keys `transformer.<module>.lora_A.weight` / `.lora_B.weight`, alpha and rank in the
`lora_adapter_metadata` JSON), for tests and benchmarks: no hub, any family, any rank."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from diffserve.errors import UserError
from diffserve.loader.model_index import read_json, read_model_index
from diffserve.models.dits.chroma import ChromaTransformer2DModel
from diffserve.models.dits.cogvideox import CogVideoXTransformer3DModel
from diffserve.models.dits.flux import FluxTransformer2DModel
from diffserve.models.dits.hidream_image import HiDreamImageTransformer2DModel
from diffserve.models.dits.hunyuan_image import HunyuanImageTransformer2DModel
from diffserve.models.dits.hunyuan_video import HunyuanVideoTransformer3DModel
from diffserve.models.dits.mochi import MochiTransformer3DModel
from diffserve.models.dits.qwen_image import QwenImageTransformer2DModel
from diffserve.models.dits.qwen_image21 import QwenImage21Transformer2DModel
from diffserve.models.dits.sd3 import SD3Transformer2DModel
from diffserve.models.dits.skyreels_v2 import SkyReelsV2Transformer3DModel
from diffserve.models.dits.wan import WanTransformer3DModel
from diffserve.models.dits.z_image import ZImageTransformer2DModel

#: The native DiT of each Diffusers transformer class (what `native_classes` of the registry holds; named
#: here, not read from the registry, which imports the families that import `testing`).
DIT_CLASSES: dict[str, type[nn.Module]] = {
    cls.diffusers_class_name: cls
    for cls in (
        FluxTransformer2DModel, SD3Transformer2DModel, QwenImageTransformer2DModel, ZImageTransformer2DModel,
        WanTransformer3DModel, ChromaTransformer2DModel, SkyReelsV2Transformer3DModel,
        HunyuanVideoTransformer3DModel, HiDreamImageTransformer2DModel, HunyuanImageTransformer2DModel,
        QwenImage21Transformer2DModel, CogVideoXTransformer3DModel, MochiTransformer3DModel,
    )
}  # fmt: skip


def dit_class(class_name: str) -> type[nn.Module]:
    """The native DiT of Diffusers transformer class `class_name` (a LoRA can be written for any of
    `DIT_CLASSES`, also to check that a DiT without LoRA support refuses it)."""
    if class_name not in DIT_CLASSES:
        raise UserError(f"{class_name}: random LoRA files are written for {', '.join(sorted(DIT_CLASSES))}")
    return DIT_CLASSES[class_name]


#: Module paths a typical LoRA trains: every Linear inside the repeated blocks (attention, MLP, adaLN).
BLOCK_LINEARS = re.compile(
    r"(^|\.)(transformer_blocks|single_transformer_blocks|blocks|layers|noise_refiner|context_refiner)\.\d+\."
)


def dit_linears(model_path: str | Path) -> dict[str, tuple[int, int]]:
    """The (out_features, in_features) of every Linear of the folder's DiT, by Diffusers module path
    (built on the meta device from its config.json: nothing is read but the config)."""
    index = read_model_index(str(model_path))
    spec = index.components["transformer"]
    cls = dit_class(spec.class_name)
    with torch.device("meta"):
        model = cls.from_config(read_json(spec.path / "config.json"))
    return {
        name: (module.out_features, module.in_features)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
    }


def write_random_lora(
    model_path: str | Path,
    out_file: str | Path,
    rank: int = 4,
    alpha: float | None = None,
    seed: int = 0,
    std: float = 0.05,
    pattern: re.Pattern[str] = BLOCK_LINEARS,
    every: int = 1,
) -> Path:
    """Write a random rank-`rank` LoRA on the DiT's Linears matching `pattern` (every `every`-th of them)
    to `out_file`; `alpha` None stores no alpha (diffusers then takes alpha = rank). Unlike a freshly
    initialised LoRA both matrices are random, so the adapter visibly changes the output."""
    g = torch.Generator().manual_seed(seed)
    targets = [name for name in dit_linears(model_path) if pattern.search(name)][::every]
    shapes = dit_linears(model_path)
    tensors = {}
    for name in targets:
        out_features, in_features = shapes[name]
        tensors[f"transformer.{name}.lora_A.weight"] = torch.randn(rank, in_features, generator=g) * std
        tensors[f"transformer.{name}.lora_B.weight"] = torch.randn(out_features, rank, generator=g) * std
    metadata = {"format": "pt"}
    if alpha is not None:
        config = {
            "transformer.r": rank,
            "transformer.lora_alpha": alpha,
            "transformer.target_modules": targets,
        }
        metadata["lora_adapter_metadata"] = json.dumps(config, sort_keys=True)
    out = Path(out_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata=metadata)
    return out
