"""SD3.5 skip-layer guidance: whole generations against Diffusers' StableDiffusion3Pipeline, the
parameter checks (engine, server schema, CLI), and step batching with requests that skip other blocks
or none."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from diffusers import StableDiffusion3Pipeline
from pydantic import ValidationError

from diffserve import DiffGenerator
from diffserve.cli.main import build_parser
from diffserve.configs.sampling_params import SamplingParams
from diffserve.errors import InvalidRequestError
from diffserve.families.sd3.tiny import TinySD3Spec, build_tiny_sd3
from diffserve.server.schemas import ImageGenerationRequest
from diffserve.stages.input_validation import InputValidationStage
from diffserve.testing.image_metrics import psnr_uint8 as psnr

PSNR_BAR_DB = 40.0
NUM_LAYERS = 4
PROMPT = "a red fox in the snow"
#: 6 steps, window (0.2, 0.7): Diffusers guides the steps i with 1.2 < i < 4.2, so 2, 3 and 4 of 0..5.
BASE = dict(height=64, width=64, num_inference_steps=6, guidance_scale=5.0, max_sequence_length=16)
#: A larger scale than Diffusers' 2.8 default: on the tiny random model it then visibly moves pixels.
WINDOW = dict(skip_layer_guidance_start=0.2, skip_layer_guidance_stop=0.7, skip_layer_guidance_scale=6.0)
GUIDED_STEPS = 3


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    spec = TinySD3Spec(num_layers=NUM_LAYERS, qk_norm="rms_norm", dual_attention_layers=(0,))
    root = build_tiny_sd3(tmp_path_factory.mktemp("sd35_slg"), spec)
    return (
        DiffGenerator.from_pretrained(root, device="cpu", show_progress=False, batch_policy="throughput"),
        StableDiffusion3Pipeline.from_pretrained(root, torch_dtype=torch.float32),
    )


class ForwardLog:
    """Every DiT forward's (rows, skipped blocks), recorded by a forward pre-hook."""

    def __init__(self, transformer: torch.nn.Module) -> None:
        self.calls: list[tuple[int, tuple[int, ...]]] = []
        self._handle = transformer.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs) -> None:
        self.calls.append((kwargs["hidden_states"].shape[0], tuple(sorted(kwargs.get("skip_layers", ())))))

    def close(self) -> None:
        self._handle.remove()


def _ours(engine: DiffGenerator, seed: int = 3, **extra) -> np.ndarray:
    out = engine.generate(prompt=PROMPT, seed=seed, **BASE, **extra)
    return np.asarray(out.images[0])


def _transformer(engine: DiffGenerator) -> torch.nn.Module:
    return engine.pipeline.context.get("transformer")


def test_slg_matches_diffusers_and_changes_the_image(engines) -> None:
    ours, reference = engines
    log = ForwardLog(_transformer(ours))
    try:
        slg = _ours(ours, skip_guidance_layers=[1, 2], **WINDOW)
    finally:
        log.close()
    skipped = [call for call in log.calls if call[1]]
    assert skipped == [(1, (1, 2))] * GUIDED_STEPS, log.calls  # one extra forward at steps 2, 3 and 4
    ref = reference(
        prompt=PROMPT,
        generator=torch.Generator("cpu").manual_seed(3),
        output_type="np",
        skip_guidance_layers=[1, 2],
        **BASE,
        **WINDOW,
    ).images[0]
    ref_u8 = (ref * 255).round().astype(np.uint8)
    assert ref_u8.std() > 5, "the reference image is flat; the comparison would prove nothing"
    value = psnr(slg, ref_u8)
    plain = _ours(ours)
    change = psnr(slg, plain)
    moved = int(np.abs(slg.astype(int) - plain.astype(int)).max())
    print(f"SLG vs Diffusers: {value:.2f} dB; SLG vs no SLG: {change:.2f} dB, max {moved} levels")
    assert value >= PSNR_BAR_DB
    assert change < 30.0 and moved >= 20, "skip-layer guidance did not change the image"
    # A window holding no step (no integer i with 5.4 < i < 6): no extra forward, the plain image bit for bit.
    late = _ours(
        ours, skip_guidance_layers=[1, 2], skip_layer_guidance_start=0.9, skip_layer_guidance_stop=1.0
    )
    assert np.array_equal(late, plain)


