"""Loaded weights do not stay memory-mapped to their files (issue 31 item 12).

safetensors maps the files it reads and a same-dtype `.to()` keeps the mapping, so an engine could hold
its DiT, text encoders and VAE as views of the files: overwriting one in place (as `cp` does) changed the
next image, truncating it killed the engine with SIGBUS. Each case loads a tiny FLUX in a child
subprocess (a SIGBUS kills the child, not pytest), checks /proc/self/maps for the model's weight files,
generates, overwrites every weight file in place with 0xFF bytes (NaN as floats), generates, truncates
every one to 0 bytes, generates: the three images must be equal. The folder's own weights (DiT,
CLIP, T5, VAE), a single-file `--transformer-weights` safetensors, a GGUF file and the diffusers backend
(`backend="diffusers"`) are checked.

The one exception: `--max-memory` keeps the DiT in its mapped files, only when nothing can rewrite them
(here: mode 0444); the same /proc check then sees that file mapped, which shows the check sees mappings.
"""

from __future__ import annotations

import importlib.util
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

#: One child process runs every case in turn (one interpreter and torch start-up instead of five): each
#: case is a JSON line `[name, folder, weights or null, cap or null, backend]` on its stdin, its result a
#: JSON line on its stdout as soon as the case is done; a case that dies (SIGBUS) leaves the cases after
#: it without a line, and the tests of those cases say so.
CHILD = r"""
import json, logging, os, sys
from pathlib import Path
import numpy as np
from diffserve import DiffGenerator
from diffserve.loader.owned_weights import mapped_files

logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
for line in sys.stdin:
    name, folder, weights, cap, backend = json.loads(line)
    print(f"case {name}", file=sys.stderr, flush=True)
    folder, weights = Path(folder), (Path(weights) if weights else None)
    files = sorted(folder.glob("*/*.safetensors")) + ([weights] if weights else [])
    gen = DiffGenerator.from_pretrained(
        folder, device="cpu", show_progress=False, transformer_weights=weights,
        max_memory=cap, backend=backend, dtype="float32",
    )

    def image():
        out = gen.generate(prompt="a lighthouse at dusk", seed=3, height=64, width=64, num_inference_steps=2)
        return np.asarray(out.images[0])

    result = {"case": name, "mapped": [str(p) for p in mapped_files(files)]}
    first = image()
    result["std"] = float(first.std())
    if cap is None:
        for path in files:  # in place, same size: what `cp new old` does to the old file's pages
            size = path.stat().st_size
            with path.open("r+b") as f:
                f.write(b"\xff" * size)
        result["same_after_overwrite"] = bool(np.array_equal(image(), first))
        for path in files:
            os.truncate(path, 0)
        result["same_after_truncate"] = bool(np.array_equal(image(), first))
    gen.close()
    print(json.dumps(result), flush=True)
"""

SOURCES = ("folder", "single-file safetensors", "gguf", "diffusers backend")
CAPPED = "max-memory, read-only DiT"


def _source_case(tmp_path: Path, source: str) -> list:
    """The child's case line for one weight source: a tiny FLUX folder, and the single file it names."""
    folder = build_tiny_flux(tmp_path / source.replace(" ", "-"))
    weights = None
    if source in ("single-file safetensors", "gguf"):
        original = original_state_dict(
            "FluxTransformer2DModel",
            load_file(str(folder / "transformer" / "diffusion_pytorch_model.safetensors")),
        )
        if source == "gguf":
            from diffserve.testing.tiny_single_file import write_gguf

            weights = folder.parent / f"{folder.name}-F16.gguf"
            write_gguf(weights, original, "F16", "flux")
        else:
            weights = folder.parent / f"{folder.name}-original.safetensors"
            save_file({k: v.contiguous() for k, v in original.items()}, str(weights))
    backend = "diffusers" if source == "diffusers backend" else "native"
    return [source, str(folder), str(weights) if weights else None, None, backend]


def _capped_case(tmp_path: Path) -> tuple[list, Path]:
    """`--max-memory` below the weights with the DiT read-only (mode 0444): the one file kept mapped."""
    folder = build_tiny_flux(tmp_path / "capped")
    dit = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    others = sum(f.stat().st_size for f in folder.glob("*/*.safetensors") if f != dit)
    dit.chmod(0o444)
    return [CAPPED, str(folder), None, others + dit.stat().st_size // 2, "native"], dit


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every case's result (by name) from one child process, its log ("log": the end, with the exit code;
    "stderr": all of it) and the capped case's DiT."""
    tmp_path = tmp_path_factory.mktemp("weights-owned")
    sources = [s for s in SOURCES if s != "gguf" or importlib.util.find_spec("gguf") is not None]
    capped, dit = _capped_case(tmp_path)
    cases = [*(_source_case(tmp_path, source) for source in sources), capped]
    proc = subprocess.run(
        [sys.executable, "-c", CHILD],
        input="".join(json.dumps(case) + "\n" for case in cases),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    found = {r["case"]: r for r in map(json.loads, proc.stdout.splitlines()) if r}
    log = f"rc {proc.returncode} (-7 is SIGBUS)\n{proc.stderr[-4000:]}"
    return {**found, "log": log, "stderr": proc.stderr, "dit": dit}


def _result(results: dict, case: str) -> dict:
    if case == "gguf" and importlib.util.find_spec("gguf") is None:
        pytest.skip("the gguf package is not installed")
    assert case in results, f"the child process died before the case {case!r} ended: {results['log']}"
    return results[case]


@pytest.mark.parametrize("source", SOURCES)
def test_rewritten_or_truncated_weight_files_change_nothing(results, source) -> None:
    result = _result(results, source)
    print(f"{source}: mapped after load {result['mapped']}, image std {result['std']:.1f}")
    assert result["mapped"] == []
    assert result["std"] > 5, "a flat image would prove nothing"
    assert result["same_after_overwrite"] and result["same_after_truncate"]


def test_max_memory_maps_only_read_only_files(results) -> None:
    """The deliberate exception, and the control that the /proc check sees a mapping when there is one."""
    result = _result(results, CAPPED)
    assert result["mapped"] == [str(results["dit"])]
    capped_log = results["stderr"].split(f"case {CAPPED}")[-1].split("\ncase ")[0]
    assert "kept mapped as verified read-only (mode 0444, no write permission)" in capped_log
