"""What each `--compile` choice costs: one DiT forward of a FLUX checkpoint, eager against compiled
variants, in one process, variants alternating (issue 37's profile).

Variants (`--variants`, comma-separated; each compiled one gets its own top-level code object, so
dynamo's caches never mix, and all share the model's weights):

| variant | what |
|---|---|
| `eager` | the DiT as loaded |
| `regional-op-mkl` | the blocks compiled per class (dynamic shapes), entered without the request scope mirrored: attention is the opaque `diffserve::attention` op, matmuls MKL's `addmm` (the path before issue 37) |
| `regional-sdpa-mkl` | entered through `ScopedCompiledCall`: SDPA traced as itself (and plain Linears), matmuls MKL's |
| `regional-sdpa-onednn` | the same with `OneDnnLinearPass` (what `--compile` runs on a CPU where oneDNN wins) |
| `static-sdpa-onednn` | the same compiled for the shapes it is called with (`dynamic=False`), not for any size |
| `stack-sdpa-onednn` | all blocks in one graph (the block loop of `FluxTransformer2DModel._run_blocks`) |
| `whole-sdpa-onednn` | the whole DiT forward in one graph (`fullgraph=True`) |

Timing: each round runs every variant `--iters` times (order rotating per round); per variant the median
of its calls' process CPU time and wall time per round, then the median over rounds and the per-round
ratio eager / variant. CPU time is the robust figure on a busy machine (waiting for a core is not
counted); `--profile` adds each variant's top ops from `torch.profiler`. Sequence parallelism is off
here; its scope is read through a ContextVar that would split the whole-forward graph, so this script
skips that read for the `whole` variant.

    .venv/bin/python benchmarks/bench_compile_variants.py --model-dir /tmp/bench_speed/flux_36m --rounds 8
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

VARIANTS = (
    "eager",
    "regional-op-mkl",
    "regional-sdpa-mkl",
    "regional-sdpa-onednn",
    "static-sdpa-onednn",
    "stack-sdpa-onednn",
    "whole-sdpa-onednn",
)

STACK = """mods_iter = iter(mods)
for block in model.transformer_blocks:
    ctx, x = block(x, ctx, next(mods_iter), next(mods_iter), rope)
txt_len = ctx.shape[1]
h = torch.cat([ctx, x], dim=1)
*leading, last = model.single_transformer_blocks
for block in leading:
    h = block(h, next(mods_iter), rope)
