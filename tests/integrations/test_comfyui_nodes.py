"""The ComfyUI node pack (`integrations/comfyui/`) against real `diffserve serve` processes.

Three servers start together (module-scoped): the session's tiny FLUX (text to image, image to image
and inpainting edits, an API key, a LoRA loaded at start and a --lora-dir, a tiny ControlNet), a tiny FLUX.1 Kontext
(instruction edits) and a tiny Wan 2.1 text-to-video.
Each node's output is compared with the server's answer to the same request sent directly with httpx
and decoded here independently (PIL, PyAV): equal to the bit, as ComfyUI IMAGE tensors (float32
B x H x W x 3, uint8 levels / 255). Without a server: the node declarations, the mask conversion
(read back by the server's own mask reader) and importing the pack without diffserve or ComfyUI.
"""

from __future__ import annotations

import base64
import inspect
import io
import subprocess
import sys
import time
from pathlib import Path

import av
import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from server_process import start_server

from diffserve.masks import edit_mask
from diffserve.testing.ports import unassigned_port

PACK_DIR = Path(__file__).resolve().parents[2] / "integrations" / "comfyui"
API_KEY = "comfy-key-42"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
SIZE, STEPS, SEED = 32, 2, 7
VIDEO_FRAMES, VIDEO_FPS = 5, 8


# -- servers -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def servers(tiny_flux_dir, tmp_path_factory):
    """All three servers, started at once (their start-ups overlap); each fixture below waits for its own."""
    from diffserve.families.flux.tiny import TinyFluxSpec
    from diffserve.families.flux.tiny_controlnet import TinyFluxControlNetSpec, build_tiny_flux_controlnet
    from diffserve.families.flux.tiny_kontext import build_tiny_flux_kontext
    from diffserve.families.wan.tiny import TinyWanSpec, build_tiny_wan
    from diffserve.testing.tiny_lora import write_random_lora

    root = tmp_path_factory.mktemp("comfyui")
    lora_dir = root / "loras"
    # std 0.2: visibly different images on the tiny model.
    write_random_lora(tiny_flux_dir, lora_dir / "ink.safetensors", rank=2, seed=1, std=0.2)
    kontext = build_tiny_flux_kontext(root / "tiny-kontext", TinyFluxSpec(seed=3))
    canny = build_tiny_flux_controlnet(root / "canny", TinyFluxControlNetSpec(TinyFluxSpec(seed=0), seed=1))
    wan = build_tiny_wan(root / "tiny-wan", TinyWanSpec())
    work = {name: root / f"{name}-server" for name in ("flux", "kontext", "wan")}
    for folder in work.values():
        folder.mkdir()
    started = {
        "flux": start_server(
            tiny_flux_dir,
            work["flux"],
            "--api-key",
            API_KEY,
            "--lora",
            f"ink={lora_dir / 'ink.safetensors'}",
            "--lora-dir",
            str(lora_dir),
            "--controlnet",
            f"canny={canny}",
        ),  # fmt: skip
        "kontext": start_server(kontext, work["kontext"]),
        "wan": start_server(wan, work["wan"]),
    }
    started["flux"].api_key = API_KEY
    try:
        yield started
    finally:
        for srv in started.values():
            srv.stop()


def ready(servers, name: str):
    srv = servers[name]
    srv.wait_ready()
    return srv


@pytest.fixture(scope="module")
def flux(servers):
    return ready(servers, "flux")


@pytest.fixture(scope="module")
def kontext(servers):
    return ready(servers, "kontext")


@pytest.fixture(scope="module")
def wan(servers):
    return ready(servers, "wan")


# -- helpers -----------------------------------------------------------------------------------------
def run_node(pack, name: str, **inputs) -> tuple:
    """Call node `name` as ComfyUI does (an instance, FUNCTION by name, inputs as keywords) and check the
    outputs against RETURN_TYPES."""
    cls = pack.NODE_CLASS_MAPPINGS[name]
    outputs = getattr(cls(), cls.FUNCTION)(**inputs)
    assert isinstance(outputs, tuple) and len(outputs) == len(cls.RETURN_TYPES), outputs
    for kind, value in zip(cls.RETURN_TYPES, outputs, strict=True):
        if kind == "IMAGE":
            assert value.dtype == torch.float32 and value.ndim == 4 and value.shape[-1] == 3, value.shape
            assert value.min().item() >= 0.0 and value.max().item() <= 1.0
        elif kind in ("FLOAT", "STRING"):
            assert isinstance(value, float if kind == "FLOAT" else str), value
        elif kind == "DIFFSERVE_LORAS":
            assert isinstance(value, list) and all(set(entry) == {"name", "scale"} for entry in value)
        elif kind == "DIFFSERVE_CONTROLNETS":
            keys = {"name", "image", "scale", "start", "end"}
            optional = {"mode", "mask"}
            assert isinstance(value, list) and all(keys <= set(entry) <= keys | optional for entry in value)
    return outputs


