"""LoRA file reading and conversion against Diffusers: for each layout, the per-module deltas
(`scaling * up @ down`) of our `ConvertedLora` equal what Diffusers' `lora_state_dict` + PEFT load into
a tiny Diffusers transformer; and broken files fail with a `LoraError` that names what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from diffserve.errors import LoraError
from diffserve.loader.lora_formats import convert_lora, lora_file_format, read_lora_file
from diffserve.loader.lora_formats.architectures import architecture
from diffserve.loader.lora_weights import ConvertedLora
from diffserve.registry import DIT_FACTS

pytest.importorskip("peft")
diffusers = pytest.importorskip("diffusers")
from diffusers.loaders.lora_pipeline import (  # noqa: E402
    FluxLoraLoaderMixin,
    QwenImageLoraLoaderMixin,
    SD3LoraLoaderMixin,
    WanLoraLoaderMixin,
    ZImageLoraLoaderMixin,
)
from peft.tuners.lora import LoraLayer  # noqa: E402

QWEN = "QwenImageTransformer2DModel"
ZIMAGE = "ZImageTransformer2DModel"
WAN = "WanTransformer3DModel"
SD3 = "SD3Transformer2DModel"
FLUX = "FluxTransformer2DModel"


# ------------------------------------------------------------------------------------------ tiny models


def _tiny(dit_class: str, **extra) -> nn.Module:
    torch.manual_seed(0)
    if dit_class == QWEN:
        return diffusers.QwenImageTransformer2DModel(
            patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=8,
            num_attention_heads=2, joint_attention_dim=16, axes_dims_rope=(2, 2, 4),
        )  # fmt: skip
    if dit_class == ZIMAGE:
        return diffusers.ZImageTransformer2DModel(
            all_patch_size=[2], all_f_patch_size=[1], in_channels=4, dim=32, n_layers=1, n_refiner_layers=1,
            n_heads=2, n_kv_heads=2, cap_feat_dim=16, axes_dims=[4, 6, 6], axes_lens=[64, 64, 64], **extra,
        )  # fmt: skip
    if dit_class == WAN:
        return diffusers.WanTransformer3DModel(
            patch_size=[1, 2, 2], num_attention_heads=2, attention_head_dim=8, in_channels=36, out_channels=16,
            text_dim=16, freq_dim=16, ffn_dim=32, num_layers=1, image_dim=16, added_kv_proj_dim=16,
        )  # fmt: skip
    if dit_class == SD3:
        return diffusers.SD3Transformer2DModel(
            sample_size=8, patch_size=2, in_channels=16, num_layers=2, attention_head_dim=8, num_attention_heads=2,
            joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=16, out_channels=16,
            pos_embed_max_size=16, dual_attention_layers=(0,), qk_norm="rms_norm",
        )  # fmt: skip
    return diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=16, axes_dims_rope=(2, 2, 4),
    )  # fmt: skip


def _linears(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Every Linear of the model: (out_features, in_features)."""
    return {n: (m.out_features, m.in_features) for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def _factors(shape: tuple[int, int], rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out_features, in_features = shape
    down = torch.randn(rank, in_features, generator=gen) * 0.3
    up = torch.randn(out_features, rank, generator=gen) * 0.3
    return down, up


def _save(path: Path, state_dict: dict[str, torch.Tensor], adapter_metadata: dict | None = None) -> Path:
    metadata = {"format": "pt"}
    if adapter_metadata is not None:
        metadata["lora_adapter_metadata"] = json.dumps(adapter_metadata, sort_keys=True)
    save_file({k: v.contiguous() for k, v in state_dict.items()}, str(path), metadata=metadata)
    return path


def _peft_deltas(model: nn.Module, prefix: str = "transformer") -> dict[str, torch.Tensor]:
    """Diffusers' effective change per Linear after loading: PEFT's `scaling * B @ A`."""
    deltas = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and "ref" in module.lora_A:
            deltas[f"{prefix}.{name}"] = module.get_delta_weight("ref").detach().float()
    return deltas


def _diffusers_deltas(mixin, dit_class: str, path: Path, **model_extra) -> dict[str, torch.Tensor]:
    """Load `path` as Diffusers does for the family (`lora_state_dict`, then the transformer's
    `load_lora_adapter` with the file's metadata) and read back every LoRA layer's delta."""
    state_dict, metadata = mixin.lora_state_dict(
        str(path.parent), weight_name=path.name, return_lora_metadata=True
    )
    model = _tiny(dit_class, **model_extra)
    model.load_lora_adapter(state_dict, prefix="transformer", metadata=metadata, adapter_name="ref")
    return _peft_deltas(model)


def _ours(path: Path, dit_class: str) -> ConvertedLora:
    state_dict, metadata = read_lora_file(path)
    return convert_lora(state_dict, metadata, dit_class, DIT_FACTS, source=path.name)


def _assert_same_deltas(ours: ConvertedLora, reference: dict[str, torch.Tensor]) -> float:
    assert reference, "the reference loaded no LoRA layer"
    assert sorted(ours.targets) == sorted(reference)
    worst = 0.0
    for path, expected in reference.items():
        got = ours.targets[path].delta_weight()
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        worst = max(worst, float((got - expected).abs().max()))
    return worst


# ---------------------------------------------------------------------------------------- Diffusers / PEFT


@pytest.mark.parametrize("use_rslora", [False, True])
def test_sd3_peft_metadata_alpha_and_patterns_match_diffusers(tmp_path, use_rslora) -> None:
    """`lora_adapter_metadata` decides scaling: lora_alpha != r, rank_pattern, alpha_pattern, rslora."""
    linears = _linears(_tiny(SD3))
    state_dict = {}
    for i, (name, shape) in enumerate(linears.items()):
        down, up = _factors(shape, 2 if name.endswith("attn.to_k") else 4, seed=i)
        state_dict[f"transformer.{name}.lora_A.weight"] = down
        state_dict[f"transformer.{name}.lora_B.weight"] = up
    meta = {
        "transformer.r": 4,
        "transformer.lora_alpha": 8,
        "transformer.use_rslora": use_rslora,
        "transformer.target_modules": sorted(
            n for n in linears if not (use_rslora and n.endswith("attn.to_k"))
        ),
    }
    if not use_rslora:
        meta["transformer.rank_pattern"] = {"attn.to_k": 2}
        meta["transformer.alpha_pattern"] = {"transformer_blocks.1.attn.to_k": 3, "proj_out": 16}
    else:
        state_dict = {k: v for k, v in state_dict.items() if "attn.to_k" not in k}
    path = _save(tmp_path / "sd3.safetensors", state_dict, meta)

    ours = _ours(path, SD3)
    assert ours.format == "diffusers" and ours.unsupported == ()
    assert _assert_same_deltas(ours, _diffusers_deltas(SD3LoraLoaderMixin, SD3, path)) < 1e-6
    if not use_rslora:
        assert ours.targets["transformer.transformer_blocks.1.attn.to_k"].scaling == pytest.approx(3 / 2)
        assert ours.targets["transformer.transformer_blocks.0.attn.to_k"].scaling == pytest.approx(8 / 2)
        assert ours.targets["transformer.proj_out"].scaling == pytest.approx(16 / 4)
    else:
        assert ours.targets["transformer.proj_out"].scaling == pytest.approx(8 / 2)  # alpha / sqrt(r)


def test_wan_peft_without_metadata_is_alpha_equals_rank(tmp_path) -> None:
    """No metadata, no alphas, mixed ranks: Diffusers' inferred config scales every module by 1."""
    linears = _linears(_tiny(WAN))
    state_dict = {}
    for i, (name, shape) in enumerate(linears.items()):
        down, up = _factors(shape, (4, 4, 2, 8)[i % 4], seed=100 + i)
        state_dict[f"transformer.{name}.lora_A.weight"] = down
        state_dict[f"transformer.{name}.lora_B.weight"] = up
    path = _save(tmp_path / "pytorch_lora_weights.safetensors", state_dict)

    ours = _ours(path, WAN)
    assert all(pair.alpha is None for pair in ours.targets.values())
    assert _assert_same_deltas(ours, _diffusers_deltas(WanLoraLoaderMixin, WAN, path)) < 1e-6


def test_qwen_bare_keys_with_default_adapter_name_and_alpha(tmp_path) -> None:
    """ai-toolkit style: no `transformer.` prefix, PEFT's `lora_A.default.weight`, `.alpha` tensors
    (Diffusers folds alpha / rank into the factors; ours keeps it as alpha: same delta)."""
    linears = _linears(_tiny(QWEN))
    state_dict = {}
    for i, (name, shape) in enumerate(linears.items()):
        down, up = _factors(shape, 4, seed=200 + i)
        state_dict[f"{name}.lora_A.default.weight"] = down
        state_dict[f"{name}.lora_B.default.weight"] = up
        if i % 3:
            state_dict[f"{name}.alpha"] = torch.tensor(float(i % 5 + 1))
    path = _save(tmp_path / "qwen.safetensors", state_dict)

    ours = _ours(path, QWEN)
    assert _assert_same_deltas(ours, _diffusers_deltas(QwenImageLoraLoaderMixin, QWEN, path)) < 1e-6
    assert sum(pair.alpha is not None for pair in ours.targets.values()) > 0


def test_flux_peft_alphas_follow_network_alphas(tmp_path) -> None:
    """FLUX passes `.alpha` tensors to PEFT as network_alphas: a module without one takes the first."""
    pytest.importorskip("diffserve.families.flux.lora_formats")
    model = _tiny(FLUX)
    state_dict = {}
    for i, (name, shape) in enumerate(_linears(model).items()):
        down, up = _factors(shape, 4 if i % 4 else 2, seed=300 + i)
        state_dict[f"transformer.{name}.lora_A.weight"] = down
        state_dict[f"transformer.{name}.lora_B.weight"] = up
        if i in (1, 5, 6):
            state_dict[f"transformer.{name}.alpha"] = torch.tensor(float(i))
    path = _save(tmp_path / "flux.safetensors", state_dict)

    sd, alphas, meta = FluxLoraLoaderMixin.lora_state_dict(
        str(tmp_path), weight_name=path.name, return_alphas=True, return_lora_metadata=True
    )
    FluxLoraLoaderMixin.load_lora_into_transformer(sd, alphas, model, adapter_name="ref", metadata=meta)
    ours = _ours(path, FLUX)
    assert ours.format == "diffusers"
    assert _assert_same_deltas(ours, _peft_deltas(model)) < 1e-6
    assert {pair.alpha for pair in ours.targets.values()} == {1.0, 5.0, 6.0}


def test_sd3_text_encoder_metadata_matches_diffusers(tmp_path) -> None:
    """A text encoder's LoRA uses its own metadata fields; CLIP-L's keys keep the file's names."""
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(0)
    clip = CLIPTextModel(CLIPTextConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, projection_dim=16))  # fmt: skip
    state_dict = {}
    for i, (name, shape) in enumerate(_linears(clip).items()):
        down, up = _factors(shape, 4, seed=400 + i)
        state_dict[f"text_encoder.text_model.{name}.lora_A.weight"] = down
        state_dict[f"text_encoder.text_model.{name}.lora_B.weight"] = up
    targets = sorted(_linears(clip))
    meta = {"text_encoder.r": 4, "text_encoder.lora_alpha": 16, "text_encoder.target_modules": targets}
    path = _save(tmp_path / "te.safetensors", state_dict, meta)

    sd, meta = SD3LoraLoaderMixin.lora_state_dict(
        str(tmp_path), weight_name=path.name, return_lora_metadata=True
    )
    SD3LoraLoaderMixin.load_lora_into_text_encoder(
        sd, None, clip, prefix="text_encoder", adapter_name="ref", metadata=meta
    )
    # transformers >= 5 flattens CLIPTextModel (no `text_model.`): Diffusers strips that part of the keys
    reference = {
        k.replace("text_encoder.", "text_encoder.text_model.", 1): v
        for k, v in _peft_deltas(clip, "text_encoder").items()
    }
    ours = _ours(path, SD3)
    assert ours.components() == {"text_encoder"}
    assert _assert_same_deltas(ours, reference) < 1e-6
    assert all(pair.scaling == pytest.approx(4.0) for pair in ours.targets.values())


def test_metadata_must_cover_every_component_and_rank() -> None:
    """Metadata for the transformer only gives the text encoder `LoraConfig()` without target modules in
    Diffusers, which PEFT refuses; a configured rank other than the weights' does not load either."""
    state_dict = {
        **_pair("transformer.proj_out", rank=4),
        **_pair("text_encoder.text_model.encoder.layers.0.self_attn.q_proj", rank=4),
    }
    meta = {"lora_adapter_metadata": json.dumps({"transformer.r": 4, "transformer.lora_alpha": 4})}
    with pytest.raises(LoraError, match=r"configures transformer but not text_encoder"):
        convert_lora(state_dict, meta, SD3, DIT_FACTS)
    meta = {"lora_adapter_metadata": json.dumps({"transformer.r": 8})}
    with pytest.raises(LoraError, match=r"proj_out has rank 4 but .*configures rank 8"):
        convert_lora(_pair("transformer.proj_out", rank=4), meta, SD3, DIT_FACTS)


# ----------------------------------------------------------------------------------- kohya / original


def _kohya_state(
    linears: dict[str, tuple[int, int]], seed: int, alpha_every: int = 1
) -> dict[str, torch.Tensor]:
    state_dict = {}
    for i, (name, shape) in enumerate(linears.items()):
        down, up = _factors(shape, 4, seed=seed + i)
        flat = "lora_unet_" + name.replace(".", "_")
        state_dict[f"{flat}.lora_down.weight"] = down
        state_dict[f"{flat}.lora_up.weight"] = up
        if i % alpha_every == 0:
            state_dict[f"{flat}.alpha"] = torch.tensor(float(i % 7 + 1))
    return state_dict


def test_qwen_kohya_matches_diffusers(tmp_path) -> None:
    path = _save(tmp_path / "qwen_kohya.safetensors", _kohya_state(_linears(_tiny(QWEN)), 500, alpha_every=2))
    ours = _ours(path, QWEN)
    assert ours.format == "kohya" == lora_file_format(read_lora_file(path)[0])
    assert _assert_same_deltas(ours, _diffusers_deltas(QwenImageLoraLoaderMixin, QWEN, path)) < 1e-6


def test_qwen_diffusion_model_prefix_matches_diffusers(tmp_path) -> None:
    state_dict = {}
    for i, (name, shape) in enumerate(_linears(_tiny(QWEN)).items()):
        down, up = _factors(shape, 4, seed=600 + i)
        state_dict[f"diffusion_model.{name}.lora_down.weight"] = down
        state_dict[f"diffusion_model.{name}.lora_up.weight"] = up
        state_dict[f"diffusion_model.{name}.alpha"] = torch.tensor(2.0)
    path = _save(tmp_path / "qwen_comfy.safetensors", state_dict)
    ours = _ours(path, QWEN)
    assert ours.format == "diffusion_model"
    assert _assert_same_deltas(ours, _diffusers_deltas(QwenImageLoraLoaderMixin, QWEN, path)) < 1e-6


def test_z_image_kohya_matches_diffusers(tmp_path) -> None:
    """Every Z-Image Linear, including `all_final_layer.2-1.*`, refiners and adaLN modulations."""
    path = _save(tmp_path / "z_kohya.safetensors", _kohya_state(_linears(_tiny(ZIMAGE)), 700))
    ours = _ours(path, ZIMAGE)
    assert "transformer.all_final_layer.2-1.adaLN_modulation.1" in ours.targets
    assert _assert_same_deltas(ours, _diffusers_deltas(ZImageLoraLoaderMixin, ZIMAGE, path)) < 1e-6


@pytest.mark.parametrize("with_split_copies", [False, True])
def test_z_image_fused_qkv_and_out_match_diffusers(tmp_path, with_split_copies) -> None:
    """kohya over Z-Image's original tree (dot spelling): `qkv` splits into to_q/k/v, `out` is
    to_out.0; next to split copies of the same modules, the fused ones are ignored (as Diffusers does)."""
    state_dict = {}
    seed = 800
    for block in ("layers_0", "noise_refiner_0"):
        down, up = _factors((96, 32), 4, seed := seed + 1)
        state_dict[f"lora_unet_{block}_attention_qkv.lora.down.weight"] = down
        state_dict[f"lora_unet_{block}_attention_qkv.lora.up.weight"] = up
        state_dict[f"lora_unet_{block}_attention_qkv.alpha"] = torch.tensor(8.0)
        down, up = _factors((32, 32), 4, seed := seed + 1)
        state_dict[f"lora_unet_{block}_attention_out.lora.down.weight"] = down
        state_dict[f"lora_unet_{block}_attention_out.lora.up.weight"] = up
        state_dict[f"lora_unet_{block}_attention_out.alpha"] = torch.tensor(2.0)
        if with_split_copies:
            for proj in ("q", "k", "v"):
                down, up = _factors((32, 32), 4, seed := seed + 1)
                state_dict[f"lora_unet_{block}_attention_to_{proj}.lora.down.weight"] = down
                state_dict[f"lora_unet_{block}_attention_to_{proj}.lora.up.weight"] = up
    path = _save(tmp_path / "z_fused.safetensors", state_dict)
    ours = _ours(path, ZIMAGE)
    assert "transformer.layers.0.attention.to_v" in ours.targets
    assert _assert_same_deltas(ours, _diffusers_deltas(ZImageLoraLoaderMixin, ZIMAGE, path)) < 1e-6


def test_wan_original_names_match_diffusers(tmp_path) -> None:
    """`diffusion_model.` keys over Wan's checkpoint names (I2V: k_img / v_img and img_emb too)."""
    names = [
        *(f"blocks.0.self_attn.{o}" for o in "qkvo"),
        *(f"blocks.0.cross_attn.{o}" for o in ("q", "k", "v", "o", "k_img", "v_img")),
        "blocks.0.ffn.0", "blocks.0.ffn.2",
    ]  # fmt: skip
    shapes = {"blocks.0.ffn.0": (32, 16), "blocks.0.ffn.2": (16, 32)}
    others = {
        "head.head": (64, 16), "time_projection.1": (96, 16), "text_embedding.0": (16, 16),
        "text_embedding.2": (16, 16), "time_embedding.0": (16, 16), "time_embedding.2": (16, 16),
        "img_emb.proj.1": (16, 16), "img_emb.proj.3": (16, 16),
    }  # fmt: skip
    state_dict = {}
    for i, name in enumerate(names):
        down, up = _factors(shapes.get(name, (16, 16)), 4, seed=900 + i)
        state_dict[f"diffusion_model.{name}.lora_down.weight"] = down
        state_dict[f"diffusion_model.{name}.lora_up.weight"] = up
        state_dict[f"diffusion_model.{name}.alpha"] = torch.tensor(float(i + 1))
    for i, (name, shape) in enumerate(others.items()):  # Diffusers reads no alpha outside the blocks
        down, up = _factors(shape, 2, seed=950 + i)
        state_dict[f"diffusion_model.{name}.lora_down.weight"] = down
        state_dict[f"diffusion_model.{name}.lora_up.weight"] = up
    path = _save(tmp_path / "wan_comfy.safetensors", state_dict)
    ours = _ours(path, WAN)
    assert ours.format == "diffusion_model"
    assert "transformer.condition_embedder.image_embedder.ff.net.0.proj" in ours.targets
    assert _assert_same_deltas(ours, _diffusers_deltas(WanLoraLoaderMixin, WAN, path)) < 1e-6


def test_wan_musubi_kohya_matches_diffusers(tmp_path) -> None:
    names = [
        *(f"blocks_0_self_attn_{o}" for o in "qkvo"),
        *(f"blocks_0_cross_attn_{o}" for o in ("q", "k", "v", "o", "k_img", "v_img")),
        "blocks_0_ffn_0", "blocks_0_ffn_2",
    ]  # fmt: skip
    shapes = {"blocks_0_ffn_0": (32, 16), "blocks_0_ffn_2": (16, 32)}
    state_dict = {}
    for i, name in enumerate(names):
        down, up = _factors(shapes.get(name, (16, 16)), 4, seed=1000 + i)
        state_dict[f"lora_unet_{name}.lora_down.weight"] = down
        state_dict[f"lora_unet_{name}.lora_up.weight"] = up
        state_dict[f"lora_unet_{name}.alpha"] = torch.tensor(float(i % 3 + 1))
    path = _save(tmp_path / "wan_musubi.safetensors", state_dict)
    ours = _ours(path, WAN)
    assert "transformer.blocks.0.attn2.add_v_proj" in ours.targets
    assert _assert_same_deltas(ours, _diffusers_deltas(WanLoraLoaderMixin, WAN, path)) < 1e-6


@pytest.mark.parametrize(("dit_class", "extra"), [(QWEN, {}), (ZIMAGE, {"siglip_feat_dim": 8}), (WAN, {})])
def test_module_table_names_every_linear(dit_class, extra) -> None:
    """Each Linear of the Diffusers model, underscore-joined as kohya writes it, maps back to itself."""
    table = architecture(dit_class, DIT_FACTS).table
    for name in _linears(_tiny(dit_class, **extra)):
        resolved = table.resolve_flat(name.replace(".", "_"))
        assert resolved is not None and resolved.targets == (name,), name


# -------------------------------------------------------------------------------------- what is refused


def _pair(module: str, rank: int = 2, out_features: int = 8, in_features: int = 8) -> dict[str, torch.Tensor]:
    return {
        f"{module}.lora_A.weight": torch.randn(rank, in_features),
        f"{module}.lora_B.weight": torch.randn(out_features, rank),
    }


def test_unsupported_keys_are_listed_not_applied() -> None:
    state_dict = {
        **_pair("transformer.blocks.0.attn1.to_q"),
        "transformer.blocks.0.attn1.to_q.lora_B.bias": torch.randn(8),
        "transformer.blocks.0.attn1.to_k.lora_magnitude_vector": torch.randn(8),
        **_pair("transformer.blocks.0.attn1.to_k"),
        **_pair("text_encoder.encoder.block.0.layer.0.SelfAttention.q"),
    }
    converted = convert_lora(state_dict, {}, WAN, DIT_FACTS)
    assert sorted(converted.targets) == ["transformer.blocks.0.attn1.to_k", "transformer.blocks.0.attn1.to_q"]
    assert set(converted.unsupported) == {
        "transformer.blocks.0.attn1.to_q.lora_B.bias",
        "transformer.blocks.0.attn1.to_k.lora_magnitude_vector",
        "text_encoder.encoder.block.0.layer.0.SelfAttention.q.lora_A.weight",
        "text_encoder.encoder.block.0.layer.0.SelfAttention.q.lora_B.weight",
    }
    diffs = {
        **{f"diffusion_model.blocks.0.self_attn.q.{k}": v for k, v in (("lora_down.weight", torch.randn(2, 8)), ("lora_up.weight", torch.randn(8, 2)))},
        "diffusion_model.blocks.0.self_attn.norm_q.diff": torch.randn(8),
        "diffusion_model.blocks.0.self_attn.q.diff_b": torch.randn(8),
    }  # fmt: skip
    converted = convert_lora(diffs, {}, WAN, DIT_FACTS)
    assert list(converted.targets) == ["transformer.blocks.0.attn1.to_q"]
    assert len(converted.unsupported) == 2


@pytest.mark.parametrize(
    ("state_dict", "dit_class", "message"),
    [
        ({"transformer.blocks.0.attn1.to_q.weight": torch.randn(8, 8)}, WAN, r"no LoRA layout known for Wan.*to_q\.weight"),
        ({"lora_unet_blocks_0_self_attn_qq.lora_down.weight": torch.randn(2, 8)}, WAN, r"name no WanTransformer3DModel module"),
        ({"lora_unet_transformer_blocks_0_attn_to_q.lora_down.weight": torch.randn(2, 8)}, SD3, r"kohya-format .* not supported for SD3"),
        ({"transformer.blocks.0.attn1.to_q.lora_A.weight": torch.randn(2, 8)}, WAN, r"has a down factor .* but no up factor"),
        ({"transformer.proj_out.lora_A.weight": torch.randn(2, 8), "transformer.proj_out.lora_B.weight": torch.randn(8, 3)}, QWEN, r"rank 2 .* rank 3"),
        ({"transformer.proj_out.lora_B.bias": torch.randn(8)}, QWEN, r"no LoRA pair .* unsupported keys: transformer\.proj_out\.lora_B\.bias"),
        ({}, QWEN, r"holds no tensors"),
        (_pair("transformer.x"), "UNet2DConditionModel", r"not supported for UNet2DConditionModel"),
    ],
)  # fmt: skip
def test_bad_state_dicts_raise_lora_error(state_dict, dit_class, message) -> None:
    with pytest.raises(LoraError, match=message):
        convert_lora(state_dict, {}, dit_class, DIT_FACTS, source="bad.safetensors")


def test_reading_finds_the_file_of_a_folder(tmp_path) -> None:
    _save(tmp_path / "pytorch_lora_weights.safetensors", _pair("transformer.proj_out"), {"transformer.r": 2})
    tensors, metadata = read_lora_file(tmp_path)
    assert sorted(tensors) == ["transformer.proj_out.lora_A.weight", "transformer.proj_out.lora_B.weight"]
    assert json.loads(metadata["lora_adapter_metadata"]) == {"transformer.r": 2}
    _save(tmp_path / "other.safetensors", _pair("transformer.proj_out"))
    with pytest.raises(LoraError, match=r"holds 2 safetensors files"):
        read_lora_file(tmp_path)


def test_unreadable_files_raise_lora_error(tmp_path) -> None:
    good = _save(tmp_path / "good.safetensors", _pair("transformer.proj_out", in_features=64))
    raw = good.read_bytes()
    cases = {
        "missing.safetensors": (None, r"does not exist"),
        "empty.safetensors": (b"", r"only 0 bytes"),
        "truncated.safetensors": (raw[: len(raw) - 100], r"truncated: tensor"),
        "cut_header.safetensors": (raw[:40], r"truncated or not a safetensors file"),
        "absurd.safetensors": ((2**62).to_bytes(8, "little") + b"{}", r"header takes \d+ bytes, more than"),
        "garbage.safetensors": ((11).to_bytes(8, "little") + b"\xff\xfe not json", r"header is not JSON"),
        "bad_dtype.safetensors": (raw.replace(b'"F32"', b'"X32"'), r"dtype X32; .* floating"),
        "weights.bin": (raw, r"not a \.safetensors file"),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / name
        if content is not None:
            path.write_bytes(content)
        with pytest.raises(LoraError, match=message) as info:
            read_lora_file(path)
        assert str(path) in str(info.value)
    (tmp_path / "sub").mkdir()
    with pytest.raises(LoraError, match=r"holds no \.safetensors file"):
        read_lora_file(tmp_path / "sub")
