"""FLUX community LoRA formats (kohya / ComfyUI, ai-toolkit `lora_transformer_`, XLabs, BFL, BFL
Control, fal) against Diffusers' `FluxPipeline.lora_state_dict`: the same Diffusers modules, the same
effective delta `scaling * up @ down` per module, and the keys Diffusers does not apply as LoRA pairs
reported as unsupported."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from diffserve.errors import LoraError
from diffserve.families.flux.lora_formats import convert_flux_lora
from diffserve.loader.bfl_names import (
    DIFFUSERS_DOUBLE_LINEARS,
    DIFFUSERS_GLOBAL_LINEARS,
    DIFFUSERS_SINGLE_LINEARS,
    bfl_target,
)
from diffserve.loader.lora_weights import ConvertedLora

pytest.importorskip("peft")
diffusers = pytest.importorskip("diffusers")
from diffusers.utils import convert_state_dict_to_diffusers, convert_state_dict_to_peft  # noqa: E402

D = 8  # hidden width of the tiny blocks
HIDDEN = 3072  # FLUX.1's: Diffusers splits a single block's linear1 as 3 x 3072 + 12288 rows
RANK = 4
ATOL = 1e-5
FULL_LIMIT = 1 << 20  # deltas larger than this many entries are compared through a random probe

# BFL module -> (out_features, in_features) for one double and one single block of a tiny FLUX.
_DOUBLE = {
    "img_attn.qkv": (3 * D, D),
    "txt_attn.qkv": (3 * D, D),
    "img_attn.proj": (D, D),
    "txt_attn.proj": (D, D),
    "img_mlp.0": (4 * D, D),
    "img_mlp.2": (D, 4 * D),
    "txt_mlp.0": (4 * D, D),
    "txt_mlp.2": (D, 4 * D),
    "img_mod.lin": (6 * D, D),
    "txt_mod.lin": (6 * D, D),
}
_SINGLE = {"linear1": (7 * HIDDEN, HIDDEN), "linear2": (D, 5 * D), "modulation.lin": (3 * D, D)}
_GLOBAL = {
    "img_in": (D, 16),
    "txt_in": (D, 12),
    "time_in.in_layer": (D, 256),
    "time_in.out_layer": (D, D),
    "vector_in.in_layer": (D, 10),
    "vector_in.out_layer": (D, D),
    "guidance_in.in_layer": (D, 256),
    "guidance_in.out_layer": (D, D),
    "final_layer.linear": (16, D),
    "final_layer.adaLN_modulation.1": (2 * D, D),
}
_CLIP = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.out_proj",
    "mlp.fc1",
    "mlp.fc2",
)


def _tiny_bfl_modules() -> dict[str, tuple[int, int]]:
    modules = {f"double_blocks.0.{k}": v for k, v in _DOUBLE.items()}
    modules.update({f"single_blocks.0.{k}": v for k, v in _SINGLE.items()})
    modules.update(_GLOBAL)
    return modules


def _factors(gen: torch.Generator, out: int, inp: int, rank: int = RANK) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(rank, inp, generator=gen), torch.randn(out, rank, generator=gen)


def _save(tmp_path: Path, name: str, state: dict[str, torch.Tensor]) -> Path:
    path = tmp_path / f"{name}.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    return path


def _to_peft_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Diffusers' returned keys as its loaders turn them into PEFT `lora_A` / `lora_B` names; keys it
    returns without a component (kohya's modules outside the blocks) under `transformer.`."""
    text = {k.removeprefix("text_encoder."): v for k, v in state.items() if k.startswith("text_encoder.")}
    if text:
        text = convert_state_dict_to_peft(convert_state_dict_to_diffusers(text))
    named = {f"text_encoder.{k}": v for k, v in text.items()}
    for key, value in state.items():
        if not key.startswith("text_encoder."):
            named[key if key.startswith("transformer.") else f"transformer.{key}"] = value
    return named


Factors = tuple[torch.Tensor, torch.Tensor]  # (up, down) of a delta `up @ down`, any scaling folded in


