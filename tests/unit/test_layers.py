"""Each shared layer against its Diffusers / torch counterpart on the same inputs (fp32 unless stated)."""

from __future__ import annotations

import pytest
import torch

from diffserve.layers.embeddings import CombinedTimestepTextEmbedding, timestep_sinusoids
from diffserve.layers.mlp import GeluProjection
from diffserve.layers.modulation import Modulate
from diffserve.layers.norms import LayerNorm, RMSNorm
from diffserve.layers.rotary import RotaryEmbedding, multi_axis_rope_tables
from diffserve.models.dits.z_image import ZImageFeedForward
from diffserve.platforms import CpuPlatform

diffusers = pytest.importorskip("diffusers")
from diffusers.models.embeddings import (  # noqa: E402
    CombinedTimestepGuidanceTextProjEmbeddings,
    apply_rotary_emb,
    get_timestep_embedding,
)
from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm  # noqa: E402
from diffusers.models.transformers.transformer_flux import FluxPosEmbed  # noqa: E402


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_diffusers(affine: bool, dtype: torch.dtype) -> None:
    ref = DiffusersRMSNorm(16, eps=1e-6, elementwise_affine=affine).to(dtype)
    ours = RMSNorm(16, eps=1e-6, elementwise_affine=affine).to(dtype)
    if affine:
        ref.weight.data.normal_()
        ours.load_state_dict(ref.state_dict(), strict=True)
    assert set(ours.state_dict()) == set(ref.state_dict())
    x = torch.randn(2, 7, 3, 16).to(dtype) * 5
    out, expected = ours(x), ref(x)
    assert out.dtype == expected.dtype
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_round_once_matches_torch(affine: bool, dtype: torch.dtype) -> None:
    """`round_once=True` is torch.nn.RMSNorm, which Diffusers' FLUX attention uses for QK-norm."""
    ref = torch.nn.RMSNorm(16, eps=1e-6, elementwise_affine=affine).to(dtype)
    ours = RMSNorm(16, eps=1e-6, elementwise_affine=affine, round_once=True).to(dtype)
    if affine:
        ref.weight.data.normal_()
        ours.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(2, 7, 3, 16).to(dtype) * 5
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), rtol=0, atol=0)


@pytest.mark.parametrize(("affine", "bias"), [(True, True), (True, False), (False, True)])
def test_layernorm_matches_torch(affine: bool, bias: bool) -> None:
    ref = torch.nn.LayerNorm(24, eps=1e-6, elementwise_affine=affine, bias=bias)
    for p in ref.parameters():
        p.data.normal_()
    ours = LayerNorm(24, eps=1e-6, elementwise_affine=affine, bias=bias)
    ours.load_state_dict(ref.state_dict(), strict=True)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {
        k: v.shape for k, v in ref.state_dict().items()
    }
    x = torch.randn(3, 5, 24)
    torch.testing.assert_close(ours(x), ref(x), rtol=0, atol=0)


def test_modulate_matches_reference_formula() -> None:
    x = torch.randn(3, 11, 32)
    scale, shift = torch.randn(3, 32), torch.randn(3, 32)
    expected = x * (1 + scale[:, None]) + shift[:, None]
    torch.testing.assert_close(Modulate()(x, scale=scale, shift=shift), expected, rtol=0, atol=0)
    # A single conditioning row broadcasts over the batch.
    expected = x * (1 + scale[:1, None]) + shift[:1, None]
    torch.testing.assert_close(Modulate()(x, scale=scale[:1], shift=shift[:1]), expected, rtol=0, atol=0)


