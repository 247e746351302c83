#!/usr/bin/env python3
"""Speed of diffserve's DiTs against diffusers' on one GPU, in one run, on random weights of the published
shapes (issue 34), written as `report.md` and `report.json` into `--out`:

1. the bf16 matrix-multiply rate this GPU reaches (the ceiling for "model FLOPs per step / step time");
2. a FLUX.1-dev-shaped DiT (19 double + 38 single blocks, 3072 wide) at 1024x1024 (4096 image + 512 text
   tokens), batch 1 and 4 (step batching: one timestep per row): s/step and a 28-step denoising loop for
   diffusers eager, diffusers + torch.compile (regional, `compile_repeated_blocks`), diffserve eager,
   compiled (`--compile`), breakable CUDA graphs (`--enable-cuda-graph`), compiled + graphs, and
   `--quantization fp8-dynamic`; peak memory; the ratios against diffusers eager;
3. a Qwen-Image-shaped DiT step at 1024x1024 (batch 1, and batch 2 = one true-CFG step);
4. a Wan 2.1 14B-shaped DiT step at 480p x 81 frames (32760 tokens);
5. the published single-GPU anchors (SGLang, xDiT, LightX2V, diffusers on H100/H200) next to ours;
6. the issue's targets, pass or fail; and the GPU tests' results when `--tests-junit` names their report.

Everything is budgeted (`--budget-s`): a measurement that would not fit in what is left is skipped and
listed with its reason, and the report is rewritten after every section, so a run cut short still leaves
one. `--dry-run` runs the same code on the CPU with tiny shapes (tools/gpu/check.sh --dry-run, which the
test suite runs): the numbers then mean nothing, the code paths are the same (CUDA graphs through the
dry-run capture backend, FP8 through the test-only emulation, torch.compile with the eager backend).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

#: Published single-GPU figures (issue 34): seconds per denoising step, with what they include.
ANCHORS: list[dict[str, Any]] = [
    {"model": "flux", "who": "SGLang", "gpu": "H100", "s_per_step": 7.15 / 50, "note": "50 steps in 7.15 s"},
    {"model": "flux", "who": "xDiT eager", "gpu": "H100", "s_per_step": 6.71 / 28, "note": "28 steps in 6.71 s"},
    {"model": "flux", "who": "xDiT compiled", "gpu": "H100", "s_per_step": 4.30 / 28, "note": "28 steps in 4.30 s"},
    {"model": "qwen_image", "who": "SGLang", "gpu": "H100", "s_per_step": 12.8 / 50, "note": "50 steps in 12.8 s, true CFG"},
    {"model": "qwen_image", "who": "compiled", "gpu": "H200", "s_per_step": 0.243, "note": "0.243 s/step, true CFG"},
    {"model": "wan", "who": "LightX2V", "gpu": "H100", "s_per_step": 5.18, "note": "I2V 14B, with CFG"},
    {"model": "wan", "who": "SGLang", "gpu": "H100", "s_per_step": 6.13, "note": "I2V 14B, with CFG"},
    {"model": "wan", "who": "diffusers", "gpu": "H100", "s_per_step": 9.77, "note": "I2V 14B, with CFG"},
]  # fmt: skip
#: Which of our measurements each anchor is compared with: (section, variant, batch, steps per anchor step).
ANCHOR_MATCH = {
    "flux": ("flux", "best diffserve", 1, 1),
    "qwen_image": ("qwen_image", "best diffserve", 2, 1),  # one CFG step = a batch of 2
    "wan": ("wan", "best diffserve", 1, 2),  # no time for a batch of 2 at 32760 tokens: 2 x batch 1
}

FULL_SHAPES: dict[str, dict[str, Any]] = {
    "flux": {
        "config": {
            "patch_size": 1, "in_channels": 64, "out_channels": None, "num_layers": 19, "num_single_layers": 38,
            "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 4096,
            "pooled_projection_dim": 768, "guidance_embeds": True, "axes_dims_rope": [16, 56, 56],
        },
        "grid": (64, 64), "text": 512, "label": "1024x1024",
    },
    "qwen_image": {
        "config": {
            "patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60, "attention_head_dim": 128,
            "num_attention_heads": 24, "joint_attention_dim": 3584, "guidance_embeds": False,
            "axes_dims_rope": [16, 56, 56],
        },
        "grid": (64, 64), "text": 128, "label": "1024x1024",
    },
    "wan": {
        "config": {
            "patch_size": [1, 2, 2], "num_attention_heads": 40, "attention_head_dim": 128, "in_channels": 16,
            "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 13824, "num_layers": 40,
            "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "image_dim": None,
            "added_kv_proj_dim": None, "rope_max_seq_len": 1024,
        },
        "latent": (21, 60, 104), "text": 512, "label": "832x480, 81 frames",
    },
}  # fmt: skip
DRY_SHAPES: dict[str, dict[str, Any]] = {
    "flux": {
        "config": {
            "patch_size": 1, "in_channels": 64, "out_channels": None, "num_layers": 1, "num_single_layers": 2,
            "attention_head_dim": 16, "num_attention_heads": 2, "joint_attention_dim": 32,
            "pooled_projection_dim": 32, "guidance_embeds": True, "axes_dims_rope": [4, 6, 6],
        },
        "grid": (4, 4), "text": 16, "label": "64x64 (dry run)",
    },
    "qwen_image": {
        "config": {
            "patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 2, "attention_head_dim": 16,
            "num_attention_heads": 2, "joint_attention_dim": 32, "guidance_embeds": False,
            "axes_dims_rope": [4, 6, 6],
        },
        "grid": (4, 4), "text": 7, "label": "64x64 (dry run)",
    },
    "wan": {
        "config": {
            "patch_size": [1, 2, 2], "num_attention_heads": 2, "attention_head_dim": 16, "in_channels": 16,
            "out_channels": 16, "text_dim": 32, "freq_dim": 32, "ffn_dim": 64, "num_layers": 2,
            "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "image_dim": None,
            "added_kv_proj_dim": None, "rope_max_seq_len": 32,
        },
        "latent": (3, 6, 4), "text": 16, "label": "48x32, 9 frames (dry run)",
    },
}  # fmt: skip
MD_SECTIONS = {
    "flux": "## FLUX.1-dev-shaped DiT",
    "qwen_image": "## Qwen-Image-shaped DiT",
    "wan": "## Wan 2.1 14B-shaped DiT",
}


# -- the run's settings and its budget ----------------------------------------------------------------


@dataclass
class Run:
    """What one bench run measures on, and how long it may take."""

    out: Path
    dry_run: bool
    budget_s: float
    device: torch.device
    dtype: torch.dtype
    compile_backend: str
    started: float = field(default_factory=time.perf_counter)
    skipped: list[dict[str, str]] = field(default_factory=list)

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.started)

    def allows(self, what: str, estimate_s: float) -> bool:
        """Whether `estimate_s` more seconds fit; a skip is recorded with its reason."""
        if estimate_s <= self.left():
            return True
        self.skipped.append(
            {"what": what, "why": f"needs ~{estimate_s:.0f} s, {max(self.left(), 0):.0f} s left"}
        )
        print(f"[bench] skipped {what}: needs ~{estimate_s:.0f} s, {self.left():.0f} s left", flush=True)
        return False

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_gib(self) -> float | None:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**30
        return None

    def free(self) -> None:
        """Release models: compiled code holds its modules (guards), so dynamo's caches go first."""
        torch._dynamo.reset()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def timed_steps(run: Run, step: Callable[[], Any], steps: int, warmup: int = 1) -> float:
    """Mean seconds per call of `step` over `steps` consecutive calls, after `warmup` calls."""
    for _ in range(warmup):
        step()
    run.sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    run.sync()
    return (time.perf_counter() - start) / steps


