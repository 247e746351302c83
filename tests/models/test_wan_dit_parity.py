"""Native Wan 2.1 DiT against Diffusers' `WanTransformer3DModel` on the same tiny random weights (fp32).

Latents are (batch, C, F=3, H=6, W=4): 3 latent frames (9 video frames), a non-square grid. The I2V
configs take the pipeline's 36-channel concat (16 noisy + 4 mask + 16 condition latents) and 512 text
tokens, the length Diffusers' attention hard-codes when it splits image from text context.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from diffserve.models.dits.wan import WanTransformer3DModel, WanTransformerConfig, wan_rope_axes_dims
from diffserve.testing.parity import (
    assert_parity,
    assert_same_state_dict_layout,
    native_from_reference,
    parity_pair,
)

diffusers = pytest.importorskip("diffusers")
from diffusers import WanTransformer3DModel as DiffusersWan  # noqa: E402

T2V: dict[str, Any] = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 2,
    "attention_head_dim": 16,  # RoPE split (frames, rows, cols) = (8, 4, 4)
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 32,
    "freq_dim": 32,
    "ffn_dim": 64,
    "num_layers": 2,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "image_dim": None,
    "added_kv_proj_dim": None,
    "rope_max_seq_len": 32,
    "pos_embed_seq_len": None,
}
T2V_NO_CROSS_NORM: dict[str, Any] = {**T2V, "attention_head_dim": 24, "cross_attn_norm": False}  # (8, 8, 8)
I2V: dict[str, Any] = {
    **T2V,
    "attention_head_dim": 24,
    "in_channels": 36,
    "image_dim": 24,
    "added_kv_proj_dim": 48,
}
FLF2V: dict[str, Any] = {**I2V, "pos_embed_seq_len": 10}  # 2 images x 5 CLIP tokens
IMAGE_TOKENS = 5


def _pair(config: dict[str, Any]) -> tuple[torch.nn.Module, WanTransformer3DModel]:
    """A seeded Diffusers model and the native model loaded from its state dict through the meta device,
    every tensor perturbed (norm weights start at one, biases and the FLF2V table at zero) so no term is
    trivial."""
    return parity_pair(DiffusersWan, WanTransformer3DModel, config)


def _inputs(
    config: dict[str, Any],
    batch: int,
    timestep: list[float],
    fhw: tuple[int, int, int] = (3, 6, 4),
    txt: int = 512,
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    inputs = {
        "hidden_states": torch.randn(batch, config["in_channels"], *fhw, generator=g),
        "timestep": torch.tensor(timestep),
        "encoder_hidden_states": torch.randn(batch, txt, config["text_dim"], generator=g),
    }
    if config["image_dim"] is not None:
        # FLF2V: Diffusers' pipeline passes (2 * batch, tokens, dim), first/last frame pairs.
        rows = 2 * batch if config["pos_embed_seq_len"] else batch
        inputs["encoder_hidden_states_image"] = torch.randn(
            rows, IMAGE_TOKENS, config["image_dim"], generator=g
        )
    return inputs


def _compare(
    ref: torch.nn.Module, ours: WanTransformer3DModel, label: str, atol: float = 1e-4, **inputs: torch.Tensor
) -> torch.Tensor:
    with torch.no_grad():
        expected = ref(**inputs, return_dict=False)[0].float()
        out = ours(**inputs)
    assert out.shape == expected.shape == inputs["hidden_states"][:, :16].shape
    out = out.float()
    assert_parity(out, expected, f"wan parity {label}", max_abs=atol, min_cos=0.9999)
    return out


@pytest.mark.parametrize("config", [T2V, I2V, FLF2V], ids=["t2v", "i2v", "flf2v"])
def test_state_dict_keys_and_shapes_match_diffusers(config: dict[str, Any]) -> None:
    ref = DiffusersWan(**config)
    with torch.device("meta"):
        ours = WanTransformer3DModel(WanTransformerConfig(**config))
    assert_same_state_dict_layout(ours, ref)


@pytest.mark.parametrize("head_dim", [16, 24, 128])
def test_rope_tables_match_diffusers(head_dim: int) -> None:
    """Half-width tables equal the even columns of Diffusers' full-width (frame, row, col) tables."""
    rope = diffusers.models.transformers.transformer_wan.WanRotaryPosEmbed(head_dim, (1, 2, 2), 32)
    ref_cos, ref_sin = rope(torch.zeros(1, 1, 3, 12, 8))
    with torch.device("meta"):
        ours = WanTransformer3DModel(WanTransformerConfig(**{**T2V, "attention_head_dim": head_dim}))
    assert wan_rope_axes_dims(head_dim) == (rope.t_dim, rope.h_dim, rope.w_dim)
    cos, sin = ours.rope_tables(3, 6, 4, torch.device("cpu"))
    torch.testing.assert_close(cos, ref_cos[0, :, 0, 0::2], rtol=0, atol=0)
    torch.testing.assert_close(sin, ref_sin[0, :, 0, 1::2], rtol=0, atol=0)
    assert ours.rope_tables(3, 6, 4, torch.device("cpu"))[0] is cos  # cached per grid


@pytest.mark.parametrize("config", [T2V, T2V_NO_CROSS_NORM], ids=["t2v", "t2v-no-cross-norm"])
def test_t2v_parity_batch2_per_sample_timesteps(config: dict[str, Any]) -> None:
    ref, ours = _pair(config)
    inputs = _inputs(config, 2, [999.0, 137.0], txt=19)
    _compare(ref, ours, f"t2v head_dim={config['attention_head_dim']} b=2 F3xH6xW4", **inputs)
    if not config["cross_attn_norm"]:
        return
    # Batching must not mix samples: each row equals the same sample run alone.
    with torch.no_grad():
        batched = ours(**inputs)
        for i in range(2):
            single = {k: v[i : i + 1] for k, v in inputs.items()}
            torch.testing.assert_close(ours(**single), batched[i : i + 1], rtol=1e-5, atol=1e-5)


