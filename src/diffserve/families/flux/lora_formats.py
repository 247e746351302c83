"""FLUX community LoRA files converted to `ConvertedLora`, following Diffusers'
`FluxLoraLoaderMixin.lora_state_dict` (module mapping, fused-projection splits, alpha handling).

Formats, recognised in Diffusers' order:
- `flux-kohya`: kohya sd-scripts `lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight` (+ `.alpha`),
  CLIP `lora_te1_…`, and ComfyUI's dotted `diffusion_model.…lora_down.weight` form of it;
- `flux-kohya-diffusers-names`: kohya-style keys over Diffusers module names,
  `lora_transformer_transformer_blocks_0_attn_to_q.lora_down.weight` (ai-toolkit, OneTrainer);
- `flux-diffusers-lora-down`: Diffusers paths with kohya's `lora_down`/`lora_up` names;
- `flux-xlabs`: XLabs `double_blocks.0.processor.qkv_lora1.down.weight`;
- `flux-bfl` / `flux-bfl-control`: BFL module names with PEFT's `lora_A`/`lora_B`, bare, under
  `diffusion_model.` or under fal's `base_model.model.`; Control LoRAs add full norm scales and biases.
Plain Diffusers/PEFT files (`transformer.….lora_A.weight`, ai-toolkit's usual output) give None: the
generic converter reads them.

Where Diffusers' result is not a LoRA pair on a Linear (a Control LoRA's norm scales, biases and its
widened `x_embedder`, DoRA scales, `diff` weights, T5 `lora_te2_` / `t5xxl` modules, names of no FLUX
Linear), the keys go to `unsupported`; such a module whose effect is exactly zero (an all-zero factor or
diff, which Diffusers discards) is dropped instead. Alphas stay in `LoraWeights.alpha` (Diffusers folds
kohya's into the factors: same delta). A single block's `linear1` splits into q, k, v as wide as its
input and the MLP rest (Diffusers fixes FLUX.1's 3 x 3072 + 12288, the same there).

Where Diffusers falls short, the natural reading is taken instead: kohya's modules outside the blocks
(`img_in`, `txt_in`, `time_in`, `vector_in`, `guidance_in`, `final_layer`) get their `transformer.`
prefix (Diffusers returns them without it, so its loader skips them) and `final_layer` keeps its alpha;
a `final_layer.adaLN_modulation.1` swaps only its up rows (Diffusers' BFL control converter also
permutes the down rows, which breaks the product); BFL pairs under `diffusion_model.` (which Diffusers
leaves unconverted) and their `.alpha` are read like fal's; `lora_unet_` over Diffusers module names
(which Diffusers refuses) is read like `lora_transformer_`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from diffserve.errors import LoraError
from diffserve.loader.bfl_names import (
    BFL_ROOTS,
    FluxTarget,
    Split,
    bfl_target,
    clip_path,
    diffusers_underscored_target,
    kohya_target,
    xlabs_target,
)
from diffserve.loader.lora_weights import ConvertedLora, LoraWeights

_TRANSFORMER = "transformer"
_TEXT_ENCODER = "text_encoder"

# Key suffixes (after the module name and a dot) per layout; the first pair names down / up.
_KOHYA_KINDS = ("lora_down.weight", "lora_up.weight", "alpha", "dora_scale", "diff_b", "diff")
_XLABS_KINDS = ("down.weight", "up.weight")
_BFL_KINDS = (
    "lora_A.weight",
    "lora_B.weight",
    "lora_A.bias",
    "lora_B.bias",
    "alpha",
    "dora_scale",
    "diff_b",
    "diff",
    "scale",
)
_BFL_PREFIXES = ("diffusion_model.", "base_model.model.")
_COMFY_PREFIXES = (("diffusion_model.", "lora_unet_"), ("text_encoders.clip_l.transformer.", "lora_te_"))

_Group = dict[str, dict[str, str]]  # module name -> {kind: original key}


def convert_flux_lora(state_dict: Mapping[str, torch.Tensor]) -> ConvertedLora | None:
    """Convert a FLUX community-format LoRA state dict; None when it is plain Diffusers/PEFT layout.

    Raises `LoraError` for a malformed file (a down factor without its up, mismatched ranks, a
    non-scalar alpha, two file modules landing on one target)."""
    keys = list(state_dict)
    if any(".lora_down.weight" in k for k in keys):
        if any(k.startswith(f"{_TRANSFORMER}.") for k in keys):
            return _convert_diffusers_lora_down(state_dict)
        return _convert_kohya(state_dict)
    if any("processor" in k for k in keys):
        return _convert_xlabs(state_dict)
    if any(_strip_bfl_prefix(k).startswith(BFL_ROOTS) for k in keys):
        return _convert_bfl(state_dict)
    return None


# ---------------------------------------------------------------------------------------------- formats


def _convert_kohya(state_dict: Mapping[str, torch.Tensor]) -> ConvertedLora:
    """kohya / ComfyUI keys: `lora_unet_` over BFL names, `lora_transformer_` over Diffusers names,
    `lora_te_` / `lora_te1_` over the CLIP text encoder's."""
    diffusers_names = any(
        k.startswith("lora_transformer_") and ("lora_down" in k or "lora_up" in k or "alpha" in k)
        for k in state_dict
    )
    groups, loose = _group(state_dict, _KOHYA_KINDS, _kohya_module_name)

    def resolve(module: str) -> tuple[str, FluxTarget] | None:
        if module.startswith("lora_unet_"):
            # Diffusers drops a `lora_transformer_` file's `lora_unet_` keys: they map to nothing here.
            if diffusers_names:
                return None
            name = module.removeprefix("lora_unet_")
            target = kohya_target(name) or diffusers_underscored_target(name)
            return None if target is None else (_TRANSFORMER, target)
        if module.startswith("lora_transformer_"):
            target = diffusers_underscored_target(module.removeprefix("lora_transformer_"))
            return None if target is None else (_TRANSFORMER, target)
        for prefix in ("lora_te_", "lora_te1_"):
            if module.startswith(prefix):
                path = clip_path(module.removeprefix(prefix))
                return None if path is None else (_TEXT_ENCODER, FluxTarget((path,)))
        return None

    fmt = "flux-kohya-diffusers-names" if diffusers_names else "flux-kohya"
    return _convert_pairs(state_dict, groups, loose, resolve, fmt, use_alpha=True)


