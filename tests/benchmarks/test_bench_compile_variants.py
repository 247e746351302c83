"""`benchmarks/bench_compile_variants.py` builds every variant it lists against the runtime's current
compile API (it had rotted once: `ScopedCompiledCall` gained its eager fallback and the script kept the
one-argument call), and each one runs the DiT's forward to eager's output with `torch.compile` replaced by
the identity (the variants' own code without an inductor compile, which is the benchmark's business; a
variant calling the model's internals with an old signature fails here)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import diffserve.models.dits.flux as flux_module
from diffserve.api import DiffGenerator
from diffserve.families.flux.tiny import TinyFluxSpec, build_tiny_flux
from diffserve.runtime.compile import ScopedCompiledCall

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_compile_variants.py"


def load_script():  # noqa: ANN201 - the script's module
    spec = importlib.util.spec_from_file_location("bench_compile_variants", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_variant_is_built(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = load_script()
    # The whole-DiT variant replaces `flux.sequence_split` for the benchmark's process: restored after
    # the test (left replaced, this worker's later two-rank FLUX runs split differently on rank 0 than on
    # their other ranks and hang in a collective).
    monkeypatch.setattr(flux_module, "sequence_split", flux_module.sequence_split)
    folder = build_tiny_flux(tmp_path / "flux", TinyFluxSpec(num_layers=1, num_single_layers=1))
    dit = DiffGenerator.from_pretrained(folder, device="cpu", show_progress=False).pipeline.context.get(
        "transformer"
    )
    inputs = script.dit_inputs(dit, size=32, batch=1)
    monkeypatch.setattr(torch, "compile", lambda fn, **options: fn)
    runners = script.build_variants(dit, inputs, list(script.VARIANTS))
    assert list(runners) == list(script.VARIANTS)
    with torch.inference_mode():
        reference = dit(**inputs)
        for name, run in runners.items():
            torch.testing.assert_close(run(), reference, rtol=0, atol=1e-6, msg=name)
    # The SDPA variants enter their graphs through the runtime's scoped call, as `--compile` does.
    regional = runners["regional-sdpa-onednn"].__defaults__[0]
    assert isinstance(regional.transformer_blocks[0].call, ScopedCompiledCall)
    static = runners["static-sdpa-onednn"].__defaults__[0]
    assert isinstance(static.single_transformer_blocks[0].call, ScopedCompiledCall)