def _diffusers_deltas(path: Path) -> tuple[dict[str, Factors], list[str]]:
    """Diffusers' modules and delta factors `(lora_B, lora_A)` for a file, and the other keys it
    returns. The community formats tested here give no network alphas: Diffusers folds them in."""
    state, alphas = diffusers.FluxPipeline.lora_state_dict(str(path), return_alphas=True)
    assert not alphas
    named = _to_peft_names(state)
    deltas: dict[str, Factors] = {}
    others = []
    for key, down in named.items():
        if key.endswith(".lora_A.weight"):
            module = key.removesuffix(".lora_A.weight")
            deltas[module] = (named[f"{module}.lora_B.weight"].float(), down.float())
        elif not key.endswith(".lora_B.weight"):
            others.append(key)
    return deltas, others


def _assert_same_deltas(converted: ConvertedLora, expected: dict[str, Factors]) -> float:
    """Same targets and, per target, the same `delta_weight()` (for FLUX.1-wide ones, the same
    product with a random probe); returns the largest absolute difference."""
    assert set(converted.targets) == set(expected)
    probe_gen = torch.Generator().manual_seed(99)
    worst = 0.0
    for module, (up, down) in expected.items():
        weights = converted.targets[module]
        assert (weights.out_features, weights.in_features) == (up.shape[0], down.shape[1]), module
        if up.shape[0] * down.shape[1] <= FULL_LIMIT:
            ours, theirs = weights.delta_weight(), up @ down
        else:
            probe = torch.randn(down.shape[1], 4, generator=probe_gen)
            ours = weights.up.float() @ (weights.down.float() @ probe) * weights.scaling
            theirs = up @ (down @ probe)
        worst = max(worst, (ours - theirs).abs().max().item())
    assert worst < ATOL, worst
    return worst


def _factors_of(converted: ConvertedLora) -> dict[str, Factors]:
    return {k: (w.up.float() * w.scaling, w.down.float()) for k, w in converted.targets.items()}


def _swapped(up: torch.Tensor, down: torch.Tensor) -> Factors:
    """A BFL (shift, scale) AdaLN output in Diffusers' (scale, shift) order."""
    shift, scale = up.chunk(2)
    return torch.cat([scale, shift]), down