def test_slg_requests_batch_with_others(engines) -> None:
    """A plain request and two that skip different blocks share every step's main forward; each skip set
    gets its own extra forward; each image equals the request's own run within one uint8 level."""
    ours, _ = engines
    cases = [
        dict(seed=3),
        dict(seed=4, skip_guidance_layers=[1, 2], **WINDOW),
        dict(seed=5, skip_guidance_layers=[3], **{**WINDOW, "skip_layer_guidance_scale": 1.5}),
    ]
    alone = [_ours(ours, **case) for case in cases]
    log = ForwardLog(_transformer(ours))
    try:
        outputs = ours.generate_many([SamplingParams(prompt=PROMPT, **BASE, **case) for case in cases])
    finally:
        log.close()
    main = [rows for rows, layers in log.calls if not layers]
    assert main == [6] * BASE["num_inference_steps"], log.calls  # 3 requests x CFG rows, every step
    assert sorted(call for call in log.calls if call[1]) == sorted([(1, (1, 2)), (1, (3,))] * GUIDED_STEPS)
    for case, single, out in zip(cases, alone, outputs, strict=True):
        batched = np.asarray(out.images[0])
        diff = np.abs(batched.astype(int) - single.astype(int)).max()
        print(f"batched vs alone {case}: max diff {diff}")
        assert diff <= 1


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        (
            dict(skip_guidance_layers=[1, NUM_LAYERS]),
            "skip_guidance_layers",
            "outside this model's DiT blocks 0..3",
        ),
        (dict(skip_guidance_layers=[]), "skip_guidance_layers", "non-empty list"),
        (dict(skip_guidance_layers=[1, 1]), "skip_guidance_layers", "lists a block twice"),
        (dict(skip_guidance_layers=[-1]), "skip_guidance_layers", "integers >= 0"),
        (dict(skip_guidance_layers=[1], guidance_scale=1.0), "skip_guidance_layers", "guidance_scale > 1"),
        (dict(skip_layer_guidance_scale=-1.0), "skip_layer_guidance_scale", "in [0, 100]"),
        (dict(skip_layer_guidance_scale=float("nan")), "skip_layer_guidance_scale", "in [0, 100]"),
        (dict(skip_layer_guidance_start=1.5), "skip_layer_guidance_start", "in [0, 1]"),
        (
            dict(skip_layer_guidance_start=0.5),
            "skip_layer_guidance_start",
            "must be below",
        ),  # default stop 0.2
    ],
)
def test_bad_slg_values_are_refused(engines, extra, param, message) -> None:
    ours, _ = engines
    with pytest.raises(InvalidRequestError, match=re.escape(message)) as info:
        ours.generate(prompt=PROMPT, **{**BASE, **extra})
    assert info.value.param == param


def test_families_without_slg_refuse_it() -> None:
    stage = InputValidationStage(SamplingParams(num_inference_steps=4), 16, 64, None)
    for name, value in [("skip_guidance_layers", [7]), ("skip_layer_guidance_scale", 2.8)]:
        with pytest.raises(InvalidRequestError, match=f"{name} is not a parameter") as info:
            stage.resolve(SamplingParams(prompt="p", **{name: value}))
        assert info.value.param == name


def test_server_schema_and_cli_flags() -> None:
    body = ImageGenerationRequest(
        prompt="p",
        skip_guidance_layers=[7, 8, 9],
        skip_layer_guidance_scale=3.0,
        skip_layer_guidance_stop=0.3,
    )
    params = body.to_sampling_params()
    assert params.skip_guidance_layers == [7, 8, 9]
    assert (params.skip_layer_guidance_scale, params.skip_layer_guidance_stop) == (3.0, 0.3)
    assert params.skip_layer_guidance_start is None  # the model's default
    for bad in (
        {"skip_guidance_layers": []},
        {"skip_guidance_layers": [-1]},
        {"skip_guidance_layers": ["x"]},
        {"skip_layer_guidance_scale": -0.5},
        {"skip_layer_guidance_start": 1.5},
        {"skip_layer_guidance_stop": float("inf")},
    ):
        with pytest.raises(ValidationError):
            ImageGenerationRequest(prompt="p", **bad)
    args = build_parser().parse_args(
        ["generate", "--model-path", "/m", "--prompt", "p", "--skip-guidance-layers", "7", "8", "9",
         "--skip-layer-guidance-scale", "2.5", "--skip-layer-guidance-start", "0.05",
         "--skip-layer-guidance-stop", "0.25"]
    )  # fmt: skip
    assert args.skip_guidance_layers == [7, 8, 9]
    assert (
        args.skip_layer_guidance_scale,
        args.skip_layer_guidance_start,
        args.skip_layer_guidance_stop,
    ) == (
        2.5,
        0.05,
        0.25,
    )