def test_t2v_parity_512_text_tokens_integer_timesteps() -> None:
    """The pipeline's shape: text zero-padded to 512, integer scheduler timesteps, one frame and a wide grid."""
    ref, ours = _pair(T2V)
    inputs = _inputs(T2V, 2, [0.0, 0.0], fhw=(1, 4, 10))
    inputs["timestep"] = torch.tensor([961, 20])
    inputs["encoder_hidden_states"][:, 7:] = 0
    _compare(ref, ours, "t2v b=2 F1xH4xW10 txt=512", **inputs)


@pytest.mark.parametrize("config", [I2V, FLF2V], ids=["i2v", "flf2v"])
def test_i2v_parity_batch2_per_sample_timesteps(config: dict[str, Any]) -> None:
    ref, ours = _pair(config)
    inputs = _inputs(config, 2, [875.0, 40.0])
    label = "flf2v" if config["pos_embed_seq_len"] else "i2v"
    _compare(ref, ours, f"{label} b=2 F3xH6xW4 txt=512", **inputs)


def test_per_token_timesteps_parity() -> None:
    """(batch, seq) timesteps (Wan 2.2 TI2V-style: the first latent frame at t=0) match Diffusers."""
    ref, ours = _pair(T2V)
    inputs = _inputs(T2V, 2, [0.0], txt=9)
    seq = 3 * 3 * 2
    timestep = torch.tensor([[700.0], [300.0]]).expand(2, seq).clone()
    timestep[:, :6] = 0  # first post-patch frame (3 x 2 tokens)
    inputs["timestep"] = timestep
    _compare(ref, ours, "per-token timesteps b=2", **inputs)


def _bf16_like_from_pretrained(ref: torch.nn.Module, config: dict[str, Any]) -> torch.nn.Module:
    """Diffusers' bf16 layout as `from_pretrained(torch_dtype=bf16)` leaves it: `_keep_in_fp32_modules` stay fp32."""
    ref = ref.to(torch.bfloat16)
    for name, p in ref.named_parameters():
        if any(part in ref._keep_in_fp32_modules for part in name.split(".")):
            p.data = p.data.float()
    # `.to()` rounded the RoPE buffers to bf16; from_pretrained keeps them as computed.
    rope_cls = diffusers.models.transformers.transformer_wan.WanRotaryPosEmbed
    ref.rope = rope_cls(config["attention_head_dim"], config["patch_size"], config["rope_max_seq_len"])
    return ref


@pytest.mark.parametrize("config", [T2V, I2V], ids=["t2v", "i2v"])
def test_bf16_parity(config: dict[str, Any]) -> None:
    """bf16 with Diffusers' fp32 islands: same op order and rounding points, bit-identical on CPU today.

    The native model is loaded with the same mixed dtypes. Loaded all-bf16 (as the safetensors
    loader does) it stays close: norms, modulation and gated adds are upcast to fp32 either way.
    """
    ref, _ = _pair(config)
    ref = _bf16_like_from_pretrained(ref, config)
    ours = native_from_reference(WanTransformer3DModel, ref)
    inputs = {k: v.to(torch.bfloat16) for k, v in _inputs(config, 2, [900.0, 3.0], txt=512).items()}
    inputs["timestep"] = torch.tensor([900, 3])
    _compare(ref, ours, f"{'i2v' if config['image_dim'] else 't2v'} bf16 b=2", atol=0.0, **inputs)
    if config["image_dim"] is None:
        return

    with torch.device("meta"):
        all_bf16 = WanTransformer3DModel(WanTransformerConfig(**config))
    all_bf16.load_state_dict(
        {k: v.to(torch.bfloat16) for k, v in ref.state_dict().items()}, strict=True, assign=True
    )
    _compare(ref, all_bf16.eval(), "all-bf16 weights", atol=3e-2, **inputs)


def test_from_config_rejects_unknown_keys() -> None:
    with pytest.raises(ValueError, match="WanTransformer3DModel config has unknown keys"):
        WanTransformer3DModel.from_config({**T2V, "window_size": (-1, -1)})


def test_invalid_configs_and_inputs_are_errors() -> None:
    with pytest.raises(ValueError, match="qk_norm"):
        WanTransformer3DModel(WanTransformerConfig(**{**T2V, "qk_norm": "rms_norm"}))
    with pytest.raises(ValueError, match="added_kv_proj_dim"):
        WanTransformer3DModel(WanTransformerConfig(**{**T2V, "image_dim": 24}))
    with torch.device("meta"):
        t2v = WanTransformer3DModel(WanTransformerConfig(**T2V))
        i2v = WanTransformer3DModel(WanTransformerConfig(**I2V))
    meta = {k: v.to("meta") for k, v in _inputs(I2V, 1, [1.0]).items()}
    with pytest.raises(ValueError, match="text-to-video"):
        t2v(**{**meta, "hidden_states": meta["hidden_states"][:, :16]})
    with pytest.raises(ValueError, match="needs encoder_hidden_states_image"):
        i2v(**{**meta, "encoder_hidden_states_image": None})
    with pytest.raises(ValueError, match="multiple of patch_size"):
        i2v(**{**meta, "hidden_states": meta["hidden_states"][..., :3]})
    with pytest.raises(ValueError, match="timestep"):
        i2v(**{**meta, "timestep": torch.zeros(3)})
    with pytest.raises(ValueError, match="rope_max_seq_len"):
        t2v.rope_tables(1, 33, 1, torch.device("cpu"))
