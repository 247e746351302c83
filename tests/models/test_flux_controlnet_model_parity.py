"""The native FLUX.1 ControlNet against Diffusers' `FluxControlNetModel` (plain and Union), and the FLUX DiT's
ControlNet residuals against Diffusers' transformer (`controlnet_block_samples`, interval arithmetic, XLabs'
`controlnet_blocks_repeat`), on tiny random weights (fp32). Residuals for some batch rows: those rows as if
run alone with them, the other rows bit-identical to a batch without residuals."""

from __future__ import annotations

import pytest
import torch
from diffusers import FluxControlNetModel as DiffusersControlNet
from diffusers import FluxTransformer2DModel as DiffusersFlux

from diffserve.models.controlnets.flux import ControlNetBatch, FluxControlNetModel
from diffserve.models.controlnets.residuals import BlockResiduals
from diffserve.models.dits.flux import FluxTransformer2DModel
from diffserve.testing.parity import assert_parity, assert_same_state_dict_layout, parity_pair

CONFIG = {
    "patch_size": 1,
    "in_channels": 16,
    "num_layers": 3,
    "num_single_layers": 4,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,
    "pooled_projection_dim": 24,
    "axes_dims_rope": (4, 6, 6),
    "guidance_embeds": True,
}
H, W, TXT = 3, 4, 5


def _ids() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.zeros(H, W, 3)
    ids[..., 1] = torch.arange(H)[:, None]
    ids[..., 2] = torch.arange(W)[None, :]
    return ids.reshape(-1, 3), torch.zeros(TXT, 3)