# -- models and their calls ----------------------------------------------------------------------------


def build_pair(run: Run, diffusers_name: str, native_cls: type, config: dict[str, Any]) -> tuple[Any, Any]:
    """A diffusers DiT with random weights, made directly in the run's dtype on its device, and the native
    DiT sharing its tensors (loaded from its state dict as a checkpoint is)."""
    import diffusers

    from diffserve.testing.parity import native_from_reference

    default = torch.get_default_dtype()
    torch.set_default_dtype(run.dtype)
    try:
        with torch.device(run.device):
            torch.manual_seed(0)
            reference = getattr(diffusers, diffusers_name)(**config).eval().requires_grad_(False)
    finally:
        torch.set_default_dtype(default)
    native = native_from_reference(native_cls, reference).requires_grad_(False)
    return reference, native


def flux_inputs(run: Run, shape: dict[str, Any], batch: int) -> dict[str, Any]:
    config, (h, w), text = shape["config"], shape["grid"], shape["text"]
    g = torch.Generator().manual_seed(batch)
    ids = torch.stack(
        torch.meshgrid(torch.zeros(1), torch.arange(h * 1.0), torch.arange(w * 1.0), indexing="ij"), -1
    )
    return {
        "hidden_states": torch.randn(batch, h * w, config["in_channels"], generator=g).to(run.device, run.dtype),
        "encoder_hidden_states": torch.randn(batch, text, config["joint_attention_dim"], generator=g).to(run.device, run.dtype),
        "pooled_projections": torch.randn(batch, config["pooled_projection_dim"], generator=g).to(run.device, run.dtype),
        "timestep": torch.linspace(0.9, 0.6, batch).to(run.device, run.dtype),
        "img_ids": ids.reshape(h * w, 3).to(run.device, run.dtype),
        "txt_ids": torch.zeros(text, 3, device=run.device, dtype=run.dtype),
        "guidance": torch.full((batch,), 3.5, device=run.device, dtype=run.dtype),
    }  # fmt: skip


