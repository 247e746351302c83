"""Loading the engine's ControlNets: named models requests choose, like LoRA adapters (`--controlnet
NAME=PATH`, and a `<Base>ControlNetPipeline` folder's own `controlnet` component as "default").

Each is a Diffusers model folder (config.json and safetensors) of a class the pipeline declares
(`Pipeline.controlnet_classes`), or a single `.safetensors` file in a layout the pipeline lists
(`Pipeline.controlnet_file_layouts`: XLabs' original FLUX.1 files, `loader/controlnet_single_file.py`),
loaded natively onto the DiT's device in its dtype and handed to the pipeline (`use_controlnets`). A
family without ControlNet support refuses them, naming itself and the option; one without single-file
layouts refuses a file, naming itself.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from diffserve.configs.engine_args import ControlNetSpec
from diffserve.errors import ModelLoadError, UserError
from diffserve.loader.component_loader import load_native_model
from diffserve.loader.controlnet_single_file import load_controlnet_file
from diffserve.loader.model_index import ComponentSpec, ModelIndex, read_json
from diffserve.platforms import Platform

logger = logging.getLogger(__name__)

#: A Diffusers pipeline class named `<Base>ControlNetPipeline` is `<Base>Pipeline` plus a `controlnet`; so
#: are the ControlNet inpainting pipelines' (`<Base>ControlNetInpaintingPipeline`, `...InpaintPipeline`),
#: whose inpainting is the ControlNet's (a request's entry with a `mask`).
_CONTROLNET_SUFFIXES = ("ControlNetPipeline", "ControlNetInpaintingPipeline", "ControlNetInpaintPipeline")
#: The name a pipeline folder's own ControlNet is served under.
FOLDER_CONTROLNET = "default"


def without_folder_controlnet(index: ModelIndex) -> tuple[ModelIndex, ComponentSpec | None]:
    """A `<Base>ControlNet[Inpaint[ing]]Pipeline` folder's index as its base pipeline's (the `controlnet` component taken
    out, to load as a named ControlNet), and that component; other folders unchanged, None."""
    name = index.pipeline_class_name
    component = index.components.get("controlnet")
    suffix = next((suffix for suffix in _CONTROLNET_SUFFIXES if name.endswith(suffix)), None)
    if suffix is None or component is None:
        return index, None
    base = name.removesuffix(suffix) + "Pipeline"
    components = {name: spec for name, spec in index.components.items() if name != "controlnet"}
    return replace(index, pipeline_class_name=base, components=components), component


def load_controlnets(
    specs: list[ControlNetSpec],
    folder_component: ComponentSpec | None,
    pipeline: Any,
    family_name: str,
    platform: Platform,
    dtype: torch.dtype,
) -> dict[str, nn.Module]:
    """Load `specs` (and the folder's own ControlNet as "default") and hand them to `pipeline`; {} when
    there are none. A pipeline without `use_controlnets` refuses them (UserError naming the family)."""
    wanted = [(spec.name, Path(spec.path).expanduser()) for spec in specs]
    if folder_component is not None:
        if any(name == FOLDER_CONTROLNET for name, _ in wanted):
            raise UserError(
                f"--controlnet: the name {FOLDER_CONTROLNET!r} is the model folder's own ControlNet's; choose "
                "another NAME"
            )
        wanted.insert(0, (FOLDER_CONTROLNET, folder_component.path))
    if not wanted:
        return {}
    classes: dict[str, Any] = getattr(pipeline, "controlnet_classes", {})
    if not classes:
        raise UserError(
            f"--controlnet: the {family_name} family ({type(pipeline).__name__}) takes no ControlNets (the "
            "README's ControlNet section lists the families that do)"
        )
    nets = {}
    for name, path in wanted:
        if path.is_file():  # a single-file checkpoint: its layout says its class and config
            nets[name] = load_controlnet_file(name, path, pipeline, family_name, platform, dtype)
            continue
        config = read_json(path / "config.json")
        class_name = config.get("_class_name")
        cls = classes.get(class_name)
        if cls is None:
            raise UserError(
                f"--controlnet {name}={path}: a {class_name or 'model without _class_name'}; the {family_name} "
                f"family takes {', '.join(sorted(classes))}"
            )
        spec = ComponentSpec(name=f"controlnet {name}", library="diffusers", class_name=class_name, path=path)
        try:
            nets[name] = load_native_model(spec, cls, platform, dtype)[0]
        except (ValueError, KeyError, RuntimeError) as exc:
            raise ModelLoadError(f"cannot load ControlNet {name!r} from {path}: {exc}") from exc
        logger.info("ControlNet %r loaded from %s (%s)", name, path, class_name)
    pipeline.use_controlnets(nets)
    return nets
