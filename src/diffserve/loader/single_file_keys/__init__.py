"""Per-family key conversions of single-file DiT checkpoints (original names -> Diffusers' names).

`family_keys(dit_class)` gives a family's converter: `plan(shapes, model_keys)` builds the `KeyPlan`
of an original-layout file; `ignored` names original tensors no Diffusers module uses;
`gguf_arches` are the `general.architecture` strings city96's GGUF files of the family carry. Qwen-Image's
original checkpoints already use Diffusers' names, so its plan is the identity.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from diffserve.loader.single_file_keys import flux, sd3, wan, z_image
from diffserve.loader.single_file_keys.plan import KeyPlan, Piece, Shapes, identity_plan

PlanBuilder = Callable[[Shapes, frozenset[str]], KeyPlan]


@dataclass(frozen=True)
class FamilyKeys:
    """How one DiT family's single files are named (see the module docstring)."""

    family: str
    plan: PlanBuilder
    ignored: frozenset[str] = frozenset()
    gguf_arches: tuple[str, ...] = ()


def _identity(shapes: Shapes, model_keys: frozenset[str]) -> KeyPlan:
    del model_keys
    return identity_plan(shapes)


_FAMILIES: dict[str, FamilyKeys] = {
    "FluxTransformer2DModel": FamilyKeys("FLUX.1", flux.flux_plan, gguf_arches=("flux",)),
    "SD3Transformer2DModel": FamilyKeys("SD3", sd3.sd3_plan, gguf_arches=("sd3",)),
    "WanTransformer3DModel": FamilyKeys("Wan", wan.wan_plan, gguf_arches=("wan",)),
    "ZImageTransformer2DModel": FamilyKeys("Z-Image", z_image.z_image_plan, z_image.UNUSED, ("lumina2",)),
    "QwenImageTransformer2DModel": FamilyKeys("Qwen-Image", _identity, gguf_arches=("qwen_image",)),
}

#: Name fragments by which a file of each family is recognised, in original or Diffusers names (to
#: tell a user which family a mismatching file looks like).
_MARKERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("FLUX.1", ("double_blocks.", "single_transformer_blocks.")),
    ("SD3", ("joint_blocks.", "pos_embed.pos_embed")),
    ("Wan", ("head.head.", "text_embedding.", "condition_embedder.", "patch_embedding.")),
    ("Z-Image", ("noise_refiner.", "cap_embedder.")),
    ("Qwen-Image", ("img_mod.1.", "txt_norm.")),
)


def supported_dit_classes() -> tuple[str, ...]:
    """The DiT classes whose single files can be loaded."""
    return tuple(_FAMILIES)


def family_keys(dit_class: str) -> FamilyKeys | None:
    """The key conversion of `dit_class`'s single files (None: the class has none)."""
    return _FAMILIES.get(dit_class)


def guess_family(names: frozenset[str] | set[str]) -> str | None:
    """Which family a file with tensor `names` looks like, from its names alone (None: unknown)."""
    for family, markers in _MARKERS:
        if any(marker in name for name in names for marker in markers):
            return family
    return None


__all__ = ["FamilyKeys", "KeyPlan", "Piece", "Shapes", "family_keys", "guess_family", "supported_dit_classes"]