def sampling(**overrides) -> dict:
    """Generate-node inputs for a tiny request; `overrides` replace or add inputs."""
    inputs = {
        "prompt": "a red fox", "negative_prompt": "", "width": SIZE, "height": SIZE, "steps": STEPS,
        "guidance": 3.5, "seed": SEED, "n": 1, "quality": "auto",
    }  # fmt: skip
    return {**inputs, **overrides}


def as_tensor(png: bytes) -> torch.Tensor:
    """A PNG as ComfyUI's H x W x 3 float tensor, decoded here (not by the pack)."""
    with Image.open(io.BytesIO(png)) as image:
        return torch.from_numpy(np.asarray(image.convert("RGB")).astype(np.float32) / 255.0)


def direct_images(answer: httpx.Response) -> torch.Tensor:
    assert answer.status_code == 200, answer.text
    return torch.stack([as_tensor(base64.b64decode(item["b64_json"])) for item in answer.json()["data"]])


def png_of(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


# -- without a server --------------------------------------------------------------------------------
def test_node_declarations_are_consistent(pack) -> None:
    assert set(pack.NODE_CLASS_MAPPINGS) == {
        "DiffserveGenerate",
        "DiffserveEdit",
        "DiffserveVideo",
        "DiffserveLoras",
        "DiffserveControlNet",
    }
    assert set(pack.NODE_DISPLAY_NAME_MAPPINGS) == set(pack.NODE_CLASS_MAPPINGS)
    for name, cls in pack.NODE_CLASS_MAPPINGS.items():
        assert cls.CATEGORY == "diffserve", name
        assert isinstance(cls.RETURN_TYPES, tuple) and isinstance(cls.RETURN_NAMES, tuple), name
        assert len(cls.RETURN_NAMES) == len(cls.RETURN_TYPES), name
        assert isinstance(inspect.getattr_static(cls, "INPUT_TYPES"), classmethod), name
        declared = cls.INPUT_TYPES()
        assert set(declared) <= {"required", "optional"} and declared["required"], name
        function = getattr(cls, cls.FUNCTION)
        params = dict(inspect.signature(function).parameters)
        params.pop("self")
        required, optional = declared["required"], declared.get("optional", {})
        # ComfyUI passes every input by its name: the function takes exactly the declared inputs, the
        # optional ones with a default (an unconnected optional input is not passed).
        assert set(params) == set(required) | set(optional), name
        assert all(params[n].default is inspect.Parameter.empty for n in required), name
        assert all(params[n].default is not inspect.Parameter.empty for n in optional), name
        for input_name, spec in {**required, **optional}.items():
            kind, options = spec[0], spec[1] if len(spec) > 1 else {}
            if isinstance(kind, list):  # a combo: its default is one of its values
                assert options.get("default", kind[0]) in kind, (name, input_name)
            elif kind in ("INT", "FLOAT"):
                assert options["min"] <= options["default"] <= options["max"], (name, input_name)


def test_pack_imports_without_diffserve_comfyui_requests_or_pyav() -> None:
    # As inside ComfyUI's process: diffserve is not importable, `comfy` may not be, `requests` is not used
    # and PyAV is needed by the Video node only.
    code = (
        "import sys, importlib.util\n"
        "for blocked in ('diffserve', 'comfy', 'requests', 'av'): sys.modules[blocked] = None\n"
        f"spec = importlib.util.spec_from_file_location('pack', {str(PACK_DIR / '__init__.py')!r}, "
        f"submodule_search_locations=[{str(PACK_DIR)!r}])\n"
        "module = importlib.util.module_from_spec(spec); sys.modules['pack'] = module\n"
        "spec.loader.exec_module(module)\n"
        "print(sorted(module.NODE_CLASS_MAPPINGS))\n"
        "try:\n"
        "    module.NODE_CLASS_MAPPINGS['DiffserveVideo']().video('http://127.0.0.1:9', 'p', '', 0, 0, 0, 0, 0, -1.0,"
        " 0, 'auto')\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "DiffserveGenerate" in done.stdout
    # Without PyAV the Video node says how to install it, before it starts a job.
    assert "install it in ComfyUI's Python environment (pip install av)" in done.stdout


def test_mask_becomes_an_openai_mask_the_server_reads_as_the_edited_area(pack) -> None:
    # ComfyUI: 1 = edit. The PNG: alpha 0 (transparent) where edited, as OpenAI's masks; read back by
    # the server's own mask reader (diffserve.masks.edit_mask) as 255 exactly there.
    mask = torch.zeros(6, 8)
    mask[1:4, 2:6] = 1.0
    mask[0, 0], mask[5, 7], mask[5, 6] = 0.5, 0.49, 0.75  # the server binarizes at 0.5 too
    with Image.open(io.BytesIO(pack.images.mask_png(mask))) as image:
        assert image.mode == "RGBA" and image.size == (8, 6)
        alpha = np.asarray(image)[..., 3]
        server_view = np.asarray(edit_mask(image))
    edited = (mask >= 0.5).numpy()
    assert np.array_equal(alpha == 0, edited) and set(np.unique(alpha)) == {0, 255}
    assert np.array_equal(server_view, np.where(edited, 255, 0))
    # Nothing to edit: no transparent pixel, and the server's luminance fallback reads all "keep".
    with Image.open(io.BytesIO(pack.images.mask_png(torch.zeros(4, 4)))) as image:
        assert np.asarray(edit_mask(image)).max() == 0


def test_masks_are_matched_to_the_images(pack) -> None:
    masks_for = pack.images.masks_for
    assert len(masks_for(torch.ones(4, 5), 3, 4, 5)) == 3  # one H x W mask for every image
    assert len(masks_for(torch.ones(2, 4, 5), 2, 4, 5)) == 2
    with pytest.raises(ValueError, match="mask is 6x4 but the image is 5x4"):
        masks_for(torch.ones(1, 4, 6), 1, 4, 5)
    with pytest.raises(ValueError, match="2 masks for 3 images"):
        masks_for(torch.ones(2, 4, 5), 3, 4, 5)


def test_lora_selection_text(pack) -> None:
    parse = pack.loras.parse_selection
    assert parse("ink:0.8, detail\n bold : -0.5\n") == [
        {"name": "ink", "scale": 0.8}, {"name": "detail", "scale": 1.0}, {"name": "bold", "scale": -0.5},
    ]  # fmt: skip
    assert parse("  ") == []
    with pytest.raises(ValueError, match="is not NAME or NAME:SCALE"):
        parse("../etc")
    with pytest.raises(ValueError, match="is not a number"):
        parse("ink:strong")


def test_unreachable_server_names_the_url(pack) -> None:
    url = f"http://127.0.0.1:{unassigned_port()}"
    with pytest.raises(
        pack.client.DiffserveError, match=r"cannot reach the diffserve server at http://127\.0\.0\.1"
    ):
        run_node(pack, "DiffserveGenerate", server_url=url, **sampling())
    with pytest.raises(pack.client.DiffserveError, match="server_url must be an http"):
        run_node(pack, "DiffserveGenerate", server_url="127.0.0.1:30000", **sampling())


# -- text to image, LoRAs, errors (tiny FLUX) ---------------------------------------------------------
def test_generate_equals_the_servers_images(pack, flux) -> None:
    (images,) = run_node(
        pack, "DiffserveGenerate", server_url=f"{flux.base_url}/v1", api_key=API_KEY, **sampling(n=2)
    )
    body = {
        "prompt": "a red fox", "width": SIZE, "height": SIZE, "num_inference_steps": STEPS, "guidance_scale": 3.5,
        "seed": SEED, "n": 2,
    }  # fmt: skip
    expected = direct_images(
        httpx.post(f"{flux.base_url}/v1/images/generations", json=body, headers=AUTH, timeout=120)
    )
    assert images.shape == (2, SIZE, SIZE, 3)
    assert torch.equal(images, expected)
    assert not torch.equal(images[0], images[1])  # n images, not one image n times


def test_controlnet_node_feeds_generate_as_the_server_answers(pack, flux) -> None:
    rng = np.random.default_rng(5)
    control = rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)
    control_tensor = torch.from_numpy(control.astype(np.float32) / 255.0)[None]
    server = {"server_url": f"{flux.base_url}/v1", "api_key": API_KEY}
    # An empty name takes the only ControlNet loaded; the server's list comes back as `available`.
    controlnets, available = run_node(
        pack,
        "DiffserveControlNet",
        **server,
        image=control_tensor,
        controlnet="",
        scale=0.8,
        start=0.0,
        end=0.9,
    )
    assert available == "canny"
    (entry,) = controlnets
    assert (entry["name"], entry["scale"], entry["start"], entry["end"]) == ("canny", 0.8, 0.0, 0.9)
    assert base64.b64decode(entry["image"].split(",", 1)[1]) == png_of(control)
    (images,) = run_node(pack, "DiffserveGenerate", **server, **sampling(), controlnets=controlnets)
    body = {
        "prompt": "a red fox", "width": SIZE, "height": SIZE, "num_inference_steps": STEPS, "guidance_scale": 3.5,
        "seed": SEED, "n": 1,
        "controlnets": [{"name": "canny", "image": base64.b64encode(png_of(control)).decode(), "scale": 0.8,
                         "start": 0.0, "end": 0.9}],
    }  # fmt: skip
    expected = direct_images(
        httpx.post(f"{flux.base_url}/v1/images/generations", json=body, headers=AUTH, timeout=120)
    )
    assert torch.equal(images, expected)
    (plain,) = run_node(pack, "DiffserveGenerate", **server, **sampling())
    assert (images - plain).abs().mean().item() > 1 / 255  # the ControlNet acted
    with pytest.raises(ValueError, match="no ControlNet named 'depth'.*serves: canny"):
        run_node(pack, "DiffserveControlNet", **server, image=control_tensor, controlnet="depth", scale=1.0,
                 start=0.0, end=1.0)  # fmt: skip


def test_controlnet_node_sends_a_mask_the_server_reads(pack, flux) -> None:
    """An inpainting ControlNet's mask (ComfyUI: 1 = repaint) goes as the Edit node's masks do; the server
    decodes it, and this plain ControlNet refuses it naming the entry's mask."""
    control = torch.rand(1, SIZE, SIZE, 3, generator=torch.Generator().manual_seed(5))
    mask = torch.zeros(2, SIZE, SIZE)
    mask[0, 4:20, 8:24] = 1.0  # the batch's first is sent
    server = {"server_url": f"{flux.base_url}/v1", "api_key": API_KEY}
    inputs = dict(**server, image=control, controlnet="canny", scale=1.0, start=0.0, end=1.0)
    (controlnets, _) = run_node(pack, "DiffserveControlNet", **inputs, mask=mask)
    (entry,) = controlnets
    assert entry["mask"].startswith("data:image/png;base64,")
    with Image.open(io.BytesIO(base64.b64decode(entry["mask"].split(",", 1)[1]))) as image:
        assert np.array_equal(np.asarray(edit_mask(image)), np.where(mask[0].numpy() >= 0.5, 255, 0))
    with pytest.raises(
        pack.client.DiffserveError, match=r"controlnets\[0\]\.mask.*not an inpainting"
    ) as caught:
        run_node(pack, "DiffserveGenerate", **server, **sampling(), controlnets=controlnets)
    assert caught.value.status == 400
    with pytest.raises(ValueError, match="mask is 8x8 but the image is"):
        run_node(pack, "DiffserveControlNet", **inputs, mask=torch.ones(8, 8))


def test_api_key_from_the_environment(pack, flux, monkeypatch) -> None:
    inputs = {"server_url": flux.base_url, **sampling(steps=1)}
    with pytest.raises(pack.client.DiffserveError, match="answered 401") as caught:
        run_node(pack, "DiffserveGenerate", **inputs)
    assert caught.value.status == 401
    monkeypatch.setenv("DIFFSERVE_API_KEY", API_KEY)
    (images,) = run_node(pack, "DiffserveGenerate", **inputs)
    assert images.shape == (1, SIZE, SIZE, 3)


def test_server_error_text_reaches_the_user(pack, flux) -> None:
    body = {"prompt": "a red fox", "width": 33, "height": SIZE, "num_inference_steps": STEPS, "seed": SEED}
    direct = httpx.post(f"{flux.base_url}/v1/images/generations", json=body, headers=AUTH, timeout=60)
    assert direct.status_code == 400, direct.text
    message = direct.json()["error"]["message"]
    with pytest.raises(pack.client.DiffserveError) as caught:
        run_node(pack, "DiffserveGenerate", server_url=flux.base_url, api_key=API_KEY, **sampling(width=33))
    assert message in str(caught.value) and "answered 400 to POST /v1/images/generations" in str(caught.value)
    assert caught.value.status == 400


def test_loras_node_lists_and_selects_and_generate_applies_them(pack, flux) -> None:
    first, available = run_node(
        pack, "DiffserveLoras", server_url=flux.base_url, api_key=API_KEY, selection="ink:0.8"
    )
    assert available == "ink" and first == [{"name": "ink", "scale": 0.8}]
    # Chained: a --lora-dir server may be asked for a name it has not read yet; the request decides.
    chained, _ = run_node(
        pack, "DiffserveLoras", server_url=flux.base_url, api_key=API_KEY, selection="later", loras=first
    )
    assert chained == [{"name": "ink", "scale": 0.8}, {"name": "later", "scale": 1.0}]

    inputs = {"server_url": flux.base_url, "api_key": API_KEY, **sampling()}
    (styled,) = run_node(pack, "DiffserveGenerate", **inputs, loras=first)
    (plain,) = run_node(pack, "DiffserveGenerate", **inputs)
    body = {
        "prompt": "a red fox", "width": SIZE, "height": SIZE, "num_inference_steps": STEPS, "guidance_scale": 3.5,
        "seed": SEED, "loras": [{"name": "ink", "scale": 0.8}],
    }  # fmt: skip
    expected = direct_images(
        httpx.post(f"{flux.base_url}/v1/images/generations", json=body, headers=AUTH, timeout=120)
    )
    assert torch.equal(styled, expected)
    assert (styled - plain).abs().max().item() > 0.02  # the adapter changes the image
    with pytest.raises(pack.client.DiffserveError, match="answered 400") as caught:
        run_node(pack, "DiffserveGenerate", **inputs, loras=chained)  # "later" is not in the --lora-dir
    assert "later" in str(caught.value)


# -- edits (tiny FLUX.1 Kontext; with a mask, inpainting on the tiny FLUX) ---------------------------
EDIT_FIELDS = {
    "prompt": "make it blue", "width": str(SIZE), "height": str(SIZE), "num_inference_steps": str(STEPS),
    "guidance_scale": "3.5", "seed": str(SEED), "n": "1",
}  # fmt: skip


def direct_edit(srv, pixels: np.ndarray, mask: np.ndarray | None = None, **fields: str) -> torch.Tensor:
    """The server's answer to a multipart edit of `pixels` (uint8 H x W x 3), with an RGBA `mask`."""
    files = [("image", ("in.png", png_of(pixels), "image/png"))]
    if mask is not None:
        files.append(("mask", ("mask.png", png_of(mask), "image/png")))
    answer = httpx.post(
        f"{srv.base_url}/v1/images/edits", data={**EDIT_FIELDS, **fields}, files=files, headers=srv.headers,
        timeout=120,
    )  # fmt: skip
    return direct_images(answer)


def test_edit_equals_the_servers_images(pack, kontext) -> None:
    pixels = np.random.default_rng(0).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)
    image = torch.from_numpy(pixels.astype(np.float32) / 255.0)[None]
    (images,) = run_node(
        pack, "DiffserveEdit", server_url=kontext.base_url, image=image, **sampling(prompt="make it blue")
    )
    assert images.shape == (1, SIZE, SIZE, 3)
    assert torch.equal(images, direct_edit(kontext, pixels))