def _convert_diffusers_lora_down(state_dict: Mapping[str, torch.Tensor]) -> ConvertedLora:
    """Diffusers paths under `transformer.` with kohya's factor names. Diffusers keeps only these keys
    and applies no alpha: an alpha other than the rank is listed as unsupported, keys outside
    `transformer.` too."""
    groups, loose = _group(state_dict, _KOHYA_KINDS, lambda module: module)
    outside = [m for m in groups if not m.startswith(f"{_TRANSFORMER}.")]
    for module in outside:
        loose.extend(groups.pop(module).values())
    for kinds in groups.values():
        alpha_key, down_key = kinds.get("alpha"), kinds.get("lora_down.weight")
        if (
            alpha_key is not None
            and down_key is not None
            and _scalar(state_dict, alpha_key) != state_dict[down_key].shape[0]
        ):
            loose.append(kinds.pop("alpha"))

    def resolve(module: str) -> tuple[str, FluxTarget] | None:
        component, path = module.split(".", 1)
        return component, FluxTarget((path,))

    return _convert_pairs(state_dict, groups, loose, resolve, "flux-diffusers-lora-down", use_alpha=False)


def _convert_xlabs(state_dict: Mapping[str, torch.Tensor]) -> ConvertedLora:
    """XLabs attention-processor LoRAs, optionally under `diffusion_model.`; they carry no alpha."""
    groups, loose = _group(state_dict, _XLABS_KINDS, lambda m: m.removeprefix("diffusion_model."))

    def resolve(module: str) -> tuple[str, FluxTarget] | None:
        target = xlabs_target(module)
        return None if target is None else (_TRANSFORMER, target)

    return _convert_pairs(
        state_dict, groups, loose, resolve, "flux-xlabs", use_alpha=False, pair=_XLABS_KINDS
    )


