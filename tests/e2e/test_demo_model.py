"""The shipped demo model: it draws what held-out prompts ask for, and diffusers draws the same pixels.

(a) prompt adherence on attribute combinations never seen in training, measured by
    `diffserve.demo.shapes_eval` on images from `DiffGenerator` with the folder's recommended settings;
(b) parity: diffusers' `FluxPipeline` on the same folder, same seed and settings, PSNR >= 40 dB;
(c) the measurement itself: right on rendered ground truth, wrong on noise.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from diffserve.configs.demo_model import demo_model_path
from diffserve.configs.sampling_params import SamplingParams
from diffserve.demo import shapes_data as sd
from diffserve.demo import shapes_eval
from diffserve.testing.image_metrics import psnr_uint8 as psnr

MIN_ADHERENCE = 0.80
MIN_PARITY_PSNR_DB = 40.0


@pytest.fixture(scope="module")
def model_dir():
    return demo_model_path()


@pytest.fixture(scope="module")
def settings(model_dir) -> dict:
    """The folder's recommended sampling settings (`diffserve.json`), passed explicitly."""
    defaults = json.loads((model_dir / "diffserve.json").read_text())["sampling_defaults"]
    return {k: v for k, v in defaults.items() if v is not None}


@pytest.fixture(scope="module")
def generator(model_dir):
    from diffserve.api import DiffGenerator

    return DiffGenerator.from_pretrained(model_dir, device="cpu", dtype="float32", show_progress=False)


def held_out_prompts() -> list[sd.Attributes]:
    """One prompt per held-out combination (30), sizes alternating; seeds are the list index."""
    sizes = list(sd.SIZES)
    return [
        sd.Attributes(c.shape, c.colour, sizes[i % 2], c.position, c.background)
        for i, c in enumerate(sd.held_out_combinations())
    ]


def test_folder_layout(model_dir, settings):
    index = json.loads((model_dir / "model_index.json").read_text())
    assert index["_class_name"] == "FluxPipeline"
    assert index["tokenizer"] == ["transformers", "PreTrainedTokenizerFast"]
    assert index["tokenizer_2"] == ["transformers", "PreTrainedTokenizerFast"]
    for name in (
        "transformer",
        "vae",
        "text_encoder",
        "text_encoder_2",
        "tokenizer",
        "tokenizer_2",
        "scheduler",
    ):
        assert (model_dir / name).is_dir(), name
    assert (model_dir / "README.md").is_file()
    size = sum(f.stat().st_size for f in model_dir.rglob("*") if f.is_file())
    assert size < 20 * 2**20, f"demo model folder is {size / 2**20:.1f} MB"
    assert settings["height"] == settings["width"] == sd.IMAGE_SIZE


def test_tokenizers_end_with_eos_and_clip_pools_there(model_dir, settings):
    from transformers import CLIPTextModel, PreTrainedTokenizerFast

    clip_tok = PreTrainedTokenizerFast.from_pretrained(model_dir / "tokenizer")
    t5_tok = PreTrainedTokenizerFast.from_pretrained(model_dir / "tokenizer_2")
    clip = CLIPTextModel.from_pretrained(model_dir / "text_encoder").eval()
    assert (
        clip.config.eos_token_id == clip_tok.eos_token_id != 2
    )  # 2 would select transformers' legacy argmax path
    prompt = "A small red circle, at the top left on a black background!"
    clip_ids = clip_tok(
        prompt, padding="max_length", max_length=clip_tok.model_max_length, return_tensors="pt"
    ).input_ids
    t5_ids = t5_tok(prompt, padding="max_length", max_length=settings["max_sequence_length"]).input_ids
    words = len(sd.caption(sd.Attributes("circle", "red", "small", "top left", "black")).split())
    assert clip_ids[0, 0] == clip_tok.bos_token_id and clip_ids[0, words + 1] == clip_tok.eos_token_id
    assert t5_ids[words] == t5_tok.eos_token_id and t5_ids[words + 1 :] == [t5_tok.pad_token_id] * (
        len(t5_ids) - words - 1
    )
    assert clip_tok.unk_token_id not in clip_ids[0]  # case and punctuation are normalised away
    with torch.no_grad():
        out = clip(clip_ids)
    torch.testing.assert_close(out.pooler_output[0], out.last_hidden_state[0, words + 1])


def test_held_out_prompt_adherence(generator, settings):
    prompts = held_out_prompts()
    assert len(prompts) >= 24
    # One call: the prompts share DiT batches (each image within one uint8 level of its run alone,
    # tests/e2e/test_prompt_batching.py), which is what makes 30 generations affordable here.
    requests = [SamplingParams(prompt=sd.caption(a), seed=seed, **settings) for seed, a in enumerate(prompts)]
    outputs = generator.generate_many(requests)
    results = [shapes_eval.measure(out.images[0], a) for out, a in zip(outputs, prompts, strict=True)]
    rates = shapes_eval.summarize(results)
    misses = [sd.caption(a) for a, m in zip(prompts, results, strict=True) if not m.matches]
    print(
        f"\ndemo model adherence on {len(prompts)} held-out prompts ({settings}): {rates}; misses: {misses}"
    )
    assert rates["matches"] >= MIN_ADHERENCE, (rates, misses)


def test_parity_with_diffusers(model_dir, generator, settings):
    diffusers = pytest.importorskip("diffusers")
    pipe = diffusers.FluxPipeline.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    kwargs = {k: v for k, v in settings.items() if k != "guidance_scale"}
    for seed, attrs in enumerate(held_out_prompts()[:2]):
        prompt = sd.caption(attrs)
        ours = generator.generate(prompt, seed=seed, **settings).images[0]
        theirs = pipe(prompt, generator=torch.Generator("cpu").manual_seed(seed), **kwargs).images[0]
        value = psnr(ours, theirs)
        print(f"\nparity PSNR vs diffusers for {prompt!r}: {value:.1f} dB")
        assert value >= MIN_PARITY_PSNR_DB, (prompt, value)


def test_measurement_is_right_on_ground_truth_and_fails_on_noise():
    attrs = sd.all_combinations()
    truth = [
        shapes_eval.measure(sd.render(a, offset=(i % 5 - 2, (i // 5) % 5 - 2)), a)
        for i, a in enumerate(attrs)
    ]
    rates = shapes_eval.summarize(truth)
    assert rates["matches"] == 1.0 and rates["size"] == 1.0, rates
    rng = np.random.default_rng(0)
    noise = [shapes_eval.measure(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8), a) for a in attrs[::6]]
    assert not any(m.matches for m in noise)
    assert not any(m.position or m.background for m in noise)
    # A blank background, or the right shape in the wrong place, fails too.
    a = sd.Attributes("circle", "red", "large", "top left", "black")
    assert not shapes_eval.measure(
        sd.render(sd.Attributes("circle", "red", "large", "bottom right", "black")), a
    ).matches
    assert not shapes_eval.measure(
        sd.render(sd.Attributes("circle", "blue", "large", "top left", "black")), a
    ).matches
    assert not shapes_eval.measure(
        sd.render(sd.Attributes("circle", "red", "large", "top left", "white")), a
    ).matches