def _inputs(batch: int, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    img_ids, txt_ids = _ids()
    return {
        "hidden_states": torch.randn(batch, H * W, CONFIG["in_channels"], generator=g),
        "encoder_hidden_states": torch.randn(batch, TXT, CONFIG["joint_attention_dim"], generator=g),
        "pooled_projections": torch.randn(batch, CONFIG["pooled_projection_dim"], generator=g),
        "timestep": torch.rand(batch, generator=g),
        "guidance": torch.full((batch,), 3.5),
        "img_ids": img_ids,
        "txt_ids": txt_ids,
    }


@pytest.mark.parametrize("num_mode", [None, 3])
def test_controlnet_samples_match_diffusers(num_mode) -> None:
    config = {**CONFIG, "num_layers": 2, "num_single_layers": 3, "num_mode": num_mode}
    ref, ours = parity_pair(DiffusersControlNet, FluxControlNetModel, config)
    assert_same_state_dict_layout(ours, ref)
    ours.fuse_for_inference()
    inputs = _inputs(2)
    control = torch.randn(2, H * W, CONFIG["in_channels"], generator=torch.Generator().manual_seed(3))
    modes = torch.tensor([2, 0]) if num_mode else None
    with torch.no_grad():
        ref_double, ref_single = ref(
            controlnet_cond=control,
            controlnet_mode=None if modes is None else modes[:, None],
            conditioning_scale=0.7,
            return_dict=False,
            **inputs,
        )
        batch = ControlNetBatch(
            latents=inputs["hidden_states"],
            control=control,
            context=ours.embed_context(inputs["encoder_hidden_states"]),
            pooled=inputs["pooled_projections"],
            timestep=inputs["timestep"],
            guidance=inputs["guidance"],
            modes=modes,
            scales=torch.tensor([0.7, 0.7]),
        )
        double, single = ours(batch, inputs["img_ids"], inputs["txt_ids"])
    assert len(double) == 2 and len(single) == 3
    for i, (got, want) in enumerate(zip([*double, *single], [*ref_double, *ref_single], strict=True)):
        assert_parity(got, want, f"controlnet sample {i} (num_mode {num_mode})", max_abs=1e-4, min_cos=0.9999)


@pytest.mark.parametrize(("n_double", "n_single", "repeat"), [(2, 3, False), (1, 1, False), (2, 4, True)])
def test_dit_adds_residuals_as_diffusers(n_double, n_single, repeat) -> None:
    ref, ours = parity_pair(DiffusersFlux, FluxTransformer2DModel, CONFIG)
    inputs = _inputs(2)
    g = torch.Generator().manual_seed(5)
    inner = CONFIG["num_attention_heads"] * CONFIG["attention_head_dim"]
    double = [torch.randn(2, H * W, inner, generator=g) for _ in range(n_double)]
    single = [torch.randn(2, H * W, inner, generator=g) for _ in range(n_single)]
    with torch.no_grad():
        want = ref(
            **inputs,
            controlnet_block_samples=double,
            controlnet_single_block_samples=single,
            controlnet_blocks_repeat=repeat,
            return_dict=False,
        )[0]
        got = ours(
            **inputs,
            controlnet_block_samples=double,
            controlnet_single_block_samples=single,
            controlnet_blocks_repeat=repeat,
        )
        plain = ours(**inputs)
    assert_parity(got, want, f"DiT with residuals {n_double}/{n_single}", max_abs=1e-4, min_cos=0.9999)
    assert (got - plain).abs().max() > 1e-2  # the residuals matter


def test_residuals_for_some_rows() -> None:
    _, ours = parity_pair(DiffusersFlux, FluxTransformer2DModel, CONFIG)
    ours.fuse_for_inference()
    inputs = _inputs(3)
    g = torch.Generator().manual_seed(5)
    inner = CONFIG["num_attention_heads"] * CONFIG["attention_head_dim"]
    double = [torch.randn(1, H * W, inner, generator=g) for _ in range(2)]
    single = [torch.randn(1, H * W, inner, generator=g) for _ in range(3)]
    with torch.no_grad():
        plain = ours(**inputs)
        got = ours(**inputs, controlnet_residuals=[BlockResiduals(double, single, rows=(1,))])
        row_alone = ours(
            **{k: v[1:2] if k not in ("img_ids", "txt_ids") else v for k, v in inputs.items()},
            controlnet_block_samples=double,
            controlnet_single_block_samples=single,
        )
    assert torch.equal(got[0], plain[0]) and torch.equal(got[2], plain[2])
    assert_parity(got[1:2], row_alone, "row 1 with residuals", max_abs=1e-5, min_cos=0.99999)
    assert (got[1] - plain[1]).abs().max() > 1e-2


def test_xlabs_controlnet_reads_the_control_image_as_diffusers() -> None:
    """XLabs' layout (`conditioning_embedding_channels`, patch 2): the control image itself, through the
    pixel-space `input_hint_block` (16x smaller after it and the patching), gives Diffusers' samples."""
    config = {
        **CONFIG,
        "patch_size": 2,
        "num_layers": 2,
        "num_single_layers": 0,
        "conditioning_embedding_channels": 4,
    }
    ref, ours = parity_pair(DiffusersControlNet, FluxControlNetModel, config)
    assert_same_state_dict_layout(ours, ref)
    assert ours.config.reads_pixels
    ours.fuse_for_inference()
    inputs = _inputs(2)
    image = torch.rand(2, 3, H * 16, W * 16, generator=torch.Generator().manual_seed(4)) * 2 - 1
    with torch.no_grad():
        ref_double, ref_single = ref(
            controlnet_cond=image, conditioning_scale=0.6, return_dict=False, **inputs
        )
        batch = ControlNetBatch(
            latents=inputs["hidden_states"], control=image, context=ours.embed_context(inputs["encoder_hidden_states"]),
            pooled=inputs["pooled_projections"], timestep=inputs["timestep"], guidance=inputs["guidance"],
            modes=None, scales=torch.tensor([0.6, 0.6]),
        )  # fmt: skip
        double, single = ours(batch, inputs["img_ids"], inputs["txt_ids"])
    assert len(double) == 2 and not single and not ref_single
    for i, (got, want) in enumerate(zip(double, ref_double, strict=True)):
        assert_parity(got, want, f"XLabs controlnet sample {i}", max_abs=1e-4, min_cos=0.9999)


def test_an_xlabs_hint_that_does_not_fill_a_token_is_refused() -> None:
    with pytest.raises(ValueError, match=r"conditioning_embedding_channels x patch_size\^2"):
        FluxControlNetModel.from_config({**CONFIG, "patch_size": 2, "conditioning_embedding_channels": 3})


def test_a_controlnet_that_does_not_fit_the_dit_is_refused_at_load() -> None:
    """Each of these fails at Diffusers' first step (a shape error deep in torch); `use_controlnets`
    refuses the ControlNet when it is loaded, naming every key that does not fit. A matching ControlNet,
    and XLabs' 2x2-patched hint on the 8x VAE's 16-pixel tokens, pass."""
    from diffserve.errors import ModelLoadError
    from diffserve.families.flux.controlnet import check_controlnet_fits

    misfit = {
        "in_channels": 32,
        "joint_attention_dim": 24,
        "pooled_projection_dim": 32,
        "num_attention_heads": 4,
        "patch_size": 1,
        "conditioning_embedding_channels": 32,
    }
    with torch.device("meta"):
        dit = FluxTransformer2DModel.from_config(CONFIG)
        xlabs = FluxControlNetModel.from_config(
            {**CONFIG, "patch_size": 2, "conditioning_embedding_channels": 4}
        )
        wrong = FluxControlNetModel.from_config({**CONFIG, **misfit})
    check_controlnet_fits("xlabs", xlabs, dit, pixels=16)
    with pytest.raises(ModelLoadError) as refused:
        check_controlnet_fits("misfit", wrong, dit, pixels=16)
    assert str(refused.value) == (
        "ControlNet 'misfit' does not fit this model's DiT: it has in_channels 32 (the DiT's: 16); "
        "joint_attention_dim 24 (the DiT's: 32); pooled_projection_dim 32 (the DiT's: 24); "
        "num_attention_heads x attention_head_dim 4 x 16 (the DiT's: 2 x 16); an XLabs hint token covering "
        "8x8 pixels (its encoder's downsampling x patch_size 1), where a latent token covers 16x16 (the VAE's "
        "scale x 2)"
    )