def _kohya_state(gen: torch.Generator, dotted: bool) -> dict[str, torch.Tensor]:
    """A kohya FLUX file over the tiny modules plus CLIP; `dotted` writes ComfyUI's
    `diffusion_model.` / `text_encoders.clip_l.transformer.` form. `final_layer` alphas equal the rank:
    Diffusers drops those alphas (see `test_kohya_final_layer_keeps_alpha`)."""
    state: dict[str, torch.Tensor] = {}
    for i, (module, (out, inp)) in enumerate(_tiny_bfl_modules().items()):
        name = f"diffusion_model.{module}" if dotted else f"lora_unet_{module.replace('.', '_')}"
        rank = 6 if module.endswith("img_attn.qkv") else RANK
        down, up = _factors(gen, out, inp, rank)
        if module.endswith("img_attn.qkv"):  # block-diagonal over the rank: Diffusers splits the rank too
            mask = torch.block_diag(*[torch.ones(out // 3, rank // 3)] * 3)
            up = up * mask
        state[f"{name}.lora_down.weight"], state[f"{name}.lora_up.weight"] = down, up
        if module.startswith("final_layer"):
            state[f"{name}.alpha"] = torch.tensor(float(rank))
        elif i % 4 != 3:  # some modules without alpha (alpha = rank)
            state[f"{name}.alpha"] = torch.tensor(float(1 + i % 3))
    for j, module in enumerate(_CLIP):
        name = (
            f"text_encoders.clip_l.transformer.text_model.encoder.layers.0.{module}"
            if dotted
            else f"lora_te1_text_model_encoder_layers_0_{module.replace('.', '_')}"
        )
        inp, out = (D, 4 * D) if module == "mlp.fc1" else (4 * D, D) if module == "mlp.fc2" else (D, D)
        state[f"{name}.lora_down.weight"], state[f"{name}.lora_up.weight"] = _factors(gen, out, inp)
        state[f"{name}.alpha"] = torch.tensor(float(2 + j % 2))
    return state


def test_kohya_flux_matches_diffusers(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    state = _kohya_state(gen, dotted=False)
    unsupported = {
        "lora_unet_double_blocks_0_img_attn_proj.dora_scale": torch.randn(1, D, generator=gen),
        "lora_te2_encoder_block_0_layer_0_SelfAttention_q.lora_down.weight": torch.randn(
            RANK, D, generator=gen
        ),
        "lora_te2_encoder_block_0_layer_0_SelfAttention_q.lora_up.weight": torch.randn(
            D, RANK, generator=gen
        ),
    }
    inert = {"lora_unet_double_blocks_0_img_mlp_0.diff_b": torch.zeros(4 * D)}
    path = _save(tmp_path, "kohya", {**state, **unsupported, **inert})
    expected, others = _diffusers_deltas(path)
    assert others == []
    converted = convert_flux_lora({**state, **unsupported, **inert})
    assert converted is not None and converted.format == "flux-kohya"
    worst = _assert_same_deltas(converted, expected)
    assert set(converted.unsupported) == set(unsupported)
    assert converted.components() == {"transformer", "text_encoder"}
    # kohya's fused qkv and linear1 land on Diffusers' separate projections; a block-diagonal up splits
    # its rank (6 -> 2 each, alpha alike), a dense one shares the down factor.
    assert converted.targets["transformer.transformer_blocks.0.attn.to_k"].rank == 2
    assert converted.targets["transformer.transformer_blocks.0.attn.add_k_proj"].rank == RANK
    assert converted.targets["transformer.single_transformer_blocks.0.proj_mlp"].out_features == 4 * HIDDEN
    assert converted.targets["transformer.x_embedder"].in_features == 16
    print(f"kohya max abs diff {worst:.2e}")


def test_comfyui_kohya_matches_diffusers_and_kohya(tmp_path: Path) -> None:
    dotted = _kohya_state(torch.Generator().manual_seed(1), dotted=True)
    t5 = {
        "text_encoders.t5xxl.transformer.encoder.block.0.layer.0.SelfAttention.q.lora_down.weight": torch.ones(
            2, D
        ),
        "text_encoders.t5xxl.transformer.encoder.block.0.layer.0.SelfAttention.q.lora_up.weight": torch.ones(
            D, 2
        ),
    }
    path = _save(tmp_path, "comfy", {**dotted, **t5})
    expected, _ = _diffusers_deltas(path)
    converted = convert_flux_lora({**dotted, **t5})
    assert converted is not None and converted.format == "flux-kohya"
    worst = _assert_same_deltas(converted, expected)
    assert set(converted.unsupported) == set(t5)
    underscored = convert_flux_lora(_kohya_state(torch.Generator().manual_seed(1), dotted=False))
    assert underscored is not None
    _assert_same_deltas(underscored, _factors_of(converted))
    print(f"comfyui kohya max abs diff {worst:.2e}")


def test_kohya_final_layer_keeps_alpha() -> None:
    """kohya's alpha scales `final_layer` like every other module (Diffusers skips it there); its
    AdaLN up rows swap from BFL's (shift, scale) to Diffusers' (scale, shift)."""
    gen = torch.Generator().manual_seed(2)
    down, up = _factors(gen, 2 * D, D)
    name = "lora_unet_final_layer_adaLN_modulation_1"
    converted = convert_flux_lora(
        {f"{name}.lora_down.weight": down, f"{name}.lora_up.weight": up, f"{name}.alpha": torch.tensor(2.0)}
    )
    assert converted is not None
    swapped_up, _ = _swapped(up, down)
    _assert_same_deltas(converted, {"transformer.norm_out.linear": (swapped_up * 2.0 / RANK, down)})


def test_xlabs_matches_diffusers(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(3)
    state: dict[str, torch.Tensor] = {}
    modules = {
        "diffusion_model.double_blocks.0.processor.qkv_lora1": 3 * D,
        "diffusion_model.double_blocks.0.processor.qkv_lora2": 3 * D,
        "diffusion_model.double_blocks.0.processor.proj_lora1": D,
        "diffusion_model.double_blocks.0.processor.proj_lora2": D,
        "double_blocks.1.processor.qkv_lora1": 3 * D,
        "single_blocks.0.processor.qkv_lora": 3 * D,
        "single_blocks.0.processor.proj_lora": D,
    }
    for module, out in modules.items():
        state[f"{module}.down.weight"], state[f"{module}.up.weight"] = _factors(gen, out, D)
    expected, others = _diffusers_deltas(_save(tmp_path, "xlabs", state))
    assert others == []
    converted = convert_flux_lora(state)
    assert converted is not None and converted.format == "flux-xlabs" and converted.unsupported == ()
    worst = _assert_same_deltas(converted, expected)
    print(f"xlabs max abs diff {worst:.2e}")


def _full_bfl_state(gen: torch.Generator, prefix: str, globals_: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """LoRA pairs on all 19 double and 38 single blocks of FLUX.1 (Diffusers' BFL converters pop every
    one) and on `globals_`; small widths except linear1, whose split Diffusers fixes to FLUX.1's."""
    modules = {f"double_blocks.{i}.{k}": v for i in range(19) for k, v in _DOUBLE.items()}
    modules.update({f"single_blocks.{i}.{k}": v for i in range(38) for k, v in _SINGLE.items()})
    modules.update({k: _GLOBAL[k] for k in globals_})
    state = {}
    for module, (out, inp) in modules.items():
        rank = 1 if module.endswith("linear1") else 2
        down, up = _factors(gen, out, inp, rank)
        state[f"{prefix}{module}.lora_A.weight"], state[f"{prefix}{module}.lora_B.weight"] = down, up
    return state


def test_fal_and_comfyui_bfl_match_diffusers(tmp_path: Path) -> None:
    """fal's `base_model.model.` BFL layout goes through Diffusers' converter; the same pairs under
    ComfyUI's `diffusion_model.` (which Diffusers leaves unconverted) give the same modules, plus
    the modules outside the blocks and a file alpha."""
    fal = _full_bfl_state(torch.Generator().manual_seed(4), "base_model.model.", ("final_layer.linear",))
    expected, others = _diffusers_deltas(_save(tmp_path, "fal", fal))
    assert others == []
    converted = convert_flux_lora(fal)
    assert converted is not None and converted.format == "flux-bfl" and converted.unsupported == ()
    worst = _assert_same_deltas(converted, expected)

    comfy = {f"diffusion_model.{k.removeprefix('base_model.model.')}": v for k, v in fal.items()}
    gen = torch.Generator().manual_seed(5)
    for module in ("img_in", "guidance_in.in_layer", "final_layer.adaLN_modulation.1"):
        out, inp = _GLOBAL[module]
        comfy[f"diffusion_model.{module}.lora_A.weight"], comfy[f"diffusion_model.{module}.lora_B.weight"] = (
            _factors(gen, out, inp)
        )
    comfy["diffusion_model.double_blocks.3.img_mlp.0.alpha"] = torch.tensor(1.0)
    converted = convert_flux_lora(comfy)
    assert converted is not None and converted.format == "flux-bfl"
    up, down = expected["transformer.transformer_blocks.3.ff.net.0.proj"]
    expected["transformer.transformer_blocks.3.ff.net.0.proj"] = (up / 2, down)  # alpha 1 over rank 2
    for module, diffusers_module in (
        ("img_in", "x_embedder"),
        ("guidance_in.in_layer", "time_text_embed.guidance_embedder.linear_1"),
    ):
        expected[f"transformer.{diffusers_module}"] = (
            comfy[f"diffusion_model.{module}.lora_B.weight"],
            comfy[f"diffusion_model.{module}.lora_A.weight"],
        )
    expected["transformer.norm_out.linear"] = _swapped(
        comfy["diffusion_model.final_layer.adaLN_modulation.1.lora_B.weight"],
        comfy["diffusion_model.final_layer.adaLN_modulation.1.lora_A.weight"],
    )
    _assert_same_deltas(converted, expected)
    print(f"fal BFL max abs diff {worst:.2e}")


def test_bfl_control_lora_matches_diffusers_and_lists_control_keys(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(6)
    state = _full_bfl_state(gen, "", tuple(_GLOBAL))
    control: dict[str, torch.Tensor] = {}
    for i in range(19):
        for stream in ("img_attn", "txt_attn"):
            for norm in ("query_norm", "key_norm"):
                control[f"double_blocks.{i}.{stream}.norm.{norm}.scale"] = torch.rand(D, generator=gen)
    for i in range(38):
        for norm in ("query_norm", "key_norm"):
            control[f"single_blocks.{i}.norm.{norm}.scale"] = torch.rand(D, generator=gen)
    control["img_in.lora_B.bias"] = torch.randn(D, generator=gen)
    control["double_blocks.0.img_attn.qkv.lora_B.bias"] = torch.randn(3 * D, generator=gen)
    path = _save(tmp_path, "control", {**state, **control})
    expected, others = _diffusers_deltas(path)
    assert len(others) == len(control) + 2  # norm scales and biases as full weights, the qkv bias in 3
    converted = convert_flux_lora({**state, **control})
    assert converted is not None and converted.format == "flux-bfl-control"
    assert set(converted.unsupported) == {*control, "img_in.lora_A.weight", "img_in.lora_B.weight"}
    del expected["transformer.x_embedder"]  # widened input in Control LoRAs: unsupported
    # Diffusers' control converter permutes the down rows of norm_out too, which breaks the product;
    # the delta is the file's with its (shift, scale) output rows swapped.
    expected["transformer.norm_out.linear"] = _swapped(
        state["final_layer.adaLN_modulation.1.lora_B.weight"],
        state["final_layer.adaLN_modulation.1.lora_A.weight"],
    )
    worst = _assert_same_deltas(converted, expected)
    print(f"BFL control max abs diff {worst:.2e}")


def test_ai_toolkit_kohya_names_match_diffusers(tmp_path: Path) -> None:
    """`lora_transformer_` keys over Diffusers' module names (ai-toolkit, OneTrainer): Diffusers
    reads the attention and top-level modules of these files."""
    gen = torch.Generator().manual_seed(7)
    modules = [f"transformer_blocks_0_attn_{m}" for m in ("to_q", "to_k", "to_v", "to_out_0")]
    modules += [
        f"transformer_blocks_0_attn_{m}" for m in ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
    ]
    modules += [f"single_transformer_blocks_0_attn_{m}" for m in ("to_q", "to_k", "to_v")]
    modules += ["context_embedder", "x_embedder", "norm_out_linear", "proj_out"]
    modules += [
        f"time_text_embed_{e}_linear_{i}" for e in ("timestep_embedder", "guidance_embedder") for i in (1, 2)
    ]
    state: dict[str, torch.Tensor] = {}
    for i, module in enumerate(
        [f"lora_transformer_{m}" for m in modules] + ["lora_te1_text_model_encoder_layers_0_self_attn_q_proj"]
    ):
        state[f"{module}.lora_down.weight"], state[f"{module}.lora_up.weight"] = _factors(gen, D, D)
        state[f"{module}.alpha"] = torch.tensor(float(1 + i % 4))
    expected, others = _diffusers_deltas(_save(tmp_path, "ai_toolkit", state))
    assert others == []
    converted = convert_flux_lora(state)
    assert converted is not None and converted.format == "flux-kohya-diffusers-names"
    assert converted.unsupported == ()
    worst = _assert_same_deltas(converted, expected)
    print(f"ai-toolkit kohya-names max abs diff {worst:.2e}")


def test_diffusers_paths_with_kohya_factor_names_match_diffusers(tmp_path: Path) -> None:
    """`transformer.…lora_down.weight`: Diffusers keeps these keys and applies no alpha, so an alpha
    other than the rank, and the file's other keys, are unsupported."""
    gen = torch.Generator().manual_seed(8)
    state: dict[str, torch.Tensor] = {}
    for module in (
        "transformer.transformer_blocks.0.attn.to_q",
        "transformer.single_transformer_blocks.0.proj_mlp",
    ):
        state[f"{module}.lora_down.weight"], state[f"{module}.lora_up.weight"] = _factors(gen, D, D)
    state["transformer.transformer_blocks.0.attn.to_q.alpha"] = torch.tensor(float(RANK))
    state["transformer.single_transformer_blocks.0.proj_mlp.alpha"] = torch.tensor(1.0)
    kohya = {"lora_unet_img_in.lora_down.weight": torch.randn(RANK, 16, generator=gen)}
    kohya["lora_unet_img_in.lora_up.weight"] = torch.randn(D, RANK, generator=gen)
    expected, _ = _diffusers_deltas(_save(tmp_path, "lora_down", {**state, **kohya}))
    converted = convert_flux_lora({**state, **kohya})
    assert converted is not None and converted.format == "flux-diffusers-lora-down"
    _assert_same_deltas(converted, expected)
    assert set(converted.unsupported) == {*kohya, "transformer.single_transformer_blocks.0.proj_mlp.alpha"}


def test_name_tables_cover_flux_linears() -> None:
    """Every Linear of Diffusers' FluxTransformer2DModel is reachable by its kohya-style Diffusers
    name, and every BFL name lands on one of them."""
    model = diffusers.FluxTransformer2DModel(
        patch_size=1,
        in_channels=8,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        pooled_projection_dim=12,
        guidance_embeds=True,
        axes_dims_rope=(2, 2, 4),
    )
    linears = {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    tables = {*DIFFUSERS_GLOBAL_LINEARS}
    tables |= {f"transformer_blocks.{i}.{p}" for i in range(2) for p in DIFFUSERS_DOUBLE_LINEARS}
    tables |= {f"single_transformer_blocks.{i}.{p}" for i in range(2) for p in DIFFUSERS_SINGLE_LINEARS}
    assert tables == linears
    state = {}
    for name in linears:
        module = f"lora_transformer_{name.replace('.', '_')}"
        state[f"{module}.lora_down.weight"], state[f"{module}.lora_up.weight"] = (
            torch.ones(1, 2),
            torch.ones(2, 1),
        )
    converted = convert_flux_lora(state)
    assert converted is not None and set(converted.targets) == {f"transformer.{n}" for n in linears}
    bfl = (
        [f"double_blocks.1.{k}" for k in _DOUBLE] + [f"single_blocks.1.{k}" for k in _SINGLE] + list(_GLOBAL)
    )
    landed = {path for name in bfl for path in bfl_target(name).paths}
    assert landed <= linears
    assert landed >= {n for n in linears if re.match(r"(single_)?transformer_blocks\.1\.", n)}


def test_plain_diffusers_layout_is_left_to_the_generic_converter() -> None:
    up, down = torch.ones(D, RANK), torch.ones(RANK, D)
    peft = {
        "transformer.transformer_blocks.0.attn.to_q.lora_A.weight": down,
        "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": up,
        "text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight": down,
        "text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_B.weight": up,
    }
    assert convert_flux_lora(peft) is None
    ai_toolkit = {
        "transformer.single_transformer_blocks.0.attn.to_k.lora_A.weight": down,
        "transformer.single_transformer_blocks.0.attn.to_k.lora_B.weight": up,
        "transformer.single_transformer_blocks.0.attn.to_k.alpha": torch.tensor(2.0),
    }
    assert convert_flux_lora(ai_toolkit) is None


def test_malformed_pairs_are_refused() -> None:
    with pytest.raises(LoraError, match="lora_up"):
        convert_flux_lora({"lora_unet_img_in.lora_down.weight": torch.ones(RANK, 16)})
    with pytest.raises(LoraError, match="equal parts"):
        convert_flux_lora(
            {
                "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": torch.ones(RANK, D),
                "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": torch.ones(3 * D + 1, RANK),
            }
        )
    with pytest.raises(LoraError, match="both target"):
        convert_flux_lora(
            {
                "lora_te_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": torch.ones(RANK, D),
                "lora_te_text_model_encoder_layers_0_mlp_fc1.lora_up.weight": torch.ones(D, RANK),
                "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": torch.ones(RANK, D),
                "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_up.weight": torch.ones(D, RANK),
            }
        )
