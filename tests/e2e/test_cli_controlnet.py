"""FLUX.1 ControlNet from the command line (issue 35): `diffserve make-tiny flux-controlnet DIR` writes a
ControlNet matching `make-tiny flux`'s DiT (refusing a non-empty DIR without --force), and `diffserve generate
--controlnet NAME=PATH --control-image PATH` with Diffusers' keyword flags writes the image the Python API
makes with the same settings; bad values are one `error:` line and exit code 2, before the model loads.
`--control-mask PATH` is read as an "L" mask (white or transparent = repaint); this ControlNet, not an
inpainting one, refuses it once loaded, naming `controlnets[0].mask`."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
from PIL import Image

from diffserve import DiffGenerator
from diffserve.cli.controlnet_flags import with_control_inputs
from diffserve.cli.main import main
from diffserve.configs.sampling_params import ControlNetChoice
from diffserve.testing.parity import smooth_random_image

HEIGHT, WIDTH = 48, 64
COMMON = ["--prompt", "a fox in the snow", "--height", str(HEIGHT), "--width", str(WIDTH)]
COMMON += ["--num-inference-steps", "3", "--seed", "7", "--max-sequence-length", "16"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-controlnet")
    assert main(["make-tiny", "flux", str(root / "flux")]) == 0
    assert main(["make-tiny", "flux-controlnet", str(root / "canny"), "--seed", "3"]) == 0
    smooth_random_image(WIDTH, HEIGHT, seed=5).save(root / "edges.png")
    repaint = np.zeros((HEIGHT, WIDTH), dtype=bool)
    repaint[8:40, 16:48] = True
    Image.fromarray(np.where(repaint, 255, 0).astype(np.uint8), mode="L").save(root / "mask-white.png")
    rgba = np.dstack([np.zeros((HEIGHT, WIDTH, 3), np.uint8), np.where(repaint, 0, 255).astype(np.uint8)])
    Image.fromarray(rgba, mode="RGBA").save(root / "mask-alpha.png")  # OpenAI's: transparent = repaint
    (root / "notes.txt").write_text("not an image")
    return root


def _generate(folders, tmp_path, *flags: str) -> np.ndarray:
    out = tmp_path / "out"
    code = main(["generate", "--model-path", str(folders / "flux"), *COMMON, *flags,
                 "--output-path", str(out), "--output-file-name", "img.png"])  # fmt: skip
    assert code == 0
    return np.asarray(Image.open(out / "img.png").convert("RGB"))


def test_make_tiny_controlnet_refuses_a_non_empty_folder(folders, capfd) -> None:
    assert (folders / "canny" / "config.json").is_file()
    capfd.readouterr()
    assert main(["make-tiny", "flux-controlnet", str(folders / "canny")]) == 2
    err = capfd.readouterr().err
    assert err.startswith("error: ") and "not empty" in err and "--force" in err
    assert main(["make-tiny", "flux-controlnet", str(folders / "canny"), "--force", "--seed", "3"]) == 0


def test_generate_with_a_controlnet_equals_the_python_api(folders, tmp_path) -> None:
    flags = ["--controlnet", f"canny={folders / 'canny'}", "--control-image", str(folders / "edges.png")]
    flags += ["--controlnet-conditioning-scale", "0.8", "--control-guidance-start", "0.0"]
    flags += ["--control-guidance-end", "0.7"]
    cli = _generate(folders, tmp_path / "a", *flags)
    plain = _generate(folders, tmp_path / "b")
    with DiffGenerator.from_pretrained(
        folders / "flux", device="cpu", show_progress=False, controlnets={"canny": folders / "canny"}
    ) as generator:
        out = generator.generate(
            "a fox in the snow", height=HEIGHT, width=WIDTH, num_inference_steps=3, seed=7,
            max_sequence_length=16, control_image=folders / "edges.png", controlnet_conditioning_scale=0.8,
            control_guidance_start=0.0, control_guidance_end=0.7,
        )  # fmt: skip
    api = np.asarray(out.images[0].convert("RGB"))
    assert np.array_equal(cli, api)
    assert np.abs(cli.astype(int) - plain.astype(int)).mean() > 1.0  # the ControlNet acted


@pytest.mark.parametrize(
    ("flags", "part"),
    [
        (
            ["--controlnet-conditioning-scale", "11", "--control-image", "{img}"],
            "--controlnet-conditioning-scale",
        ),
        (["--control-guidance-start", "-0.1", "--control-image", "{img}"], "--control-guidance-start"),
        (
            ["--control-guidance-start", "0.6", "--control-guidance-end", "0.4", "--control-image", "{img}"],
            "must be below --control-guidance-end",
        ),  # fmt: skip
        (["--control-mode", "-1", "--control-image", "{img}"], "--control-mode"),
        (["--controlnet-conditioning-scale", "0.5"], "needs --control-image"),
        (["--control-image", "{folders}/missing.png"], "--control-image"),
        (["--control-mask", "{folders}/mask-white.png"], "--control-mask needs --control-image"),
        (["--control-image", "{img}", "--control-mask", "{folders}/missing.png"], "--control-mask"),
        (["--control-image", "{img}", "--control-mask", "{folders}/notes.txt"], "--control-mask"),
    ],
)
def test_bad_values_are_one_error_line(folders, capfd, flags, part) -> None:
    flags = [f.format(img=folders / "edges.png", folders=folders) for f in flags]
    capfd.readouterr()
    code = main(["generate", "--model-path", str(folders / "flux"), "--prompt", "p", "--controlnet",
                 f"canny={folders / 'canny'}", *flags, "--no-save-output"])  # fmt: skip
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and part in lines[0], err


def test_control_image_needs_a_controlnet(folders, capfd) -> None:
    capfd.readouterr()
    code = main(["generate", "--model-path", str(folders / "flux"), "--prompt", "p", "--control-image",
                 str(folders / "edges.png"), "--no-save-output"])  # fmt: skip
    err = capfd.readouterr().err
    assert code == 2 and err.startswith("error: ") and "--controlnet NAME=PATH" in err, err


@pytest.mark.parametrize("mask", ["mask-white.png", "mask-alpha.png"])
def test_control_mask_is_read_as_an_l_mask(folders, mask) -> None:
    args = argparse.Namespace(control_image=str(folders / "edges.png"), control_mask=str(folders / mask))
    choice = with_control_inputs(ControlNetChoice("canny", scale=0.5), args)
    assert (choice.name, choice.scale, choice.image.mode, choice.image.size) == (
        "canny",
        0.5,
        "RGB",
        (WIDTH, HEIGHT),
    )
    white = np.asarray(Image.open(folders / "mask-white.png"))
    assert choice.mask.mode == "L" and np.array_equal(np.asarray(choice.mask), white)
    args.control_mask = None
    assert with_control_inputs(choice, args).mask is None


def test_a_mask_for_a_controlnet_that_is_not_an_inpainting_one_is_refused(folders, capfd) -> None:
    capfd.readouterr()
    code = main(["generate", "--model-path", str(folders / "flux"), *COMMON, "--controlnet",
                 f"canny={folders / 'canny'}", "--control-image", str(folders / "edges.png"), "--control-mask",
                 str(folders / "mask-white.png"), "--no-save-output"])  # fmt: skip
    err = capfd.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1, err
    assert "controlnets[0].mask" in errors[0] and "not an inpainting ControlNet" in errors[0], err
