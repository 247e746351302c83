"""Reading a Diffusers model folder's `model_index.json` (and its other JSON files)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diffserve.errors import ModelLoadError
from diffserve.loader.hub import resolve_model_path

#: Libraries model_index.json names that are packages of their own; any other library name is a Diffusers
#: pipeline package (`diffusers.pipelines.X`) whose own classes it names by the package.
PACKAGE_LIBRARIES = frozenset({"diffusers", "transformers"})


@dataclass(frozen=True)
class ComponentSpec:
    """One entry of model_index.json: `"vae": ["diffusers", "AutoencoderKL"]`."""

    name: str
    library: str
    class_name: str
    path: Path


@dataclass(frozen=True)
class ModelIndex:
    #: The local folder the components load from (for a Hub repo id: its snapshot in the HF cache).
    root: Path
    #: The model as the user named it, for display and output metadata: the repo id of a Hub model,
    #: else the folder (`root`).
    name: str
    pipeline_class_name: str
    components: dict[str, ComponentSpec]
    #: Pipeline-level settings that are not components (e.g. Wan's "boundary_ratio", "expand_timesteps").
    options: dict[str, Any] = field(default_factory=dict)


def read_json(path: Path) -> Any:
    """The parsed JSON file; a missing or malformed file is a `ModelLoadError` naming it."""
    if not path.is_file():
        raise ModelLoadError(f"missing {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc


def read_model_index(model_path: str | Path, revision: str | None = None) -> ModelIndex:
    """Parse `model_index.json` of a Diffusers folder or of a Hugging Face repo id's snapshot (cached, or
    downloaded: see `loader.hub`); components set to null (optional, absent) are left out."""
    root = resolve_model_path(model_path, revision)
    from_hub = root != Path(model_path).expanduser()  # resolve_model_path returns a local path unchanged
    display = str(model_path) if from_hub else str(root)
    where = f"Hugging Face repo {display!r} (snapshot {root})" if from_hub else repr(display)
    if not root.is_dir():
        raise ModelLoadError(f"model path {where} is not a directory")
    index_file = root / "model_index.json"
    if not index_file.is_file():
        raise ModelLoadError(
            f"{where} is not a Diffusers model folder: it has no model_index.json "
            "(expected the layout written by diffusers' save_pretrained)"
        )
    raw = read_json(index_file)
    if not isinstance(raw, dict) or "_class_name" not in raw:
        raise ModelLoadError(f"{index_file} has no _class_name naming the pipeline")
    components = {}
    options = {}
    for name, value in raw.items():
        if name.startswith("_"):
            continue
        if not (isinstance(value, list) and len(value) == 2):
            options[name] = value  # pipeline-level options such as "requires_safety_checker"
        elif None not in value:
            library, class_name = value
            # A class defined in a Diffusers pipeline's own package is a Diffusers component (written as
            # [<pipeline package>, <class>]); the family's native classes decide whether it is served.
            if library not in PACKAGE_LIBRARIES and str(library).isidentifier():
                library = "diffusers"
            components[name] = ComponentSpec(name, str(library), str(class_name), root / name)
    return ModelIndex(
        root=root,
        name=display,
        pipeline_class_name=str(raw["_class_name"]),
        components=components,
        options=options,
    )