def test_edit_with_a_mask_equals_the_servers_inpainting(pack, flux) -> None:
    # The tiny FLUX server inpaints when an edit has a mask (img2img without one). One ComfyUI mask for a
    # batch of two images: two requests, each with the mask as an RGBA PNG; the direct requests send an
    # OpenAI mask built here (transparent = edit), and the answers must be the same.
    pixels = np.random.default_rng(1).integers(0, 256, (2, SIZE, SIZE, 3), dtype=np.uint8)
    batch = torch.from_numpy(pixels.astype(np.float32) / 255.0)
    mask = torch.zeros(1, SIZE, SIZE)
    mask[:, 8:24, 4:20] = 1.0
    rgba = np.zeros((SIZE, SIZE, 4), dtype=np.uint8)  # black, opaque: keep
    rgba[..., 3] = 255
    rgba[8:24, 4:20, 3] = 0  # transparent: edit (the pack's PNG is also white there; colour is ignored)
    inputs = {
        "server_url": flux.base_url,
        "api_key": API_KEY,
        "image": batch,
        **sampling(prompt="make it blue"),
    }
    (inpainted,) = run_node(pack, "DiffserveEdit", **inputs, mask=mask, strength=0.9)
    (whole,) = run_node(pack, "DiffserveEdit", **inputs, strength=0.9)
    assert inpainted.shape == whole.shape == (2, SIZE, SIZE, 3)
    for i in range(2):
        assert torch.equal(inpainted[i : i + 1], direct_edit(flux, pixels[i], rgba, strength="0.9")), i
        assert torch.equal(whole[i : i + 1], direct_edit(flux, pixels[i], strength="0.9")), i
    assert not torch.equal(inpainted, whole)  # the mask reached the server