def qwen_inputs(run: Run, shape: dict[str, Any], batch: int) -> dict[str, Any]:
    config, (h, w), text = shape["config"], shape["grid"], shape["text"]
    g = torch.Generator().manual_seed(batch)
    return {
        "hidden_states": torch.randn(batch, h * w, config["in_channels"], generator=g).to(run.device, run.dtype),
        "encoder_hidden_states": torch.randn(batch, text, config["joint_attention_dim"], generator=g).to(run.device, run.dtype),
        "encoder_hidden_states_mask": None,
        "timestep": torch.linspace(0.9, 0.6, batch).to(run.device, run.dtype),
        "img_shapes": [[(1, h, w)]] * batch,
    }  # fmt: skip


def wan_inputs(run: Run, shape: dict[str, Any], batch: int) -> dict[str, Any]:
    config, (f, h, w), text = shape["config"], shape["latent"], shape["text"]
    g = torch.Generator().manual_seed(batch)
    return {
        "hidden_states": torch.randn(batch, config["in_channels"], f, h, w, generator=g).to(run.device, run.dtype),
        "timestep": torch.linspace(900.0, 600.0, batch).to(run.device),
        "encoder_hidden_states": torch.randn(batch, text, config["text_dim"], generator=g).to(run.device, run.dtype),
    }  # fmt: skip


def diffusers_step(model: Any, inputs: dict[str, Any]) -> Callable[[], Any]:
    def step() -> Any:
        with torch.inference_mode():
            return model(**inputs, return_dict=False)[0]

    return step


def native_step(model: Any, inputs: dict[str, Any], backend: Any) -> Callable[[], Any]:
    from diffserve.layers.attention import attention_backend_scope

    def step() -> Any:
        with torch.inference_mode(), attention_backend_scope(backend):
            return model(**inputs)

    return step


def denoise_loop(
    step_of: Callable[[dict[str, Any]], Any], inputs: dict[str, Any], steps: int, key: str
) -> Callable[[], Any]:
    """A `steps`-step Euler loop over the latents `inputs[key]` (what a 28-step generation's denoising
    costs, without text encoding and decoding)."""

    def loop() -> Any:
        x = inputs[key]
        for i in range(steps):
            t = 1.0 - i / steps
            velocity = step_of({**inputs, key: x, "timestep": torch.full_like(inputs["timestep"], t)})
            x = x + velocity * (-1.0 / steps)
        return x

    return loop


def count_flops(step: Callable[[], Any]) -> float | None:
    """The model FLOPs of one call (matmuls and attention, by torch's flop counter); None if it fails."""
    try:
        from torch.utils.flop_counter import FlopCounterMode

        counter = FlopCounterMode(display=False)
        with counter:
            step()
        return float(counter.get_total_flops())
    except Exception as exc:  # noqa: BLE001 - a missing count costs the MFU column only
        print(f"[bench] flop count failed: {exc}", flush=True)
        return None


# -- measurements -----------------------------------------------------------------------------------------


def measure_matmul(run: Run) -> dict[str, Any]:
    n = 256 if run.dry_run else 8192
    a = torch.randn(n, n, device=run.device, dtype=run.dtype)
    b = torch.randn(n, n, device=run.device, dtype=run.dtype)
    seconds = timed_steps(run, lambda: a @ b, steps=3 if run.dry_run else 10, warmup=3)
    return {"n": n, "dtype": str(run.dtype), "tflops": 2 * n**3 / seconds / 1e12}


@dataclass
class Section:
    """One model's rows of measurements."""

    name: str
    label: str
    flops_per_image: float | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, variant: str, batch: int, **values: Any) -> dict[str, Any]:
        row = {"variant": variant, "batch": batch, **values}
        if row.get("s_per_step") is not None:
            row["s_per_image"] = row["s_per_step"] / batch
        self.rows.append(row)
        print(f"[bench] {self.name}: {json.dumps(row, default=str)}", flush=True)
        return row

    def find(self, variant: str, batch: int) -> dict[str, Any] | None:
        return next(
            (r for r in self.rows if r["variant"] == variant and r["batch"] == batch and r.get("s_per_step")),
            None,
        )

    def finish(self, matmul_tflops: float | None) -> None:
        """Ratios against diffusers eager of the same batch, and the share of the matmul rate reached."""
        for row in self.rows:
            base = self.find("diffusers eager", row["batch"])
            if row.get("s_per_step") and base:
                row["speedup_vs_diffusers_eager"] = base["s_per_step"] / row["s_per_step"]
            if row.get("s_per_step") and self.flops_per_image and matmul_tflops:
                achieved = self.flops_per_image * row["batch"] / row["s_per_step"] / 1e12
                row["model_tflops"] = achieved
                row["share_of_matmul_rate"] = achieved / matmul_tflops

    def best(self, batch: int, prefix: str = "diffserve") -> dict[str, Any] | None:
        rows = [
            r
            for r in self.rows
            if r["variant"].startswith(prefix) and r["batch"] == batch and r.get("s_per_step")
        ]
        return min(rows, key=lambda r: r["s_per_step"]) if rows else None

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "flops_per_image": self.flops_per_image,
            "rows": self.rows,
            "notes": self.notes,
        }