return last(h, next(mods_iter), rope, text_len=txt_len)"""


def unique_function(tag: str, params: str, body: str, namespace: dict) -> Callable:
    """A function with its own code object (dynamo keeps its compiled code per code object)."""
    source = f"def variant_{tag}({params}):\n" + "".join(f"    {line}\n" for line in body.splitlines())
    exec(compile(source, f"<variant {tag}>", "exec"), namespace)  # noqa: S102 - fixed source above
    return namespace[f"variant_{tag}"]


def build_variants(dit, inputs: dict, names: list[str]) -> dict[str, Callable[[], object]]:  # noqa: ANN001
    import torch
    from torch import nn

    import diffserve.models.dits.flux as flux_module
    from diffserve.runtime.compile import ScopedCompiledCall
    from diffserve.runtime.compile_gemm import OneDnnLinearPass

    class Region(nn.Module):
        def __init__(self, block: nn.Module, call: Callable) -> None:
            super().__init__()
            self.block, self.call = block, call

        def forward(self, *args: object, **kwargs: object) -> object:
            return self.call(self.block, *args, **kwargs)

    def shallow() -> nn.Module:
        model = copy.copy(dit)
        model._modules = dict(dit._modules)
        return model

    runners: dict[str, Callable[[], object]] = {}
    for name in names:
        if name == "eager":
            runners[name] = lambda: dit(**inputs)
            continue
        kind, attention, gemm = name.split("-")
        options = {"post_grad_custom_pre_pass": OneDnnLinearPass()} if gemm == "onednn" else None
        tag = name.replace("-", "_")
        if kind in ("regional", "static"):
            plain = unique_function(tag, "block, *a, **kw", "return block(*a, **kw)", {})
            call = torch.compile(plain, dynamic=kind == "regional", options=options)
            if attention == "sdpa":
                call = ScopedCompiledCall(call, eager=plain)
            model = shallow()
            model.transformer_blocks = nn.ModuleList([Region(b, call) for b in dit.transformer_blocks])
            model.single_transformer_blocks = nn.ModuleList(
                [Region(b, call) for b in dit.single_transformer_blocks]
            )
            runners[name] = lambda model=model: model(**inputs)
        elif kind == "stack":
            plain = unique_function(tag, "model, x, ctx, mods, rope", STACK, {"torch": torch})
            stack = torch.compile(plain, dynamic=True, fullgraph=True, options=options)
            scoped = ScopedCompiledCall(stack, eager=plain)
            model = shallow()
            model._run_blocks = lambda x, ctx, inputs, scoped=scoped: scoped(
                dit, x, ctx, inputs.mods, inputs.rope
            )
            runners[name] = lambda model=model: model(**inputs)
        elif kind == "whole":
            plain = unique_function(tag, "model, kw", "return model(**kw)", {})
            whole = ScopedCompiledCall(
                torch.compile(plain, dynamic=True, fullgraph=True, options=options), eager=plain
            )
            runners[name] = lambda whole=whole: whole(dit, inputs)
            flux_module.sequence_split = lambda lengths: None  # see the module docstring
        else:
            raise SystemExit(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
    return runners


def dit_inputs(dit, size: int, batch: int) -> dict:  # noqa: ANN001 - a FluxTransformer2DModel
    """One forward's keyword arguments for `dit` at `size` x `size` pixels: random latents, 512 text tokens
    already embedded (`context`), the RoPE tables."""
    import torch

    config = dit.config
    g = torch.Generator().manual_seed(0)
    side, text = size // 16, 512
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3).float()
    txt_ids = torch.zeros(text, 3)
    return {
        "hidden_states": torch.randn(batch, side * side, config.in_channels, generator=g),
        "encoder_hidden_states": None,
        "context": torch.randn(batch, text, dit.inner_dim, generator=g),
        "pooled_projections": torch.randn(batch, config.pooled_projection_dim, generator=g),
        "timestep": torch.full((batch,), 0.7),
        "img_ids": img_ids,
        "txt_ids": txt_ids,
        "guidance": torch.zeros(batch) if config.guidance_embeds else None,
        "rope": dit.rope_tables(txt_ids, img_ids),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, required=True, help="a FLUX.1-layout diffusers folder")
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--batch", type=int, default=1, help="DiT rows (1: no CFG)")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--iters", type=int, default=3, help="calls per variant per round")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--profile", action="store_true", help="also print each variant's top ops")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.variants.split(",") if n.strip()]

    from diffserve.api import DiffGenerator  # noqa: I001 - before torch: passive OpenMP waits

    import torch

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    generator = DiffGenerator.from_pretrained(
        args.model_dir, device="cpu", dtype="float32", show_progress=False
    )
    dit = generator.pipeline.context.get("transformer")
    inputs = dit_inputs(dit, args.size, args.batch)
    runners = build_variants(dit, inputs, names)
    with torch.inference_mode():
        reference = dit(**inputs)
        for name, run in runners.items():
            start = time.perf_counter()
            out = run()
            run()
            print(
                f"{name}: first two calls {time.perf_counter() - start:.1f} s (compile), max |diff| vs eager "
                f"{(out - reference).abs().max().item():.2e}",
                file=sys.stderr, flush=True,
            )  # fmt: skip
    from torch._inductor.async_compile import shutdown_compile_workers

    shutdown_compile_workers()
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    with torch.inference_mode():
        for round_ in range(args.rounds):
            for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                walls, cpus = [], []
                for _ in range(args.iters):
                    w0, c0 = time.perf_counter(), time.process_time()
                    runners[name]()
                    walls.append(time.perf_counter() - w0)
                    cpus.append(time.process_time() - c0)
                wall[name].append(statistics.median(walls))
                cpu[name].append(statistics.median(cpus))
            print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)

    def ratio(series: dict[str, list[float]], name: str) -> str:
        if "eager" not in series:
            return "-"
        return f"{statistics.median(e / v for e, v in zip(series['eager'], series[name], strict=True)):.2f}x"

    print(f"# One DiT forward, {args.model_dir.name}, {args.size}x{args.size}, batch {args.batch}")
    print(f"\n{args.rounds} rounds x {args.iters} calls, variants alternating\n")
    print(
        "| variant | CPU ms (median) | eager / variant, CPU time | wall ms (median) | eager / variant, wall |"
    )
    print("|---|---:|---:|---:|---:|")
    for name in names:
        print(
            f"| {name} | {statistics.median(cpu[name]) * 1e3:.0f} | {ratio(cpu, name)} "
            f"| {statistics.median(wall[name]) * 1e3:.0f} | {ratio(wall, name)} |"
        )
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for name in names:
            with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(3):
                    runners[name]()
            print(f"\n## {name}: top ops (3 forwards)\n")
            print(
                prof.key_averages().table(
                    sort_by="self_cpu_time_total", row_limit=10, max_name_column_width=60
                )
            )


if __name__ == "__main__":
    main()
