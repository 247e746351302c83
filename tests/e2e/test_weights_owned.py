"""Loaded weights do not stay memory-mapped to their files (issue 31 item 12).

safetensors maps the files it reads and a same-dtype `.to()` keeps the mapping, so an engine could hold
its DiT, text encoders and VAE as views of the files: overwriting one in place (as `cp` does) changed the
next image, truncating it killed the engine with SIGBUS. Each case loads a tiny FLUX in a fresh
subprocess (a SIGBUS kills the child, not pytest), checks /proc/self/maps for the model's weight files,
generates, overwrites every weight file in place with 0xFF bytes (NaN as floats), generates, truncates
every one to 0 bytes, generates: the three images must be equal. The folder's own weights (DiT,
CLIP, T5, VAE), a single-file `--transformer-weights` safetensors, a GGUF file and the diffusers backend
(`backend="diffusers"`) are checked.

The one exception: `--max-memory` keeps the DiT in its mapped files, only when nothing can rewrite them
(here: mode 0444); the same /proc check then sees that file mapped, which shows the check sees mappings.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from diffserve.families.flux.tiny import build_tiny_flux
from diffserve.testing.tiny_single_file import original_state_dict

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/maps").exists(), reason="mappings are read from /proc (Linux only)"
)

CHILD = r"""
import json, logging, os, sys
from pathlib import Path
import numpy as np
from diffserve import DiffGenerator
from diffserve.loader.owned_weights import mapped_files

folder, weights, cap, backend = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
weights = None if weights == "none" else Path(weights)
files = sorted(folder.glob("*/*.safetensors")) + ([weights] if weights else [])
gen = DiffGenerator.from_pretrained(
    folder, device="cpu", show_progress=False, transformer_weights=weights,
    max_memory=None if cap == "none" else int(cap), backend=backend, dtype="float32",
)

def image():
    out = gen.generate(prompt="a lighthouse at dusk", seed=3, height=64, width=64, num_inference_steps=2)
    return np.asarray(out.images[0])

result = {"mapped": [str(p) for p in mapped_files(files)]}
first = image()
result["std"] = float(first.std())
if cap == "none":
    for path in files:  # in place, same size: what `cp new old` does to the old file's pages
        size = path.stat().st_size
        with path.open("r+b") as f:
            f.write(b"\xff" * size)
    result["same_after_overwrite"] = bool(np.array_equal(image(), first))
    for path in files:
        os.truncate(path, 0)
    result["same_after_truncate"] = bool(np.array_equal(image(), first))
print(json.dumps(result))
"""


def _child(
    folder: Path, weights: Path | None = None, cap: int | None = None, backend: str = "native"
) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(folder), str(weights or "none"), str(cap or "none"), backend],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, f"rc {result.returncode} (-7 is SIGBUS)\n{result.stderr[-4000:]}"
    return {**json.loads(result.stdout.strip().splitlines()[-1]), "log": result.stderr}


@pytest.mark.parametrize("source", ["folder", "single-file safetensors", "gguf", "diffusers backend"])
def test_rewritten_or_truncated_weight_files_change_nothing(tmp_path, source) -> None:
    folder = build_tiny_flux(tmp_path / "flux")
    weights = None
    if source not in ("folder", "diffusers backend"):
        original = original_state_dict(
            "FluxTransformer2DModel",
            load_file(str(folder / "transformer" / "diffusion_pytorch_model.safetensors")),
        )
        if source == "gguf":
            pytest.importorskip("gguf")
            from diffserve.testing.tiny_single_file import write_gguf

            weights = tmp_path / "flux-F16.gguf"
            write_gguf(weights, original, "F16", "flux")
        else:
            weights = tmp_path / "flux-original.safetensors"
            save_file({k: v.contiguous() for k, v in original.items()}, str(weights))
    result = _child(folder, weights, backend="diffusers" if source == "diffusers backend" else "native")
    print(f"{source}: mapped after load {result['mapped']}, image std {result['std']:.1f}")
    assert result["mapped"] == []
    assert result["std"] > 5, "a flat image would prove nothing"
    assert result["same_after_overwrite"] and result["same_after_truncate"]


def test_max_memory_maps_only_read_only_files(tmp_path) -> None:
    """The deliberate exception, and the control that the /proc check sees a mapping when there is one."""
    folder = build_tiny_flux(tmp_path / "flux")
    dit = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    others = sum(f.stat().st_size for f in folder.glob("*/*.safetensors") if f != dit)
    cap = others + dit.stat().st_size // 2
    dit.chmod(0o444)
    result = _child(folder, cap=cap)
    assert result["mapped"] == [str(dit)]
    assert "kept mapped as verified read-only (mode 0444, no write permission)" in result["log"]