def attempt(
    section: Section, variant: str, batch: int, measure: Callable[[], dict[str, Any]]
) -> dict[str, Any] | None:
    """Run one measurement; an error is recorded in its row (the run goes on)."""
    try:
        return section.add(variant, batch, **measure())
    except Exception as exc:  # noqa: BLE001 - one failed variant must not cost the report
        traceback.print_exc()
        section.add(
            variant, batch, s_per_step=None, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        )
        return None


def step_row(run: Run, step: Callable[[], Any], steps: int, warmup: int = 1) -> dict[str, Any]:
    run.reset_peak()
    seconds = timed_steps(run, step, steps, warmup)
    return {"s_per_step": seconds, "peak_gib": run.peak_gib(), "timed_steps": steps}


def choose_attention_backend(run: Run) -> Any:
    from diffserve.layers.attention_backends import DeviceFacts, select_attention_backend

    selection = select_attention_backend("auto", DeviceFacts.of(run.device, run.dtype))
    print(f"[bench] attention backend: {selection.describe()}", flush=True)
    return selection


def graph_backend(run: Run) -> Any:
    from diffserve.runtime.cuda_graph import CudaGraphBackend, DryRunBackend

    return DryRunBackend() if run.dry_run else CudaGraphBackend(run.device)


def regional_compile(run: Run, model: Any) -> None:
    """diffserve's `--compile` on `model` (runtime/compile.py), with the run's backend."""
    from diffserve.runtime import compile as compile_settings

    compile_settings.BACKEND = run.compile_backend
    compile_settings.compile_pipeline({"transformer": model})


def uncompile(model: Any) -> None:
    for module in model.modules():
        if getattr(module, "_compiled_call_impl", None) is not None:
            module._compiled_call_impl = None


