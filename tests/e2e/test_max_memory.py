"""`--max-memory`: a DiT whose weights exceed the cap runs to a correct image with a bounded resident set.

A FLUX checkpoint with a ~200 MB DiT (hidden width 512, 2 + 8 blocks, float32) generates once normally
and once under `max_memory=64 MiB`, each in a fresh subprocess that samples its own resident set size
(/proc/self/statm, every 2 ms, from just before loading to the end) and also reports VmHWM: under the
cap the DiT's weights stay memory-mapped and stream per block (`loader/mmap_weights.py`,
`offload/layerwise.py`), so the run's RSS grows by about two blocks, not by the model. The images must be
equal (or >= 60 dB apart: the capped model runs unfused), and the comparison of the two runs' RSS shows
that the measurement sees the model when it is loaded normally.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from diffserve.families.flux.tiny import TinyFluxSpec, build_tiny_flux
from diffserve.testing.image_metrics import psnr_uint8
from diffserve.testing.json_child import run_json_child

CAP_BYTES = 64 * 2**20
#: What a run grows by besides the DiT's weights: the encoders, the VAE, the modules imported while loading
#: (the text encoders' are imported before the base is read), the activations.
MARGIN_BYTES = 64 * 2**20
BLOCK_KEY = re.compile(r"(transformer_blocks|single_transformer_blocks)\.\d+\.")
SPEC = TinyFluxSpec(
    num_layers=2,
    num_single_layers=8,
    num_attention_heads=4,
    attention_head_dim=128,
    axes_dims_rope=(32, 48, 48),
)

#: The generation, run in a subprocess so that its RSS is its own: prints one JSON line.
CHILD = r"""
import json, logging, sys, threading, time
from pathlib import Path
import numpy as np
from diffserve import DiffGenerator
from diffserve.platforms.cpu import read_vm_hwm_bytes
# The text encoders' modules, imported (and, in a fresh clone, byte-compiled) before the base is read:
# about 20 MiB (the capped run's growth fell from 120 to 101 MiB) that is neither the DiT's weights nor
# the run's activations.
from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast

PAGE = 4096
def rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * PAGE

folder, cap, out = sys.argv[1], sys.argv[2], sys.argv[3]
logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
peak, done = [rss()], threading.Event()
def sample() -> None:
    while not done.is_set():
        peak[0] = max(peak[0], rss())
        time.sleep(0.002)
base = rss()
sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
gen = DiffGenerator.from_pretrained(
    folder, device="cpu", show_progress=False, max_memory=None if cap == "none" else int(cap)
)
image = gen.generate(prompt="a lighthouse at dusk", seed=5, height=64, width=64, num_inference_steps=2).images[0]
done.set()
sampler.join()
peak[0] = max(peak[0], rss())
np.save(out, np.asarray(image))
print(json.dumps({"base": base, "peak": peak[0], "vm_hwm": read_vm_hwm_bytes()}))
"""


def _run(folder: Path, cap: int | None, out: Path) -> dict:
    report, log = run_json_child(
        CHILD, str(folder), "none" if cap is None else str(cap), str(out), timeout=300
    )
    return {**report, "log": log}


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="RSS is read from /proc (Linux only)")
def test_dit_larger_than_the_cap_runs_with_bounded_rss(tmp_path) -> None:
    folder = build_tiny_flux(tmp_path / "flux", SPEC)
    model_bytes = (folder / "transformer" / "diffusion_pytorch_model.safetensors").stat().st_size
    # Mapped files must be ones nothing can rewrite (loader/mmap_weights.py): read-only.
    (folder / "transformer" / "diffusion_pytorch_model.safetensors").chmod(0o444)
    assert model_bytes > 2.5 * CAP_BYTES
    normal = _run(folder, None, tmp_path / "normal.npy")
    capped = _run(folder, CAP_BYTES, tmp_path / "capped.npy")

    psnr = psnr_uint8(np.load(tmp_path / "normal.npy"), np.load(tmp_path / "capped.npy"))
    grew_normal, grew_capped = normal["peak"] - normal["base"], capped["peak"] - capped["base"]
    non_block, max_block = _footprint(folder / "transformer" / "diffusion_pytorch_model.safetensors")
    bound = non_block + 2 * max_block + MARGIN_BYTES
    print(
        f"\nDiT {model_bytes / 2**20:.1f} MiB (largest block {max_block / 2**20:.1f} MiB, non-block "
        f"{non_block / 2**20:.1f} MiB), cap {CAP_BYTES / 2**20:.0f} MiB: RSS grew by {grew_normal / 2**20:.1f} "
        f"MiB normally (peak {normal['peak'] / 2**20:.1f}, VmHWM {normal['vm_hwm'] / 2**20:.1f}), by "
        f"{grew_capped / 2**20:.1f} MiB under the cap (peak {capped['peak'] / 2**20:.1f}, VmHWM "
        f"{capped['vm_hwm'] / 2**20:.1f}; bound {bound / 2**20:.1f}); PSNR {psnr:.1f} dB"
    )
    assert psnr >= 60.0
    assert "memory-mapped" in capped["log"] and "--max-memory" in capped["log"]
    assert "DiT layerwise offload" in capped["log"]
    # The measurement sees the model when it is loaded whole ...
    assert grew_normal > model_bytes
    # ... and under the cap the run grows by two blocks, the non-block weights and the fixed margin.
    assert grew_capped < bound < model_bytes
    assert capped["peak"] < normal["peak"] - model_bytes / 2


def _footprint(weights: Path) -> tuple[int, int]:
    """(non-block bytes, largest block's bytes) of a safetensors file, from its header."""
    blocks: dict[str, int] = {}
    non_block = 0
    with safe_open(str(weights), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118  (safe_open is not a Mapping)
            nbytes = 4 * math.prod(f.get_slice(key).get_shape())  # float32
            match = BLOCK_KEY.match(key)
            if match is None:
                non_block += nbytes
            else:
                blocks[match.group(0)] = blocks.get(match.group(0), 0) + nbytes
    return non_block, max(blocks.values())
