"""FLUX.1 ControlNets per request: diffserve against Diffusers' `FluxControlNetPipeline` on one tiny FLUX
folder and tiny random ControlNets (Diffusers layout), same seed, fp32, PSNR >= 40 dB: one ControlNet
(Diffusers' keywords), a Union ControlNet's mode, two ControlNets in one request (Diffusers'
`FluxMultiControlNetModel`, with a start fraction) and true CFG; each with a control run (another control
image, another mode, one ControlNet left out) that must score well below the bar. Then step batching:
requests with other ControlNets, images and scales, and requests without any, share one DiT batch, each
as it is alone; the rows without a ControlNet bit for bit. Then the refusals of bad entries, and the
Python API's masks (`control_mask` and an entry's `mask`, either convention decoded as an "L" mask; a bad
one refused naming its entry, one on these non-inpainting ControlNets refused by the pipeline).
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from controlnet_checks import (
    ControlNetRequests,
    assert_controlnets_refused,
    assert_plain_row_unaffected,
    load_controlnet_folder,
)
from diffusers import FluxControlNetImg2ImgPipeline, FluxControlNetInpaintPipeline, FluxControlNetPipeline
from diffusers import FluxControlNetModel as DiffusersControlNet
from diffusers import FluxPipeline as DiffusersFluxPipeline
from diffusers.models.controlnets.controlnet_flux import FluxMultiControlNetModel
from PIL import Image

from diffserve import DiffGenerator, SamplingParams
from diffserve.api import controlnet_entries
from diffserve.configs.engine_args import ControlNetSpec
from diffserve.configs.sampling_params import ControlNetChoice
from diffserve.errors import InvalidRequestError, UserError
from diffserve.families.flux.tiny import TinyFluxSpec, build_tiny_flux
from diffserve.families.flux.tiny_controlnet import (
    TinyFluxControlNetSpec,
    build_tiny_flux_controlnet,
    build_tiny_flux_controlnet_pipeline,
)
from diffserve.loader.controlnets import load_controlnets
from diffserve.stages.input_validation import ImageInputRule, InputValidationStage
from diffserve.testing.parity import assert_batched_as_alone, assert_images_match, smooth_random_image

PSNR_BAR_DB = 40.0
PROMPT = "a fox in the snow"
HEIGHT, WIDTH = 48, 80  # non-square: the packed grid's rows and columns differ
KW = dict(num_inference_steps=3, max_sequence_length=16, guidance_scale=3.5)
EDGES = smooth_random_image(WIDTH, HEIGHT, seed=11)
DEPTH = smooth_random_image(WIDTH, HEIGHT, seed=12)
OTHER = smooth_random_image(WIDTH, HEIGHT, seed=13)
UNION_MODES = 4
REQUESTS = ControlNetRequests(PROMPT, HEIGHT, WIDTH, KW)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-flux-controlnet")
    flux = TinyFluxSpec(seed=0)
    folder = build_tiny_flux(root / "flux", flux)
    canny = build_tiny_flux_controlnet(root / "canny", TinyFluxControlNetSpec(flux, seed=1))
    union = build_tiny_flux_controlnet(
        root / "union",
        TinyFluxControlNetSpec(flux, num_layers=2, num_single_layers=1, num_mode=UNION_MODES, seed=2),
    )
    ours = DiffGenerator.from_pretrained(
        folder, device="cpu", show_progress=False, controlnets={"canny": canny, "union": union}
    )
    base = DiffusersFluxPipeline.from_pretrained(folder, dtype=torch.float32)
    nets = {
        name: DiffusersControlNet.from_pretrained(path) for name, path in (("canny", canny), ("union", union))
    }

    def reference(
        controlnet, seed: int, cls=FluxControlNetPipeline, requests: ControlNetRequests = REQUESTS, **kwargs
    ) -> np.ndarray:
        accepted = inspect.signature(cls.__init__).parameters
        pipe = cls(**{k: v for k, v in base.components.items() if k in accepted}, controlnet=controlnet)
        pipe.set_progress_bar_config(disable=True)
        return requests.reference(pipe, seed, **kwargs)

    return ours, nets, reference


generate = REQUESTS.generate


def test_one_controlnet_matches_diffusers(setup) -> None:
    ours, nets, reference = setup
    entry = {"name": "canny", "image": EDGES, "scale": 0.8}
    got = generate(ours, 5, controlnets=[entry])
    ref = reference(nets["canny"], 5, control_image=EDGES, controlnet_conditioning_scale=0.8)
    other = generate(ours, 5, controlnets=[{**entry, "image": OTHER}])
    assert_images_match(got, ref, "one ControlNet", min_db=PSNR_BAR_DB, control=other)
    assert_images_match(generate(ours, 5, controlnets=[{**entry, "image": EDGES}]), got, "again", min_db=99)


def test_union_mode_matches_diffusers(setup) -> None:
    """A Union ControlNet's mode token (one of 17 text tokens here: another mode moves the tiny model's
    output less than another image does, but it moves it)."""
    ours, nets, reference = setup
    got = generate(ours, 7, controlnets=[ControlNetChoice("union", DEPTH, scale=0.7, mode=2)])
    ref = reference(nets["union"], 7, control_image=DEPTH, controlnet_conditioning_scale=0.7, control_mode=2)
    other = generate(ours, 7, controlnets=[ControlNetChoice("union", OTHER, scale=0.7, mode=2)])
    assert_images_match(got, ref, "Union ControlNet mode 2", min_db=PSNR_BAR_DB, control=other)
    other_mode = generate(ours, 7, controlnets=[ControlNetChoice("union", DEPTH, scale=0.7, mode=0)])
    assert not np.array_equal(other_mode, got)


def test_two_controlnets_with_a_start_and_true_cfg_match_diffusers_multi(setup) -> None:
    ours, nets, reference = setup
    cfg = dict(true_cfg_scale=2.0, negative_prompt="blurry")
    entries = [
        {"name": "canny", "image": EDGES, "scale": 0.6},
        {"name": "union", "image": DEPTH, "scale": 0.9, "start": 0.34, "mode": 1},
    ]
    got = generate(ours, 9, controlnets=entries, **cfg)
    ref = reference(
        FluxMultiControlNetModel([nets["canny"], nets["union"]]), 9,
        control_image=[EDGES, DEPTH], controlnet_conditioning_scale=[0.6, 0.9],
        control_guidance_start=[0.0, 0.34], control_guidance_end=[1.0, 1.0], control_mode=[None, 1], **cfg,
    )  # fmt: skip
    other = generate(ours, 9, controlnets=entries[:1], **cfg)
    assert_images_match(got, ref, "two ControlNets (Multi), true CFG", min_db=PSNR_BAR_DB, control=other)


def test_guidance_left_unset_is_diffusers_controlnet_default(setup) -> None:
    """`FluxControlNetPipeline` defaults to guidance 7.0 (FluxPipeline: 3.5): a request with a ControlNet
    that leaves it unset gets 7.0. (A 60 dB bar: guidance 3.5 still scores ~40 dB on the tiny model.)"""
    ours, nets, reference = setup
    unset = ControlNetRequests(PROMPT, HEIGHT, WIDTH, {k: v for k, v in KW.items() if k != "guidance_scale"})
    entry = ControlNetChoice("canny", EDGES, scale=0.8)
    got = unset.generate(ours, 2, controlnets=[entry])
    ref = reference(nets["canny"], 2, requests=unset, control_image=EDGES, controlnet_conditioning_scale=0.8)
    other = unset.generate(ours, 2, controlnets=[entry], guidance_scale=3.5)
    assert_images_match(got, ref, "ControlNet, guidance unset", min_db=60.0, control=other)


def test_a_controlnet_pipeline_folder_serves_its_controlnet_with_diffusers_keywords(tmp_path) -> None:
    """A `FluxControlNetPipeline` folder: its `controlnet` is loaded as "default", and Diffusers' keywords
    on `generate` apply it (the one loaded)."""
    folder = build_tiny_flux_controlnet_pipeline(
        tmp_path / "pipe", TinyFluxControlNetSpec(TinyFluxSpec(seed=3), num_mode=2, seed=4)
    )
    ours, pipe = load_controlnet_folder(folder, FluxControlNetPipeline)
    control = dict(
        control_image=EDGES, controlnet_conditioning_scale=1.1, control_guidance_end=0.67, control_mode=1
    )
    got = generate(ours, 3, **control)
    ref = REQUESTS.reference(pipe, 3, **control)
    other = generate(ours, 3, **{**control, "control_image": OTHER})
    assert_images_match(got, ref, "FluxControlNetPipeline folder", min_db=PSNR_BAR_DB, control=other)


def test_diffusers_keywords_become_entries() -> None:
    entries = controlnet_entries(
        None,
        {"control_image": [EDGES, DEPTH], "controlnet_conditioning_scale": [0.5, 0.7], "control_mode": 1},
        ["union"],
    )
    assert [(e.name, e.scale, e.start, e.end, e.mode) for e in entries] == [
        ("union", 0.5, 0.0, 1.0, 1),
        ("union", 0.7, 0.0, 1.0, 1),
    ]
    with pytest.raises(InvalidRequestError, match="controlnet_conditioning_scale lists 3 values"):
        controlnet_entries(
            None, {"control_image": [EDGES], "controlnet_conditioning_scale": [1, 2, 3]}, ["u"]
        )


def _repaint_masks() -> tuple[np.ndarray, Image.Image, Image.Image]:
    """The area to repaint as a bool array, as a white-on-black mask (Diffusers') and as OpenAI's mask
    (alpha 0 there, its colours meaningless)."""
    repaint = np.zeros((HEIGHT, WIDTH), dtype=bool)
    repaint[8:40, 16:56] = True
    white = Image.fromarray(np.where(repaint, 255, 0).astype(np.uint8), mode="L")
    rgb = np.full((HEIGHT, WIDTH, 3), 200, np.uint8)
    alpha = Image.fromarray(np.dstack([rgb, np.where(repaint, 0, 255).astype(np.uint8)]), mode="RGBA")
    return repaint, white, alpha


def test_control_mask_becomes_each_entrys_mask(tmp_path) -> None:
    """`control_mask` (Diffusers' ControlNet inpainting keyword): one mask for every control image, or one
    per image; `controlnets=[{..., "mask": ...}]` too. Either convention becomes an "L" mask, 255 = repaint."""
    repaint, white, alpha = _repaint_masks()
    want = np.where(repaint, 255, 0)
    alpha.save(tmp_path / "mask.png")
    one = controlnet_entries(
        None, {"control_image": [EDGES, DEPTH], "control_mask": tmp_path / "mask.png"}, ["i"]
    )
    per_image = controlnet_entries(
        None, {"control_image": [EDGES, DEPTH], "control_mask": [white, alpha]}, ["i"]
    )
    as_dicts = controlnet_entries(
        [{"name": "i", "image": EDGES, "mask": alpha}, {"name": "i", "image": DEPTH}], {}, []
    )
    for entry in (*one, *per_image, as_dicts[0]):
        assert entry.mask.mode == "L" and entry.mask.size == (WIDTH, HEIGHT)
        assert np.array_equal(np.asarray(entry.mask), want)
    assert as_dicts[1].mask is None
    assert controlnet_entries(None, {"control_image": EDGES}, ["i"])[0].mask is None
    with pytest.raises(InvalidRequestError, match="control_mask lists 3 values") as caught:
        controlnet_entries(None, {"control_image": [EDGES], "control_mask": [white] * 3}, ["i"])
    assert caught.value.param == "control_mask"
    with pytest.raises(InvalidRequestError, match="without control_image"):
        controlnet_entries(None, {"control_mask": white}, ["i"])


@pytest.mark.parametrize("mask", [b"not an image", "/nonexistent/mask.png", 42])
def test_a_bad_control_mask_names_its_entry(mask) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        controlnet_entries(None, {"control_image": [EDGES, DEPTH], "control_mask": [None, mask]}, ["i"])
    assert caught.value.param == "controlnets[1].mask", caught.value
    with pytest.raises(InvalidRequestError) as caught:
        controlnet_entries([{"name": "i", "image": EDGES, "mask": mask}], {}, [])
    assert caught.value.param == "controlnets[0].mask", caught.value


@pytest.mark.parametrize("inpaint", [False, True])
def test_with_an_input_image_matches_diffusers_img2img_and_inpaint(setup, inpaint) -> None:
    """Diffusers' `FluxControlNetImg2ImgPipeline` / `FluxControlNetInpaintPipeline`: the control image's
    posterior draw comes before the input image's."""
    ours, nets, reference = setup
    mask = Image.new("L", (WIDTH, HEIGHT), 0)
    mask.paste(255, (16, 8, 56, 40))
    inputs = dict(image=OTHER, strength=0.7, **({"mask": mask} if inpaint else {}))
    entry = {"name": "canny", "image": EDGES, "scale": 0.8}
    got = generate(ours, 5, controlnets=[entry], **inputs)
    cls = FluxControlNetInpaintPipeline if inpaint else FluxControlNetImg2ImgPipeline
    ref = reference(
        nets["canny"], 5, cls=cls, image=OTHER, strength=0.7, control_image=EDGES,
        controlnet_conditioning_scale=0.8, **({"mask_image": mask} if inpaint else {}),
    )  # fmt: skip
    other = generate(ours, 5, controlnets=[{**entry, "image": DEPTH}], **inputs)
    what = "inpaint" if inpaint else "img2img"
    assert_images_match(got, ref, f"one ControlNet, {what}", min_db=PSNR_BAR_DB, control=other)


def test_diffusers_keywords_need_one_loaded_controlnet(setup) -> None:
    ours, _, _ = setup
    with pytest.raises(InvalidRequestError, match="2 are loaded"):
        generate(ours, 1, control_image=EDGES)


def test_a_mask_for_a_controlnet_that_is_not_an_inpainting_one_is_refused(setup) -> None:
    ours, _, _ = setup
    _, white, _ = _repaint_masks()
    with pytest.raises(
        InvalidRequestError, match=r"controlnets\[0\]\.mask.*'canny' is not an inpainting"
    ) as caught:
        generate(ours, 1, controlnets=[{"name": "canny", "image": EDGES, "mask": white}])
    assert caught.value.param == "controlnets"


_params = REQUESTS.params


def test_requests_with_other_controlnets_batch_as_alone(setup) -> None:
    ours, _, _ = setup
    params = [
        _params("canny strong", 1, [ControlNetChoice("canny", EDGES, scale=1.2)]),
        _params("canny weak other image", 2, [ControlNetChoice("canny", OTHER, scale=0.4, end=0.67)]),
        _params("union and canny", 3, [ControlNetChoice("union", DEPTH, mode=3), ControlNetChoice("canny", EDGES)]),
        _params("no controlnet", 4),
    ]  # fmt: skip
    assert assert_batched_as_alone(ours, params, "ControlNet batch")[0] == 4


def test_controlnets_next_to_a_block_range_cache_batch_as_alone(setup) -> None:
    """DBCache runs the DiT's blocks in ranges over some rows: the residuals follow the rows it computes."""
    ours, _, _ = setup
    dbcache = {"method": "dbcache", "Fn_compute_blocks": 1, "Bn_compute_blocks": 0}
    kw = {**KW, "num_inference_steps": 5, "height": HEIGHT, "width": WIDTH}
    params = [
        SamplingParams(prompt="ctrl", seed=1, controlnets=[ControlNetChoice("canny", EDGES, 0.9)], **kw),
        SamplingParams(prompt="cached", seed=2, cache=dbcache, **kw),
        SamplingParams(
            prompt="ctrl and cache", seed=3, cache=dbcache, **kw,
            controlnets=[ControlNetChoice("union", DEPTH, 0.5, start=0.2, mode=1)],
        ),
    ]  # fmt: skip
    assert_batched_as_alone(ours, params, "ControlNets next to DBCache")


def test_rows_without_a_controlnet_are_bit_identical(setup) -> None:
    """The same request without a ControlNet, batched next to a controlled request and next to the same
    request without its ControlNet: bit-identical images."""
    ours, _, _ = setup
    controlled = _params("neighbour", 1, [ControlNetChoice("canny", EDGES, scale=1.5)])
    assert_plain_row_unaffected(ours, _params("plain", 4), controlled, _params("neighbour", 1))


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (ControlNetChoice("nope", EDGES), r"controlnets\[0\].name 'nope' is not a ControlNet"),
        (ControlNetChoice("canny", None), r"controlnets\[0\].image is missing"),
        (ControlNetChoice("canny", EDGES, scale=11.0), r"controlnets\[0\].scale"),
        (ControlNetChoice("canny", EDGES, scale=float("nan")), r"controlnets\[0\].scale"),
        (ControlNetChoice("canny", EDGES, start=0.5, end=0.5), r"controlnets\[0\].start"),
        (ControlNetChoice("canny", EDGES, mode=1), r"controlnets\[0\].mode.*not a Union"),
        (ControlNetChoice("union", EDGES), r"controlnets\[0\].mode.*Union ControlNet; give a mode in 0..3"),
        (ControlNetChoice("union", EDGES, mode=UNION_MODES), r"controlnets\[0\].mode"),
        (
            ControlNetChoice("canny", EDGES, mask=EDGES.convert("L")),
            r"controlnets\[0\].mask.*not an inpainting",
        ),
    ],
)
def test_bad_entries_are_refused_naming_the_field(setup, entry, message) -> None:
    ours, _, _ = setup
    assert_controlnets_refused(ours, _params("bad", 1, [entry]), message)


def test_a_family_without_controlnets_refuses_the_field() -> None:
    stage = InputValidationStage(
        defaults=SamplingParams(num_inference_steps=2),
        pixel_multiple=16,
        default_pixels=64,
        max_sequence_length_limit=None,
        image_inputs=ImageInputRule(pipeline_name="SanaPipeline"),
    )
    params = SamplingParams(prompt="x", controlnets=[ControlNetChoice("canny", EDGES)])
    with pytest.raises(InvalidRequestError, match="controlnets is not a parameter of SanaPipeline"):
        stage.resolve(params)


def test_other_families_refuse_controlnets() -> None:
    class NoControlNets:
        pass

    spec = ControlNetSpec("canny", "/nonexistent")
    with pytest.raises(
        UserError, match=r"--controlnet: the sana family \(NoControlNets\) takes no ControlNets"
    ):
        load_controlnets([spec], None, NoControlNets(), "sana", platform=None, dtype=torch.float32)