class FluxBench:
    """The FLUX.1-dev-shaped rows, in two parts so that the slow compiles come after the other models:
    `eager_part` (diffusers eager, diffserve eager, breakable graphs, FP8 compute) and `compiled_part`
    (diffusers + torch.compile, diffserve compiled, compiled + graphs), each on freshly built models."""

    def __init__(self, run: Run, shape: dict[str, Any]) -> None:
        self.run, self.shape = run, shape
        self.section = Section("flux", shape["label"])
        self.steps = 1 if run.dry_run else 5
        self.loop_steps = 2 if run.dry_run else 28

    def _models(self) -> tuple[Any, Any, Any, dict[int, dict[str, Any]]]:
        from diffserve.models.dits.flux import FluxTransformer2DModel

        reference, native = build_pair(
            self.run, "FluxTransformer2DModel", FluxTransformer2DModel, self.shape["config"]
        )
        native.fuse_for_inference()
        selection = choose_attention_backend(self.run)
        inputs = {batch: flux_inputs(self.run, self.shape, batch) for batch in (1, 4)}
        return reference, native, selection, inputs

    def _variant(
        self,
        name: str,
        step_of: Callable[[dict[str, Any]], Callable[[], Any]],
        inputs: dict[int, dict[str, Any]],
        batches: tuple[int, ...] = (1, 4),
    ) -> None:
        """Rows of `name` at each batch, and at batch 1 the 28-step denoising loop when it fits."""
        run, loop_steps = self.run, self.loop_steps
        for batch in batches:
            row = attempt(
                self.section, name, batch, lambda b=batch: step_row(run, step_of(inputs[b]), self.steps)
            )
            if row is None or batch != 1:
                continue
            if run.allows(f"flux {name} {loop_steps}-step loop", loop_steps * row["s_per_step"] * 1.2 + 1):
                loop = denoise_loop(lambda i: step_of(i)(), inputs[1], loop_steps, "hidden_states")
                row[f"steps{loop_steps}_s"] = timed_steps(run, loop, 1, warmup=0)

    def _graphs(self, native: Any) -> Any:
        from diffserve.registry import PROMPT_PADDERS
        from diffserve.runtime.cuda_graph import Buckets, GraphRunner, padder_for

        buckets = Buckets(batch=(1, 4), tokens=(self.shape["text"],))
        return GraphRunner(
            native, padder_for(native, PROMPT_PADDERS), graph_backend(self.run), buckets
        ).install()

    def eager_part(self, matmul_tflops: float | None) -> Section:
        run, section = self.run, self.section
        reference, native, selection, inputs = self._models()
        section.notes.append(f"diffserve attention backend: {selection.describe()}")
        section.flops_per_image = count_flops(diffusers_step(reference, inputs[1]))

        def diffserve(i: dict[str, Any]) -> Callable[[], Any]:
            return native_step(native, i, selection.backend)

        self._variant("diffusers eager", lambda i: diffusers_step(reference, i), inputs)
        self._variant("diffserve eager", diffserve, inputs)
        start = time.perf_counter()
        runner = self._graphs(native)
        try:
            for batch in (1, 4):
                diffserve(inputs[batch])()  # captures
            section.notes.append(f"BCG capture of batch 1 and 4: {time.perf_counter() - start:.1f} s")
            self._variant("diffserve BCG", diffserve, inputs)
            section.notes.append(f"BCG counts: {runner.summary()}")
        except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
            traceback.print_exc()
            section.add("diffserve BCG", 1, s_per_step=None, error=f"{type(exc).__name__}: {exc}")
        finally:
            runner.uninstall()
        if run.allows("flux diffserve fp8-dynamic", 10 if run.dry_run else 60):
            name = "diffserve fp8-dynamic" + (" (emulated)" if run.dry_run else "")
            try:
                quantize_fp8_dynamic(run, native, "FluxTransformer2DModel")
                self._variant(name, diffserve, inputs)
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                section.add(name, 1, s_per_step=None, error=f"{type(exc).__name__}: {exc}")
        section.finish(matmul_tflops)
        return section

    def compiled_part(self, matmul_tflops: float | None) -> Section:
        run, section = self.run, self.section
        reference, native, selection, inputs = self._models()

        def diffserve(i: dict[str, Any]) -> Callable[[], Any]:
            return native_step(native, i, selection.backend)

        estimate = 20 if run.dry_run else 120
        # Each compiled batch kind is one more trace of every block class: the dry run traces batch 1 only.
        batches = (1,) if run.dry_run else (1, 4)
        if run.allows("flux diffusers + torch.compile", estimate):
            start = time.perf_counter()
            try:
                reference.compile_repeated_blocks(fullgraph=True, backend=run.compile_backend)
                diffusers_step(reference, inputs[1])()
                section.notes.append(
                    f"diffusers compile (regional) + first step: {time.perf_counter() - start:.1f} s"
                )
                self._variant("diffusers compiled", lambda i: diffusers_step(reference, i), inputs, batches)
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                section.add("diffusers compiled", 1, s_per_step=None, error=f"{type(exc).__name__}: {exc}")
            uncompile(reference)
        if run.allows("flux diffserve compiled", estimate):
            start = time.perf_counter()
            try:
                regional_compile(run, native)
                diffserve(inputs[1])()
                section.notes.append(
                    f"diffserve compile (regional, dynamic) + first step: {time.perf_counter() - start:.1f} s"
                )
                self._variant("diffserve compiled", diffserve, inputs, batches)
                if run.allows("flux diffserve compiled + BCG", estimate):
                    runner = self._graphs(native)
                    try:
                        self._variant("diffserve compiled + BCG", diffserve, inputs, batches)
                    finally:
                        runner.uninstall()
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                section.add("diffserve compiled", 1, s_per_step=None, error=f"{type(exc).__name__}: {exc}")
            uncompile(native)
        section.finish(matmul_tflops)
        return section


def quantize_fp8_dynamic(run: Run, model: Any, dit_class: str) -> None:
    """`--quantization fp8-dynamic` on `model` in place, bound to the GPU (the dry run: the emulation)."""
    from diffserve.layers.custom_op import dispatch_custom_ops
    from diffserve.layers.fp8_dynamic_linear import Fp8DynamicLinear
    from diffserve.loader.quantize import quantize_dit
    from diffserve.registry import DIT_FACTS

    quantize_dit(model, "fp8-dynamic", dit_class, DIT_FACTS)
    if run.dry_run:
        from diffserve.testing.fp8_emulation import emulated_scaled_mm

        for layer in model.modules():
            if isinstance(layer, Fp8DynamicLinear):
                layer.use_matmul(emulated_scaled_mm)
        return
    from diffserve.platforms import CudaPlatform

    dispatch_custom_ops(model, CudaPlatform(run.device.index or 0))