def test_loras_node_refuses_a_name_a_server_cannot_serve(pack, kontext) -> None:
    with pytest.raises(pack.client.DiffserveError, match=r"no LoRA named 'missing' \(it serves: none\)"):
        run_node(pack, "DiffserveLoras", server_url=kontext.base_url, selection="missing:0.5")


# -- video (tiny Wan 2.1 text-to-video) ----------------------------------------------------------------
def decode(data: bytes) -> tuple[torch.Tensor, float]:
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(stream)])
        return torch.from_numpy(frames.astype(np.float32) / 255.0), float(stream.average_rate)


def test_video_equals_the_servers_mp4(pack, wan) -> None:
    inputs = sampling(
        prompt="a fox running", num_frames=VIDEO_FRAMES, fps=VIDEO_FPS, guidance=5.0, timeout_s=120
    )
    inputs.pop("n")
    frames, fps = run_node(pack, "DiffserveVideo", server_url=wan.base_url, **inputs)
    assert frames.shape == (VIDEO_FRAMES, SIZE, SIZE, 3) and fps == VIDEO_FPS
    body = {
        "prompt": "a fox running", "size": f"{SIZE}x{SIZE}", "num_frames": VIDEO_FRAMES, "fps": VIDEO_FPS,
        "num_inference_steps": STEPS, "guidance_scale": 5.0, "seed": SEED,
    }  # fmt: skip
    job = httpx.post(f"{wan.base_url}/v1/videos", json=body, timeout=30).json()
    deadline = time.monotonic() + 120
    while job["status"] in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.1)
        job = httpx.get(f"{wan.base_url}/v1/videos/{job['id']}", timeout=10).json()
    assert job["status"] == "completed", job
    mp4 = httpx.get(f"{wan.base_url}/v1/videos/{job['id']}/content", timeout=30)
    expected, expected_fps = decode(mp4.content)
    assert torch.equal(frames, expected) and fps == expected_fps