def test_rope_tables_match_diffusers_flux_pos_embed() -> None:
    axes = (4, 6, 6)
    h, w = 5, 7
    img_ids = torch.zeros(h, w, 3)
    img_ids[..., 1] = torch.arange(h)[:, None]
    img_ids[..., 2] = torch.arange(w)[None, :]
    ids = torch.cat([torch.zeros(4, 3), img_ids.reshape(-1, 3)]) * 37  # large positions stress precision
    ref_cos, ref_sin = FluxPosEmbed(theta=10000, axes_dim=list(axes))(ids)
    cos, sin = multi_axis_rope_tables(ids, axes, 10000)
    assert cos.shape == (ids.shape[0], sum(axes) // 2) and cos.dtype == torch.float32
    torch.testing.assert_close(cos.repeat_interleave(2, dim=-1), ref_cos, rtol=0, atol=0)
    torch.testing.assert_close(sin.repeat_interleave(2, dim=-1), ref_sin, rtol=0, atol=0)


@pytest.mark.parametrize("path", ["forward_native", "forward_cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_apply_matches_diffusers(path: str, dtype: torch.dtype) -> None:
    axes = (4, 6, 6)
    seq = 19
    ids = torch.randint(0, 50, (seq, 3)).float()
    cos, sin = multi_axis_rope_tables(ids, axes)
    full = (cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1))
    q = torch.randn(2, seq, 3, sum(axes)).to(dtype)
    k = torch.randn(2, seq, 3, sum(axes)).to(dtype)
    op = RotaryEmbedding()
    q_out, k_out = getattr(op, path)(q, k, cos, sin)
    assert q_out.dtype == dtype and q_out.shape == q.shape
    torch.testing.assert_close(q_out, apply_rotary_emb(q, full, sequence_dim=1), rtol=0, atol=0)
    torch.testing.assert_close(k_out, apply_rotary_emb(k, full, sequence_dim=1), rtol=0, atol=0)


def test_rotary_under_compile_traces_real_arithmetic_and_matches_eager() -> None:
    """Inductor cannot generate code for complex ops; under torch.compile the rotation must be traced
    in real arithmetic (so it fuses with QK-norm) and give the eager complex path's values."""
    axes = (4, 6, 6)
    ids = torch.stack([torch.zeros(10), torch.arange(10.0), torch.arange(10.0) % 3], dim=1)
    cos, sin = multi_axis_rope_tables(ids, axes)
    q, k = torch.randn(2, 10, 3, 16), torch.randn(2, 10, 3, 16)
    op = RotaryEmbedding(CpuPlatform())
    traced_ops: list[str] = []

    def recording_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        traced_ops.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    q_c, k_c = torch.compile(op, backend=recording_backend, fullgraph=True)(q, k, cos, sin)
    assert traced_ops, "the backend saw no graph"
    assert not [t for t in traced_ops if "complex" in t], traced_ops
    q_e, k_e = op(q, k, cos, sin)
    assert op.dispatched_method_name == "forward_cpu"  # eager CPU takes the complex form
    torch.testing.assert_close(q_c, q_e, rtol=0, atol=0)
    torch.testing.assert_close(k_c, k_e, rtol=0, atol=0)


def test_timestep_sinusoids_match_diffusers() -> None:
    t = torch.tensor([0.0, 1.5, 250.0, 999.0])
    expected = get_timestep_embedding(t, 256, flip_sin_to_cos=True, downscale_freq_shift=0)
    torch.testing.assert_close(timestep_sinusoids(t, 256), expected, rtol=0, atol=0)


def test_combined_timestep_guidance_text_embedding_matches_diffusers() -> None:
    ref = CombinedTimestepGuidanceTextProjEmbeddings(embedding_dim=32, pooled_projection_dim=24)
    ours = CombinedTimestepTextEmbedding(32, 24, guidance_embeds=True)
    ours.load_state_dict(ref.state_dict(), strict=True)
    t, g, pooled = torch.tensor([10.0, 900.0]), torch.tensor([3500.0, 1000.0]), torch.randn(2, 24)
    torch.testing.assert_close(ours(t, pooled, g), ref(t, g, pooled), rtol=0, atol=0)
    with pytest.raises(ValueError, match="guidance"):
        ours(t, pooled)


def _recording_output(layer: torch.nn.Linear, outputs: list[torch.Tensor]) -> None:
    """Keep every output `layer` returns, to check later who wrote over it."""
    layer.register_forward_hook(lambda _module, _inputs, out: outputs.append(out))


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_gelu_projection_writes_the_gelu_over_the_linear_output(approximate: str) -> None:
    """Same values as `F.gelu(linear(x))`, in the linear layer's own buffer (no second hidden-width one)."""
    layer = GeluProjection(16, 64, approximate)
    x = torch.randn(2, 5, 16)
    projected: list[torch.Tensor] = []
    _recording_output(layer.proj, projected)
    with torch.inference_mode():
        out = layer(x)
        expected = torch.nn.functional.gelu(layer.proj(x), approximate=approximate)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert out.data_ptr() == projected[0].data_ptr()


def test_zimage_swiglu_reuses_the_first_projections_buffer() -> None:
    ff = ZImageFeedForward(24)
    x = torch.randn(2, 5, 24)
    gate_outputs: list[torch.Tensor] = []
    _recording_output(ff.w1, gate_outputs)
    down_inputs: list[torch.Tensor] = []
    ff.w2.register_forward_pre_hook(lambda _module, inputs: down_inputs.append(inputs[0]))
    with torch.inference_mode():
        out = ff(x)
        expected = ff.w2(torch.nn.functional.silu(ff.w1(x)) * ff.w3(x))
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert down_inputs[0].data_ptr() == gate_outputs[0].data_ptr()


def test_gelu_projection_under_compile_traces_the_logistic_form_with_the_same_values() -> None:
    """Inductor's tanh is the slow part of a compiled GELU: the graph computes x * sigmoid(2u) instead."""
    layer = GeluProjection(16, 64, "tanh")
    x = torch.randn(3, 7, 16) * 3
    traced_ops: list[str] = []

    def recording_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        traced_ops.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    with torch.inference_mode():
        compiled = torch.compile(layer, backend=recording_backend, fullgraph=True)(x)
        eager = layer(x)
    assert [t for t in traced_ops if "sigmoid" in t], traced_ops
    assert not [t for t in traced_ops if "tanh" in t or "gelu" in t], traced_ops
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)
