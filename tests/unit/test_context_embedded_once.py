"""A request's text (and I2V image) states go through the DiT's embedders once, not once per step.

FLUX's `context_embedder` and Wan's text/image embedders see the same states at every step of a
request; the denoisers embed them at the first step (`Req.dit_context`) and pass `context=` after.
Z-Image's caption embedder and context refiner likewise run once (`refine_captions`), and every step
passes `refined_captions=`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from diffserve.api import DiffGenerator
from diffserve.families.flux.tiny import build_tiny_flux
from diffserve.families.wan.conditioning import WanConditioning
from diffserve.families.wan.pipeline import WanDenoiser
from diffserve.families.wan.tiny import TinyWanSpec, build_tiny_wan
from diffserve.families.z_image.pipeline import ZImageDenoiser
from diffserve.families.z_image.tiny import build_tiny_zimage
from diffserve.models.dits.flux import FluxTransformer2DModel, FluxTransformerConfig
from diffserve.models.dits.z_image import ZImageTransformer2DModel, ZImageTransformerConfig
from diffserve.pipelines.cfg_batch import branch_texts

STEPS = 3


def _count_embeddings(monkeypatch: pytest.MonkeyPatch, dit: torch.nn.Module) -> list[int]:
    """Record the batch size of every `embed_context` call on `dit`."""
    calls: list[int] = []
    original = dit.embed_context

    def counted(states: torch.Tensor, *rest: object) -> object:
        calls.append(states.shape[0])
        return original(states, *rest)

    monkeypatch.setattr(dit, "embed_context", counted)
    return calls


@pytest.fixture(scope="module")
def flux(tmp_path_factory: pytest.TempPathFactory) -> DiffGenerator:
    return DiffGenerator.from_pretrained(
        build_tiny_flux(tmp_path_factory.mktemp("flux")), device="cpu", show_progress=False
    )


@pytest.mark.parametrize("cfg", [False, True], ids=["no-cfg", "true-cfg"])
def test_flux_embeds_each_requests_text_once(
    flux: DiffGenerator, monkeypatch: pytest.MonkeyPatch, cfg: bool
) -> None:
    calls = _count_embeddings(monkeypatch, flux.pipeline.context.get("transformer"))
    extra = {"true_cfg_scale": 2.0, "negative_prompt": "blurry"} if cfg else {}
    flux.generate("a cat", height=32, width=32, num_inference_steps=STEPS, seed=1, **extra)
    assert calls == [2 if cfg else 1]  # one call, both CFG branches in it


def test_flux_context_argument_gives_the_same_prediction() -> None:
    torch.manual_seed(0)
    dit = FluxTransformer2DModel(FluxTransformerConfig(
        in_channels=8, num_layers=1, num_single_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=12, pooled_projection_dim=10, axes_dims_rope=(2, 2, 4),
    )).eval()  # fmt: skip
    g = torch.Generator().manual_seed(1)
    text = torch.randn(2, 5, 12, generator=g)
    inputs = {
        "hidden_states": torch.randn(2, 4, 8, generator=g),
        "pooled_projections": torch.randn(2, 10, generator=g),
        "timestep": torch.tensor([0.2, 0.9]),
        "img_ids": torch.zeros(4, 3),
        "txt_ids": torch.zeros(5, 3),
    }
    with torch.inference_mode():
        from_states = dit(encoder_hidden_states=text, **inputs)
        from_context = dit(encoder_hidden_states=None, context=dit.embed_context(text), **inputs)
        torch.testing.assert_close(from_context, from_states, rtol=0, atol=0)
        with pytest.raises(ValueError, match="exactly one of"):
            dit(encoder_hidden_states=text, context=dit.embed_context(text), **inputs)
        with pytest.raises(ValueError, match="exactly one of"):
            dit(encoder_hidden_states=None, **inputs)


@pytest.mark.parametrize("image_to_video", [False, True], ids=["t2v", "i2v"])
def test_wan_embeds_each_requests_context_once_with_the_same_frames(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, image_to_video: bool
) -> None:
    generator = DiffGenerator.from_pretrained(
        build_tiny_wan(tmp_path / "wan", TinyWanSpec(image_to_video=image_to_video)),
        device="cpu",
        show_progress=False,
    )
    dit = generator.pipeline.context.get("transformer")
    kwargs = {"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": STEPS, "seed": 2,
              "guidance_scale": 4.0, "negative_prompt": "ugly"}  # fmt: skip
    if image_to_video:
        kwargs["image"] = Image.fromarray(
            np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8)
        )
    reference = generator.generate("a boat", **kwargs).frames[0]

    # The same request with the embedders run at every step, as before the cache: same frames.
    monkeypatch.setattr(WanDenoiser, "context_for", _embed_every_step)
    every_step = generator.generate("a boat", **kwargs).frames[0]
    np.testing.assert_array_equal(reference, every_step)

    monkeypatch.undo()
    calls = _count_embeddings(monkeypatch, dit)
    generator.generate("a boat", **kwargs)
    assert calls == [2]  # both CFG branches, once


def _embed_every_step(self, req, expert):  # noqa: ANN001, ANN202 - stands in for WanDenoiser.context_for
    texts = branch_texts(req)
    image_embeds = WanConditioning.of(req).image_embeds
    images = torch.cat([image_embeds] * len(texts)) if image_embeds is not None else None
    return self.transformers[expert].embed_context(torch.cat(texts), images)


def test_zimage_refines_each_requests_captions_once_with_the_same_image(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    generator = DiffGenerator.from_pretrained(
        build_tiny_zimage(tmp_path / "zimage"), device="cpu", show_progress=False
    )
    dit = generator.pipeline.context.get("transformer")
    kwargs = {"height": 64, "width": 64, "num_inference_steps": STEPS, "seed": 3, "guidance_scale": 4.0,
              "negative_prompt": "a long and blurry, low quality negative prompt"}  # fmt: skip
    reference = np.asarray(generator.generate("a lighthouse", **kwargs).images[0])

    # The context refiner run at every step, as before the cache: the same pixels.
    monkeypatch.setattr(ZImageDenoiser, "context_for", _refine_every_step)
    every_step = np.asarray(generator.generate("a lighthouse", **kwargs).images[0])
    np.testing.assert_array_equal(reference, every_step)

    monkeypatch.undo()
    calls: list[int] = []
    refine = dit.refine_captions
    monkeypatch.setattr(
        dit, "refine_captions", lambda captions: calls.append(len(captions)) or refine(captions)
    )
    generator.generate("a lighthouse", **kwargs)
    assert calls == [2]  # the prompt's and the negative prompt's captions, once


def _refine_every_step(self, req):  # noqa: ANN001, ANN202 - stands in for ZImageDenoiser.context_for
    return self.transformer.refine_captions([row for text in branch_texts(req) for row in text.unbind(0)])


def test_zimage_refined_captions_give_the_same_prediction() -> None:
    """Two captions of different lengths (masked), as one request's CFG branches are refined."""
    torch.manual_seed(0)
    dit = ZImageTransformer2DModel(ZImageTransformerConfig(
        in_channels=4, dim=32, n_layers=1, n_refiner_layers=2, n_heads=2, n_kv_heads=2, cap_feat_dim=12,
        axes_dims=(4, 6, 6), axes_lens=(128, 16, 16),
    )).eval()  # fmt: skip
    with torch.no_grad():
        for p in dit.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    g = torch.Generator().manual_seed(1)
    x = [torch.randn(4, 1, 8, 8, generator=g) for _ in range(2)]
    captions = [torch.randn(n, 12, generator=g) for n in (7, 40)]
    t = torch.tensor([0.2, 0.6])
    with torch.inference_mode():
        from_features = dit(x, t, captions)
        refined = dit.refine_captions(captions)
        assert [(r.states.shape[0], r.length) for r in refined] == [(32, 7), (64, 40)]
        from_refined = dit(x, t, refined_captions=refined)
        for a, b in zip(from_refined, from_features, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        with pytest.raises(ValueError, match="exactly one of"):
            dit(x, t, captions, refined_captions=refined)
        with pytest.raises(ValueError, match="exactly one of"):
            dit(x, t)