def test_video_timeout_cancels_the_job(pack, wan) -> None:
    inputs = sampling(prompt="a long clip", num_frames=VIDEO_FRAMES, fps=VIDEO_FPS, steps=1000, timeout_s=1)
    inputs.pop("n")
    with pytest.raises(
        pack.client.DiffserveError, match=r"after 1 s \(timeout_s\); it was cancelled"
    ) as caught:
        run_node(pack, "DiffserveVideo", server_url=wan.base_url, **inputs)
    newest = httpx.get(f"{wan.base_url}/v1/videos", params={"limit": 1}, timeout=10).json()["data"][0]
    assert newest["prompt"] == "a long clip" and newest["status"] == "cancelled", newest
    assert f"video {newest['id']} was still" in str(caught.value)


def test_video_errors_reach_the_user(pack, wan) -> None:
    inputs = sampling(num_frames=4, fps=VIDEO_FPS)  # Wan makes 4k+1 frames
    inputs.pop("n")
    direct = httpx.post(
        f"{wan.base_url}/v1/videos",
        json={"prompt": "a red fox", "size": f"{SIZE}x{SIZE}", "num_frames": 4, "fps": VIDEO_FPS},
        timeout=30,
    )
    assert direct.status_code == 400, direct.text
    with pytest.raises(pack.client.DiffserveError) as caught:
        run_node(pack, "DiffserveVideo", server_url=wan.base_url, **inputs)
    assert direct.json()["error"]["message"] in str(caught.value)
    with pytest.raises(ValueError, match="set both width and height"):
        run_node(pack, "DiffserveVideo", server_url=wan.base_url, **{**inputs, "height": 0})