def bench_step_model(
    run: Run,
    name: str,
    shape: dict[str, Any],
    diffusers_name: str,
    native_cls: type,
    make_inputs: Callable[[Run, dict[str, Any], int], dict[str, Any]],
    batches: tuple[int, ...],
    steps: int,
    matmul_tflops: float | None,
    with_graphs: bool,
) -> Section:
    """diffusers eager and diffserve eager (and breakable graphs) steps of one DiT shape."""
    from diffserve.registry import PROMPT_PADDERS
    from diffserve.runtime.cuda_graph import Buckets, GraphRunner, padder_for

    section = Section(name, shape["label"])
    reference, native = build_pair(run, diffusers_name, native_cls, shape["config"])
    if hasattr(native, "fuse_for_inference"):
        native.fuse_for_inference()
    selection = choose_attention_backend(run)
    section.notes.append(f"diffserve attention backend: {selection.describe()}")
    inputs = {batch: make_inputs(run, shape, batch) for batch in batches}
    section.flops_per_image = count_flops(
        diffusers_step(reference, inputs[batches[0]])
    )  # also the first warm-up
    for batch in batches:
        attempt(
            section,
            "diffusers eager",
            batch,
            lambda b=batch: step_row(run, diffusers_step(reference, inputs[b]), steps),
        )
        attempt(
            section,
            "diffserve eager",
            batch,
            lambda b=batch: step_row(run, native_step(native, inputs[b], selection.backend), steps),
        )
    padder = padder_for(native, PROMPT_PADDERS)
    if with_graphs and padder is not None:
        tokens = inputs[batches[0]].get("encoder_hidden_states")
        buckets = Buckets(batch=batches, tokens=(int(tokens.shape[1]),) if tokens is not None else (1,))
        runner = GraphRunner(native, padder, graph_backend(run), buckets).install()
        try:
            for batch in batches:
                attempt(
                    section,
                    "diffserve BCG",
                    batch,
                    lambda b=batch: step_row(
                        run, native_step(native, inputs[b], selection.backend), steps, warmup=2
                    ),
                )
            section.notes.append(f"BCG counts: {runner.summary()}")
        finally:
            runner.uninstall()
    section.finish(matmul_tflops)
    return section


# -- tests, anchors, targets, the report ---------------------------------------------------------------------


def read_tests(junit: Path | None, log: Path | None) -> dict[str, Any]:
    """Counts, failures and skip reasons of the GPU tests' JUnit XML (what check.sh ran before)."""
    if junit is None or not junit.is_file():
        return {"ran": False, "note": "no JUnit report given (tools/gpu/check.sh runs the GPU tests first)"}
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    cases = [case for suite in suites for case in suite.iter("testcase")]
    failures, skipped, passed = [], [], 0
    for case in cases:
        name = f"{case.get('classname')}::{case.get('name')}"
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        skip = case.find("skipped")
        if problem is not None:
            failures.append({"test": name, "message": (problem.get("message") or "")[:500]})
        elif skip is not None:
            skipped.append({"test": name, "reason": (skip.get("message") or "")[:300]})
        else:
            passed += 1
    return {
        "ran": True, "total": len(cases), "passed": passed, "failed": len(failures), "skipped": len(skipped),
        "failures": failures, "skips": skipped, "log": str(log) if log else None,
    }  # fmt: skip


def compare_anchors(sections: dict[str, Section]) -> list[dict[str, Any]]:
    rows = []
    for anchor in ANCHORS:
        name, _, batch, per_anchor_step = ANCHOR_MATCH[anchor["model"]]
        section = sections.get(name)
        best = section.best(batch) if section else None
        if best is None and section is not None and batch > 1:
            best, per_anchor_step = section.best(1), per_anchor_step * batch  # estimated from batch 1
        ours = best["s_per_step"] * per_anchor_step if best else None
        rows.append({
            **anchor, "ours_variant": best["variant"] if best else None, "ours_batch": best["batch"] if best else None,
            "ours_s_per_step": ours, "anchor_over_ours": anchor["s_per_step"] / ours if ours else None,
        })  # fmt: skip
    return rows


def evaluate_targets(sections: dict[str, Section], tests: dict[str, Any]) -> list[dict[str, Any]]:
    targets = []
    flux = sections.get("flux")
    if flux is not None:
        eager = flux.find("diffusers eager", 1)
        fast = [flux.find(v, 1) for v in ("diffserve compiled", "diffserve BCG", "diffserve compiled + BCG")]
        fast = [r for r in fast if r]
        best = min(fast, key=lambda r: r["s_per_step"]) if fast else None
        ratio = eager["s_per_step"] / best["s_per_step"] if eager and best else None
        targets.append({
            "target": "FLUX 1024 bf16: diffserve compiled or BCG >= 1.3x diffusers eager per step",
            "value": None if ratio is None else f"{ratio:.2f}x ({best['variant']})", "passed": None if ratio is None else ratio >= 1.3,
        })  # fmt: skip
        compiled = flux.find("diffusers compiled", 1)
        targets.append(
            {
                "target": "FLUX 1024 bf16: diffserve faster than diffusers + torch.compile",
                "value": None
                if not (compiled and best)
                else f"{compiled['s_per_step'] / best['s_per_step']:.2f}x",
                "passed": None if not (compiled and best) else best["s_per_step"] < compiled["s_per_step"],
            }
        )
        for variant in sorted({r["variant"] for r in flux.rows if r["variant"].startswith("diffserve")}):
            one, four = flux.find(variant, 1), flux.find(variant, 4)
            if one and four:
                targets.append({
                    "target": f"FLUX {variant}: batch 4 per image no slower than batch 1",
                    "value": f"{four['s_per_image']:.4f} vs {one['s_per_image']:.4f} s/image",
                    "passed": four["s_per_image"] <= one["s_per_image"] * 1.02,  # 2%: timing noise
                })  # fmt: skip
    identity = [f for f in tests.get("failures", []) if "byte_identical" in f["test"]]
    ran_identity = tests.get("ran") and tests.get("total", 0) > 0
    targets.append(
        {
            "target": "BCG replays byte-identical to eager (tests/gpu/test_cuda_graph_gpu.py)",
            "value": f"{len(identity)} failing cases" if ran_identity else "tests not run",
            "passed": (not identity) if ran_identity else None,
        }
    )
    return targets


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if abs(value) < 1000 else f"{value:.3g}"
    return str(value)