def _convert_bfl(state_dict: Mapping[str, torch.Tensor]) -> ConvertedLora:
    """BFL module names with `lora_A` / `lora_B`. A Control LoRA (norm scales or factor biases present)
    also changes `x_embedder`'s input width: its norm scales, biases and `img_in` pair are unsupported."""
    groups, loose = _group(state_dict, _BFL_KINDS, _strip_bfl_prefix)
    control = any(
        "scale" in kinds or "lora_A.bias" in kinds or "lora_B.bias" in kinds for kinds in groups.values()
    )
    for module, kinds in list(groups.items()):
        for kind in ("scale", "lora_A.bias", "lora_B.bias"):
            if kind in kinds:
                loose.append(kinds.pop(kind))
        if control and module == "img_in":
            loose.extend(kinds.values())
            kinds.clear()
        if not kinds:
            del groups[module]

    def resolve(module: str) -> tuple[str, FluxTarget] | None:
        target = bfl_target(module)
        return None if target is None else (_TRANSFORMER, target)

    fmt = "flux-bfl-control" if control else "flux-bfl"
    return _convert_pairs(state_dict, groups, loose, resolve, fmt, use_alpha=True, pair=_BFL_KINDS[:2])


# ---------------------------------------------------------------------------------------------- helpers


def _strip_bfl_prefix(name: str) -> str:
    for prefix in _BFL_PREFIXES:
        if name.startswith(prefix):
            return name.removeprefix(prefix)
    return name


def _kohya_module_name(module: str) -> str:
    """ComfyUI's dotted module names in kohya's underscored form (`diffusion_model.double_blocks.0.x`
    -> `lora_unet_double_blocks_0_x`), as Diffusers rewrites them."""
    for prefix, kohya_prefix in _COMFY_PREFIXES:
        if module.startswith(prefix):
            module = kohya_prefix + module.removeprefix(prefix)
            break
    return module.replace(".", "_")


def _group(
    state_dict: Mapping[str, torch.Tensor], kinds: tuple[str, ...], rename: Callable[[str], str]
) -> tuple[_Group, list[str]]:
    """Keys grouped by module (renamed by `rename`) and suffix kind; keys of no known kind are loose."""
    groups: _Group = {}
    loose: list[str] = []
    for key in state_dict:
        kind = next((k for k in kinds if key.endswith(f".{k}")), None)
        if kind is None:
            loose.append(key)
            continue
        module = rename(key[: -len(kind) - 1])
        entry = groups.setdefault(module, {})
        if kind in entry:
            raise LoraError(f"LoRA keys {entry[kind]!r} and {key!r} both name {module!r} {kind}")
        entry[kind] = key
    return groups, loose


def _scalar(state_dict: Mapping[str, torch.Tensor], key: str) -> float:
    value = state_dict[key]
    if value.numel() != 1:
        raise LoraError(f"LoRA alpha {key!r} must be a scalar, got shape {tuple(value.shape)}")
    return float(value.reshape(()).item())


def _is_zero(tensor: torch.Tensor) -> bool:
    return not bool(torch.any(tensor != 0))


def _inert(state_dict: Mapping[str, torch.Tensor], kinds: dict[str, str], pair: tuple[str, str]) -> bool:
    """Whether a module that maps to nothing changes nothing: a zero factor, or only zero diffs."""
    if "dora_scale" in kinds:
        return False
    down, up = kinds.get(pair[0]), kinds.get(pair[1])
    if down is not None and up is not None:
        return _is_zero(state_dict[down]) or _is_zero(state_dict[up])
    diffs = [kinds[k] for k in ("diff", "diff_b") if k in kinds]
    return bool(diffs) and all(_is_zero(state_dict[k]) for k in diffs)


