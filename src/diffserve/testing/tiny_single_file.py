"""Writers of single-file DiT checkpoints for the tests of `--transformer-weights`, from a tiny folder.

- `original_state_dict(dit_class, state)`: a Diffusers-named DiT state dict in the family's original
  names, the inverse of what Diffusers' single-file converters do (BFL FLUX, SD3 MMDiT, Wan, Z-Image;
  Qwen-Image's originals are Diffusers' names). Written from the converters' documented mapping, not
  from diffserve's loader, so the tests check one against the other.
- `fp8_state_dict(state, layout)`: pre-quantized FP8 as ComfyUI / Kijai publish it ("plain" casts,
  legacy "scaled" with `scale_weight` and the `scaled_fp8` marker, "comfy_quant" with `weight_scale`).
- `write_gguf(path, state, qtype, arch)`: a GGUF file in city96's layout: tensor names as given
  (original names for the published files), `general.architecture`, 1-D and small tensors in F32,
  FLUX's embedders and final layer in F32 / F16 as city96's llama.cpp patch keeps them, rows that do not
  divide into the type's blocks in F16. gguf-py quantizes F16, BF16, Q8_0, Q5_0/Q5_1, Q4_0/Q4_1; it cannot
  quantize K-quants, so Q4_K and Q5_K are quantized here (`quantize_k`, ggml's block layout, a simple
  min/max fit rather than llama.cpp's iterative search).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch

State = Mapping[str, torch.Tensor]

# --------------------------------------------------------------------------- original names


def original_state_dict(dit_class: str, state: State) -> dict[str, torch.Tensor]:
    """`state` (Diffusers names) in `dit_class`'s original single-file names. Every tensor is used
    exactly once (else ValueError: the inverse would be incomplete)."""
    inverse = _INVERSES[dit_class]
    used: set[str] = set()
    out = inverse(_Tracking(state, used))
    left = sorted(set(state) - used)
    if left:
        raise ValueError(f"no original name for: {', '.join(left)}")
    return out


class _Tracking(dict):
    """The Diffusers state dict, recording which names the inverse reads."""

    def __init__(self, state: State, used: set[str]) -> None:
        super().__init__(state)
        self.used = used

    def __getitem__(self, key: str) -> torch.Tensor:
        self.used.add(key)
        return super().__getitem__(key)


def _swap(t: torch.Tensor) -> torch.Tensor:
    first, second = t.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def _module(out: dict, sd: dict, original: str, diffusers: str, swap: bool = False) -> None:
    for param in ("weight", "bias"):
        if f"{diffusers}.{param}" in sd:
            value = sd[f"{diffusers}.{param}"]
            out[f"{original}.{param}"] = _swap(value) if swap else value


def _fused(out: dict, sd: dict, original: str, parts: list[str]) -> None:
    for param in ("weight", "bias"):
        if f"{parts[0]}.{param}" in sd:
            out[f"{original}.{param}"] = torch.cat([sd[f"{p}.{param}"] for p in parts], dim=0)


def _indices(sd: dict, prefix: str) -> list[int]:
    return sorted({int(k[len(prefix) :].split(".")[0]) for k in sd if k.startswith(prefix)})


def _flux(sd: dict) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for original, diffusers in (
        ("img_in", "x_embedder"),
        ("txt_in", "context_embedder"),
        ("time_in.in_layer", "time_text_embed.timestep_embedder.linear_1"),
        ("time_in.out_layer", "time_text_embed.timestep_embedder.linear_2"),
        ("vector_in.in_layer", "time_text_embed.text_embedder.linear_1"),
        ("vector_in.out_layer", "time_text_embed.text_embedder.linear_2"),
        ("guidance_in.in_layer", "time_text_embed.guidance_embedder.linear_1"),
        ("guidance_in.out_layer", "time_text_embed.guidance_embedder.linear_2"),
        ("final_layer.linear", "proj_out"),
    ):
        _module(out, sd, original, diffusers)
    _module(out, sd, "final_layer.adaLN_modulation.1", "norm_out.linear", swap=True)
    for i in _indices(sd, "transformer_blocks."):
        o, d = f"double_blocks.{i}.", f"transformer_blocks.{i}."
        for original, diffusers in (
            ("img_mod.lin", "norm1.linear"),
            ("txt_mod.lin", "norm1_context.linear"),
            ("img_attn.proj", "attn.to_out.0"),
            ("txt_attn.proj", "attn.to_add_out"),
            ("img_mlp.0", "ff.net.0.proj"),
            ("img_mlp.2", "ff.net.2"),
            ("txt_mlp.0", "ff_context.net.0.proj"),
            ("txt_mlp.2", "ff_context.net.2"),
        ):
            _module(out, sd, o + original, d + diffusers)
        _fused(out, sd, o + "img_attn.qkv", [d + "attn.to_q", d + "attn.to_k", d + "attn.to_v"])
        _fused(
            out, sd, o + "txt_attn.qkv", [d + "attn.add_q_proj", d + "attn.add_k_proj", d + "attn.add_v_proj"]
        )
        for original, diffusers in (
            ("img_attn.norm.query_norm", "attn.norm_q"),
            ("img_attn.norm.key_norm", "attn.norm_k"),
            ("txt_attn.norm.query_norm", "attn.norm_added_q"),
            ("txt_attn.norm.key_norm", "attn.norm_added_k"),
        ):
            out[f"{o}{original}.scale"] = sd[f"{d}{diffusers}.weight"]
    for i in _indices(sd, "single_transformer_blocks."):
        o, d = f"single_blocks.{i}.", f"single_transformer_blocks.{i}."
        _module(out, sd, o + "modulation.lin", d + "norm.linear")
        _module(out, sd, o + "linear2", d + "proj_out")
        _fused(out, sd, o + "linear1", [d + "attn.to_q", d + "attn.to_k", d + "attn.to_v", d + "proj_mlp"])
        out[o + "norm.query_norm.scale"] = sd[d + "attn.norm_q.weight"]
        out[o + "norm.key_norm.scale"] = sd[d + "attn.norm_k.weight"]
    return out


def _longcat(sd: dict) -> dict[str, torch.Tensor]:
    """ComfyUI's LongCat-Image files: FLUX.1's BFL names, the timestep embedder (LongCat's only one) as
    `time_in`."""
    out = _flux(sd)
    for original, diffusers in (
        ("time_in.in_layer", "time_embed.timestep_embedder.linear_1"),
        ("time_in.out_layer", "time_embed.timestep_embedder.linear_2"),
    ):
        _module(out, sd, original, diffusers)
    return out


def _chroma(sd: _Tracking) -> dict[str, torch.Tensor]:
    """FLUX.1's BFL names for the blocks; the guidance approximator's layers and norms as lodestones'."""
    approximator = "distilled_guidance_layer."
    out = _flux(_Tracking({k: v for k, v in sd.items() if not k.startswith(approximator)}, sd.used))
    for name in [k for k in sd if k.startswith(approximator)]:
        original = name.replace(".linear_1.", ".in_layer.").replace(".linear_2.", ".out_layer.")
        if ".norms." in name:
            original = name.removesuffix(".weight") + ".scale"
        out[original] = sd[name]
    return out


def _sd3(sd: dict) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {"pos_embed": sd["pos_embed.pos_embed"]}
    for original, diffusers in (
        ("x_embedder.proj", "pos_embed.proj"),
        ("t_embedder.mlp.0", "time_text_embed.timestep_embedder.linear_1"),
        ("t_embedder.mlp.2", "time_text_embed.timestep_embedder.linear_2"),
        ("y_embedder.mlp.0", "time_text_embed.text_embedder.linear_1"),
        ("y_embedder.mlp.2", "time_text_embed.text_embedder.linear_2"),
        ("context_embedder", "context_embedder"),
        ("final_layer.linear", "proj_out"),
    ):
        _module(out, sd, original, diffusers)
    _module(out, sd, "final_layer.adaLN_modulation.1", "norm_out.linear", swap=True)
    blocks = _indices(sd, "transformer_blocks.")
    for i in blocks:
        x, c, d = f"joint_blocks.{i}.x_block.", f"joint_blocks.{i}.context_block.", f"transformer_blocks.{i}."
        _fused(out, sd, x + "attn.qkv", [d + "attn.to_q", d + "attn.to_k", d + "attn.to_v"])
        _fused(out, sd, c + "attn.qkv", [d + "attn.add_q_proj", d + "attn.add_k_proj", d + "attn.add_v_proj"])
        _fused(out, sd, x + "attn2.qkv", [d + "attn2.to_q", d + "attn2.to_k", d + "attn2.to_v"])
        for original, diffusers in (
            (x + "attn.proj", d + "attn.to_out.0"),
            (c + "attn.proj", d + "attn.to_add_out"),
            (x + "attn2.proj", d + "attn2.to_out.0"),
            (x + "attn.ln_q", d + "attn.norm_q"),
            (x + "attn.ln_k", d + "attn.norm_k"),
            (c + "attn.ln_q", d + "attn.norm_added_q"),
            (c + "attn.ln_k", d + "attn.norm_added_k"),
            (x + "attn2.ln_q", d + "attn2.norm_q"),
            (x + "attn2.ln_k", d + "attn2.norm_k"),
            (x + "adaLN_modulation.1", d + "norm1.linear"),
            (x + "mlp.fc1", d + "ff.net.0.proj"),
            (x + "mlp.fc2", d + "ff.net.2"),
            (c + "mlp.fc1", d + "ff_context.net.0.proj"),
            (c + "mlp.fc2", d + "ff_context.net.2"),
        ):
            _module(out, sd, original, diffusers)
        _module(out, sd, c + "adaLN_modulation.1", d + "norm1_context.linear", swap=i == blocks[-1])
    return out


_WAN_CONDITION = {
    "condition_embedder.time_embedder.linear_1.": "time_embedding.0.",
    "condition_embedder.time_embedder.linear_2.": "time_embedding.2.",
    "condition_embedder.text_embedder.linear_1.": "text_embedding.0.",
    "condition_embedder.text_embedder.linear_2.": "text_embedding.2.",
    "condition_embedder.time_proj.": "time_projection.1.",
    "condition_embedder.image_embedder.norm1.": "img_emb.proj.0.",
    "condition_embedder.image_embedder.ff.net.0.proj.": "img_emb.proj.1.",
    "condition_embedder.image_embedder.ff.net.2.": "img_emb.proj.3.",
    "condition_embedder.image_embedder.norm2.": "img_emb.proj.4.",
}
_WAN_BLOCK = {
    "attn1.": "self_attn.",
    "attn2.": "cross_attn.",
    "to_q.": "q.",
    "to_k.": "k.",
    "to_v.": "v.",
    "to_out.0.": "o.",
    "add_k_proj.": "k_img.",
    "add_v_proj.": "v_img.",
    "norm_added_k.": "norm_k_img.",
    "ffn.net.0.proj.": "ffn.0.",
    "ffn.net.2.": "ffn.2.",
    "norm2.": "norm3.",  # Diffusers' norm2 is the cross-attention norm: the original's norm3
    "norm3.": "norm2.",
}


def _wan_name(name: str) -> str:
    for diffusers, original in _WAN_CONDITION.items():
        if name.startswith(diffusers):
            return original + name[len(diffusers) :]
    if name == "scale_shift_table":
        return "head.modulation"
    if name.startswith("proj_out."):
        return "head.head." + name[len("proj_out.") :]
    if not name.startswith("blocks."):
        return name  # patch_embedding
    _, index, rest = name.split(".", 2)
    if rest == "scale_shift_table":
        return f"blocks.{index}.modulation"
    pieces = []
    while rest:
        for diffusers, original in _WAN_BLOCK.items():
            if rest.startswith(diffusers):
                pieces.append(original)
                rest = rest[len(diffusers) :]
                break
        else:
            pieces.append(rest)
            rest = ""
    return f"blocks.{index}." + "".join(pieces)


def _wan(sd: dict) -> dict[str, torch.Tensor]:
    return {_wan_name(name): sd[name] for name in list(sd)}


def _z_image(sd: dict) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name in list(sd):
        if ".attention.to_k." in name or ".attention.to_v." in name:
            continue
        if name.endswith(".attention.to_q.weight"):
            module = name[: -len(".to_q.weight")]
            _fused(out, sd, f"{module}.qkv", [f"{module}.to_q", f"{module}.to_k", f"{module}.to_v"])
            continue
        target = name
        for root, original in (("all_x_embedder.", "x_embedder."), ("all_final_layer.", "final_layer.")):
            if target.startswith(root):
                target = original + target.split(".", 2)[2]  # drop the patch-size key ("2-1")
        target = target.replace(".attention.to_out.0.", ".attention.out.")
        target = target.replace(".attention.norm_q.", ".attention.q_norm.")
        target = target.replace(".attention.norm_k.", ".attention.k_norm.")
        out[target] = sd[name]
    return out


def _identity(sd: dict) -> dict[str, torch.Tensor]:
    return {name: sd[name] for name in list(sd)}


def _qwen_image21(sd: dict) -> dict[str, torch.Tensor]:
    """ComfyUI's Qwen-Image 2.1 files: each block's SwiGLU gate and up projections fused, gate first."""
    out: dict[str, torch.Tensor] = {}
    for name in list(sd):
        if name.endswith(".img_mlp.gate_layer.weight"):
            module = name[: -len(".gate_layer.weight")]
            _fused(out, sd, f"{module}.gate_up", [f"{module}.gate_layer", f"{module}.proj"])
        elif not name.endswith(".img_mlp.proj.weight"):
            out[name] = sd[name]
    return out


_INVERSES: dict[str, Callable[[dict], dict[str, torch.Tensor]]] = {
    "FluxTransformer2DModel": _flux,
    "SD3Transformer2DModel": _sd3,
    "WanTransformer3DModel": _wan,
    "ZImageTransformer2DModel": _z_image,
    "QwenImageTransformer2DModel": _identity,
    "HiDreamImageTransformer2DModel": _identity,
    "QwenImage21Transformer2DModel": _qwen_image21,
    "ChromaTransformer2DModel": _chroma,
    "LongCatImageTransformer2DModel": _longcat,
}

# --------------------------------------------------------------------------- FP8


def fp8_state_dict(state: State, layout: str, per_row: bool = False) -> dict[str, torch.Tensor]:
    """`state` with every 2-D `.weight` in float8_e4m3fn. `layout`: "plain" (a cast, no scales),
    "scaled" (ComfyUI's legacy layout: `<module>.scale_weight` float32 of shape (1,), or one per row
    with `per_row`, plus a `scaled_fp8` marker), "comfy_quant" (`<module>.weight_scale` 0-d float32 and a
    `<module>.comfy_quant` JSON config). Other tensors stay as they are."""
    if layout not in ("plain", "scaled", "comfy_quant"):
        raise ValueError(f"unknown FP8 layout {layout!r}")
    out: dict[str, torch.Tensor] = {}
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    for name, tensor in state.items():
        if not (name.endswith(".weight") and tensor.dim() == 2):
            out[name] = tensor
            continue
        module = name[: -len(".weight")]
        if layout == "plain":
            out[name] = tensor.to(torch.float8_e4m3fn)
            continue
        amax = tensor.abs().amax(dim=1, keepdim=True) if per_row else tensor.abs().amax()
        scale = (amax.float() / fp8_max).clamp(min=1e-12)
        out[name] = (tensor.float() / scale).to(torch.float8_e4m3fn)
        if layout == "scaled":
            out[f"{module}.scale_weight"] = scale.reshape(-1) if per_row else scale.reshape(1)
        else:
            out[f"{module}.weight_scale"] = scale.reshape(())
            config = json.dumps({"format": "float8_e4m3fn"}).encode("utf-8")
            out[f"{module}.comfy_quant"] = torch.tensor(list(config), dtype=torch.uint8)
    if layout == "scaled":
        out["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    return out


# --------------------------------------------------------------------------- GGUF

QK_K = 256
_K_QUANT_BITS = {"Q4_K": 4, "Q5_K": 5}
# city96's llama.cpp patch: FLUX tensors kept in F32, and (the rest of these modules) in F16.
_LCPP_F32 = (
    "img_in.",
    "time_in.in_layer.",
    "vector_in.in_layer.",
    "guidance_in.in_layer.",
    "final_layer.linear.",
)
_LCPP_F16 = ("txt_in.", "time_in.", "vector_in.", "guidance_in.", "final_layer.", "time_embedding.")
# city96's convert.py: tensors of these architectures kept in F32 (parameters, not Linear weights).
_HIGH_PRECISION = {"wan": (".modulation",)}


def gguf_tensor_type(name: str, shape: tuple[int, ...], qtype: str, arch: str) -> str:
    """The GGML type city96's tools give tensor `name` of `shape` in a `qtype` file of `arch`."""
    import gguf

    size = int(np.prod(shape))
    if len(shape) == 1 or any(key in name for key in _HIGH_PRECISION.get(arch, ())):
        return "F32"
    if not name.endswith("weight") or len(shape) > 4:
        return "F32" if size <= 1024 or len(shape) > 4 else "F16"
    if any(key in name for key in _LCPP_F32):
        return "F32"
    if any(key in name for key in _LCPP_F16):
        return "F16"
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][0]
    return qtype if shape[-1] % block == 0 else "F16"


def quantize_array(array: np.ndarray, qtype: str) -> np.ndarray:
    """`array` (float32) as GGML `qtype` bytes (F32 and F16 as their own dtype)."""
    import gguf

    if qtype in _K_QUANT_BITS:
        return quantize_k(array, _K_QUANT_BITS[qtype])
    return gguf.quants.quantize(array, gguf.GGMLQuantizationType[qtype])


def write_gguf(path: str | Path, state: State, qtype: str, arch: str) -> dict[str, str]:
    """Write `state` as a GGUF file of `qtype` ("Q8_0", "Q4_K", "F16", ...); returns name -> type."""
    import gguf

    writer = gguf.GGUFWriter(path=None, arch=arch)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    file_type = getattr(gguf.LlamaFileType, f"MOSTLY_{qtype}", None)
    if file_type is None and qtype.endswith("_K"):
        file_type = getattr(gguf.LlamaFileType, f"MOSTLY_{qtype}_S", None)
    if file_type is not None:
        writer.add_file_type(file_type)
    types = {}
    for name, tensor in state.items():
        array = tensor.detach().to(torch.float32).numpy()
        tensor_type = gguf_tensor_type(name, tuple(array.shape), qtype, arch)
        types[name] = tensor_type
        writer.add_tensor(
            name, quantize_array(array, tensor_type), raw_dtype=gguf.GGMLQuantizationType[tensor_type]
        )
    writer.write_header_to_file(path=str(path))
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return types


def quantize_k(array: np.ndarray, bits: int) -> np.ndarray:
    """Q4_K (`bits` 4) or Q5_K (5) bytes of `array`, whose last dimension divides into 256-value blocks.

    ggml's layout: per block fp16 `d` and `dmin`, 8 sub-blocks of 32 with 6-bit scales and mins packed
    in 12 bytes, then (Q5_K) the fifth bits, 32 bytes, then the low 4 bits, two sub-blocks per 32 bytes.
    A value is d * scale_j * q - dmin * min_j. The fit is a plain min/max per sub-block."""
    if array.shape[-1] % QK_K:
        raise ValueError(f"the last dimension ({array.shape[-1]}) must divide into {QK_K}-value blocks")
    levels = (1 << bits) - 1
    x = array.astype(np.float32).reshape(-1, 8, 32)
    n = x.shape[0]
    low = np.minimum(x.min(axis=2), 0.0)
    sub_scale = (x.max(axis=2) - low) / levels
    sub_min = -low
    d = (sub_scale.max(axis=1) / 63).astype(np.float16)
    dmin = (sub_min.max(axis=1) / 63).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32 > 0, np.rint(sub_scale / d32), 0).clip(0, 63).astype(np.uint8)
        mn = np.where(dmin32 > 0, np.rint(sub_min / dmin32), 0).clip(0, 63).astype(np.uint8)
        step = (d32 * sc)[..., None]
        offset = (dmin32 * mn)[..., None]
        q = np.where(step > 0, np.rint((x + offset) / step), 0).clip(0, levels).astype(np.uint8)
    scales = np.concatenate(
        [
            (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6),
            (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4),
        ],
        axis=1,
    ).astype(np.uint8)
    nibbles = q & 15
    parts = [d.reshape(n, 1).view(np.uint8), dmin.reshape(n, 1).view(np.uint8), scales]
    if bits == 5:
        high = (q >> 4) & 1
        parts.append(np.bitwise_or.reduce(high << np.arange(8, dtype=np.uint8)[None, :, None], axis=1))
    parts.append((nibbles[:, 0::2, :] | (nibbles[:, 1::2, :] << 4)).reshape(n, 128))
    blocks = np.concatenate(parts, axis=1).astype(np.uint8)
    return blocks.reshape(*array.shape[:-1], -1)