def write_report(run: Run, report: dict[str, Any]) -> None:
    """report.json and report.md (every section heading present, with "not measured" where empty)."""
    run.out.mkdir(parents=True, exist_ok=True)
    report["elapsed_s"] = time.perf_counter() - run.started
    report["skipped"] = run.skipped
    (run.out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    env, tests, matmul = report["env"], report["tests"], report.get("matmul") or {}
    lines = ["# diffserve GPU check", ""]
    if run.dry_run:
        lines += ["**Dry run** (CPU, tiny shapes): the figures below only prove the code runs.", ""]
    lines += ["## Environment", ""] + [f"- {k}: {v}" for k, v in env.items()] + [""]
    lines += ["## GPU tests", ""]
    if tests.get("ran"):
        lines.append(
            f"{tests['passed']} passed, {tests['failed']} failed, {tests['skipped']} skipped of {tests['total']}."
        )
        lines += [f"- FAILED {f['test']}: {f['message']}" for f in tests["failures"]]
        lines += [f"- skipped {s['test']}: {s['reason']}" for s in tests["skips"][:40]]
    else:
        lines.append(tests.get("note", "not run"))
    lines += ["", "## bf16 matmul rate", ""]
    lines.append(
        f"{_fmt(matmul.get('tflops'), 1)} TFLOP/s ({matmul.get('n')}^3, {matmul.get('dtype')})"
        if matmul
        else "not measured"
    )
    for name, heading in MD_SECTIONS.items():
        section = report["sections"].get(name)
        lines += ["", f"{heading}{' (' + section['label'] + ')' if section else ''}", ""]
        if not section:
            lines.append("not measured")
            continue
        flops = section.get("flops_per_image")
        lines.append(f"Model FLOPs per image per step: {_fmt(flops and flops / 1e12, 2)} TFLOP" + "")
        lines += ["", "| variant | batch | s/step | s/image | 28-step loop s (2 in a dry run) | peak GiB | vs diffusers eager | TFLOP/s | of matmul rate | error |",
                  "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for row in section["rows"]:
            loop = next((v for k, v in row.items() if k.startswith("steps") and k.endswith("_s")), None)
            lines.append(
                f"| {row['variant']} | {row['batch']} | {_fmt(row.get('s_per_step'), 4)} | {_fmt(row.get('s_per_image'), 4)} | "
                f"{_fmt(loop, 2)} | {_fmt(row.get('peak_gib'), 1)} | {_fmt(row.get('speedup_vs_diffusers_eager'), 2)} | "
                f"{_fmt(row.get('model_tflops'), 0)} | {_fmt(row.get('share_of_matmul_rate'), 2)} | {row.get('error', '')} |"
            )
        lines += [""] + [f"- {note}" for note in section["notes"]]
    lines += ["", "## Against the published anchors", "",
              "| model | anchor | GPU | anchor s/step | ours (variant, batch) | ours s/step | anchor / ours | note |",
              "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in report.get("anchors", []):
        lines.append(
            f"| {row['model']} | {row['who']} | {row['gpu']} | {_fmt(row['s_per_step'], 3)} | {row['ours_variant'] or '-'}, "
            f"{row['ours_batch'] or '-'} | {_fmt(row['ours_s_per_step'], 3)} | {_fmt(row['anchor_over_ours'], 2)} | {row['note']} |"
        )
    lines += ["", "Anchors on an H100 are compared as they are (same bf16 compute as the H200, less memory bandwidth); "
              "Wan's anchors are I2V 14B with CFG, ours is T2V-shaped, 2 x the batch-1 step.", ""]  # fmt: skip
    lines += ["## Targets", ""]
    for target in report.get("targets", []):
        mark = {True: "PASS", False: "FAIL", None: "n/a"}[target["passed"]]
        lines.append(f"- {mark}: {target['target']}: {target['value'] or '-'}")
    lines += ["", "## Skipped", ""] + ([f"- {s['what']}: {s['why']}" for s in run.skipped] or ["nothing"])
    lines += ["", f"Elapsed: {report['elapsed_s']:.0f} s of a {run.budget_s:.0f} s budget.", ""]
    (run.out / "report.md").write_text("\n".join(lines))


def environment(run: Run) -> dict[str, Any]:
    env = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "python": platform.python_version(), "torch": torch.__version__,
        "device": str(run.device), "dtype": str(run.dtype), "dry_run": run.dry_run, "compile_backend": run.compile_backend,
    }  # fmt: skip
    try:
        import diffusers

        env["diffusers"] = diffusers.__version__
    except ImportError:
        env["diffusers"] = "not installed"
    if run.device.type == "cuda":
        props = torch.cuda.get_device_properties(run.device)
        env.update(gpu=props.name, capability=f"{props.major}.{props.minor}", gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   cuda=torch.version.cuda)  # fmt: skip
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for report.md and report.json")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: proves the code runs")
    parser.add_argument(
        "--budget-s", type=float, default=None, help="seconds this run may take (default: 330; 150 dry)"
    )
    parser.add_argument(
        "--tests-junit", type=Path, default=None, help="the GPU tests' JUnit XML, for the report"
    )
    parser.add_argument(
        "--tests-log", type=Path, default=None, help="the GPU tests' log, named in the report"
    )
    parser.add_argument("--only", nargs="*", default=None, help="sections to run: flux qwen_image wan")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("bench_gpu.py: no CUDA device here (use --dry-run on the CPU)", file=sys.stderr)
        return 2
    run = Run(
        out=args.out, dry_run=args.dry_run, budget_s=args.budget_s or (150.0 if args.dry_run else 330.0),
        device=torch.device("cpu" if args.dry_run else "cuda"), dtype=torch.bfloat16,
        compile_backend="eager" if args.dry_run else "inductor",
    )  # fmt: skip
    if run.dry_run:
        torch.manual_seed(0)
    shapes = DRY_SHAPES if run.dry_run else FULL_SHAPES
    only = set(args.only) if args.only else set(shapes)
    report: dict[str, Any] = {
        "env": environment(run), "tests": read_tests(args.tests_junit, args.tests_log), "sections": {},
        "anchors": [], "targets": [],
    }  # fmt: skip
    write_report(run, report)
    report["matmul"] = measure_matmul(run)
    matmul_tflops = report["matmul"]["tflops"]
    write_report(run, report)
    sections: dict[str, Section] = {}

    from diffserve.models.dits.qwen_image import QwenImageTransformer2DModel
    from diffserve.models.dits.wan import WanTransformer3DModel

    flux = FluxBench(run, shapes["flux"])
    plan: list[tuple[str, float, Callable[[], Section]]] = [
        ("flux", 20 if run.dry_run else 90, lambda: flux.eager_part(matmul_tflops)),
        ("qwen_image", 10 if run.dry_run else 60, lambda: bench_step_model(
            run, "qwen_image", shapes["qwen_image"], "QwenImageTransformer2DModel", QwenImageTransformer2DModel,
            qwen_inputs, (1, 2), 1 if run.dry_run else 3, matmul_tflops, with_graphs=True)),
        ("wan", 10 if run.dry_run else 60, lambda: bench_step_model(
            run, "wan", shapes["wan"], "WanTransformer3DModel", WanTransformer3DModel, wan_inputs, (1,),
            1, matmul_tflops, with_graphs=False)),
        ("flux", 20 if run.dry_run else 150, lambda: flux.compiled_part(matmul_tflops)),
    ]  # fmt: skip
    for name, estimate, bench in plan:
        if name not in only or not run.allows(f"the {name} section", estimate):
            continue
        try:
            started = time.perf_counter()
            sections[name] = bench()
            sections[name].notes.append(f"section time: {time.perf_counter() - started:.1f} s")
        except Exception as exc:  # noqa: BLE001 - the other sections still run
            traceback.print_exc()
            section = sections.get(name) or Section(name, shapes[name]["label"])
            section.add("(section)", 1, s_per_step=None, error=f"{type(exc).__name__}: {exc}")
            section.finish(matmul_tflops)
            sections[name] = section
        run.free()
        report["sections"] = {n: s.to_json() for n, s in sections.items()}
        write_report(run, report)
    report["anchors"] = compare_anchors(sections)
    report["targets"] = evaluate_targets(sections, report["tests"])
    write_report(run, report)
    print(f"[bench] report: {run.out / 'report.md'} ({time.perf_counter() - run.started:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with nullcontext():
        sys.exit(main())