def _convert_pairs(
    state_dict: Mapping[str, torch.Tensor],
    groups: _Group,
    loose: list[str],
    resolve: Callable[[str], tuple[str, FluxTarget] | None],
    fmt: str,
    use_alpha: bool,
    pair: tuple[str, str] = _KOHYA_KINDS[:2],
) -> ConvertedLora:
    """Each group with a down/up pair and a resolvable name becomes its Diffusers target(s); the rest
    of the keys are unsupported unless inert."""
    down_kind, up_kind = pair
    unsupported = list(loose)
    targets: dict[str, LoraWeights] = {}
    sources: dict[str, str] = {}
    for module, kinds in groups.items():
        resolved = resolve(module)
        has_pair = down_kind in kinds or up_kind in kinds
        if resolved is None or not has_pair:
            if not _inert(state_dict, kinds, pair):
                unsupported.extend(kinds.values())
            continue
        if down_kind not in kinds or up_kind not in kinds:
            present = kinds.get(down_kind) or kinds[up_kind]
            raise LoraError(
                f"LoRA key {present!r} has no matching {down_kind if down_kind not in kinds else up_kind}"
            )
        unsupported.extend(
            key
            for kind, key in kinds.items()
            if kind not in (down_kind, up_kind, "alpha")
            and not (kind in ("diff", "diff_b") and _is_zero(state_dict[key]))
        )
        down, up = state_dict[kinds[down_kind]], state_dict[kinds[up_kind]]
        alpha = _scalar(state_dict, kinds["alpha"]) if use_alpha and "alpha" in kinds else None
        component, target = resolved
        for path, weights in _split(kinds[down_kind], down, up, alpha, target):
            full = f"{component}.{path}"
            if full in targets:
                raise LoraError(
                    f"LoRA modules {sources[full]!r} and {kinds[down_kind]!r} both target {full!r}"
                )
            targets[full] = weights
            sources[full] = kinds[down_kind]
    return ConvertedLora(targets=targets, format=fmt, unsupported=tuple(sorted(unsupported)))


def _split(
    key: str, down: torch.Tensor, up: torch.Tensor, alpha: float | None, target: FluxTarget
) -> list[tuple[str, LoraWeights]]:
    """One file pair as pairs on the Diffusers modules of `target`: the up rows divided among them
    (sharing the down factor, or, when the up factor is block-diagonal over the rank, each taking its
    own rank slice with alpha divided alike), after swapping the halves of a (shift, scale) output."""
    if down.dim() != 2 or up.dim() != 2 or down.shape[0] != up.shape[1]:
        raise LoraError(
            f"LoRA module {key!r} needs down (rank, in) and up (out, rank), got down "
            f"{tuple(down.shape)} and up {tuple(up.shape)}"
        )
    out_features, rank = up.shape
    if target.swap_halves:
        if out_features % 2:
            raise LoraError(f"LoRA module {key!r} has odd output width {out_features}: no (shift, scale)")
        shift, scale = up.chunk(2, dim=0)
        up = torch.cat([scale, shift], dim=0)
    if target.split is Split.NONE:
        return [(target.paths[0], LoraWeights(down, up, alpha))]
    dims = _split_dims(key, out_features, down.shape[1], target)
    parts = len(dims)
    if rank % parts == 0 and _block_diagonal(up, dims, rank // parts):
        sub = rank // parts
        sub_alpha = None if alpha is None else alpha / parts
        rows = torch.split(up, dims, dim=0)
        return [
            (path, LoraWeights(down[j * sub : (j + 1) * sub], rows[j][:, j * sub : (j + 1) * sub], sub_alpha))
            for j, path in enumerate(target.paths)
        ]
    return [
        (path, LoraWeights(down, rows, alpha))
        for path, rows in zip(target.paths, torch.split(up, dims, dim=0), strict=True)
    ]


def _split_dims(key: str, out_features: int, in_features: int, target: FluxTarget) -> list[int]:
    parts = len(target.paths)
    if target.split is Split.EQUAL:
        if out_features % parts:
            raise LoraError(
                f"LoRA module {key!r}: output width {out_features} does not split into {parts} equal parts"
            )
        return [out_features // parts] * parts
    # ATTN_MLP: q, k, v each as wide as the block's hidden size (the input width), the MLP the rest.
    mlp = out_features - 3 * in_features
    if mlp <= 0:
        raise LoraError(
            f"LoRA module {key!r}: output width {out_features} leaves no MLP part after q, k, v of {in_features}"
        )
    return [in_features, in_features, in_features, mlp]


def _block_diagonal(up: torch.Tensor, dims: list[int], sub: int) -> bool:
    """Whether each row block of `up` is zero outside its own `sub`-wide rank slice."""
    start = 0
    for j, rows in enumerate(dims):
        block = up[start : start + rows]
        if torch.any(block[:, : j * sub] != 0) or torch.any(block[:, (j + 1) * sub :] != 0):
            return False
        start += rows
    return True
