"""Top kernels of diffserve's denoising steps, eager or `--compile`d, from `torch.profiler`.

Loads a folder with `DiffGenerator.from_pretrained(path, compile=...)`, runs one untimed generation,
then profiles `--profiled` generations and prints the ops by self CPU time with their share of the
total: where a compiled step's time goes (MKL `addmm` or oneDNN linear, SDPA, inductor's fused kernels,
dynamo's guard checks). It profiles whole generations (text encoding and the VAE decode included), so
use several steps; the DiT's ops dominate from 4 steps on at 256x256 with the 36.6M FLUX checkpoint.
To see another tree's profile (issue 37's before), put its `src` first on PYTHONPATH:

    .venv/bin/python benchmarks/profile_compiled_step.py --model-dir /tmp/bench_speed/flux_36m --compile
    PYTHONPATH=/tmp/base/src .venv/bin/python benchmarks/profile_compiled_step.py \\
        --model-dir /tmp/bench_speed/flux_36m --compile
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--compile", action="store_true", help="DiffGenerator.from_pretrained(..., compile=True)")
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--guidance-scale", type=float, default=0.0)
    p.add_argument("--profiled", type=int, default=2, help="generations under the profiler (default 2)")
    p.add_argument("--rows", type=int, default=12, help="ops listed (default 12)")
    args = p.parse_args(argv)

    # diffserve first: it sets passive OpenMP waits, which torch reads once, when it loads.
    from diffserve.api import DiffGenerator  # noqa: I001

    import torch
    from torch.profiler import ProfilerActivity, profile

    generator = DiffGenerator.from_pretrained(
        args.model_dir, device="cpu", dtype="float32", show_progress=False, compile=args.compile
    )

    def generate() -> list[float]:
        out = generator.generate(
            prompt="a red fox in the snow", height=args.size, width=args.size,
            num_inference_steps=args.steps, guidance_scale=args.guidance_scale, seed=0,
        )  # fmt: skip
        return list(out.step_times)

    generate()
    cpu_start = time.process_time()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step_times = [t for _ in range(args.profiled) for t in generate()]
    cpu_s = time.process_time() - cpu_start
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    regions = getattr(generator, "compiled_regions", [])  # trees before issue 37 record no `cpu_gemm`
    gemm = sorted({getattr(r, "cpu_gemm", "mkl") for r in regions}) or ["-"]
    print(
        f"# {'compiled' if args.compile else 'eager'} diffserve, {args.size}x{args.size}, {args.steps} steps x "
        f"{args.profiled} generations (torch {torch.__version__}; compiled CPU GEMM: {', '.join(gemm)})"
    )
    print(
        f"\nstep wall s (median): {sorted(step_times)[len(step_times) // 2]:.3f}; process CPU s per step: "
        f"{cpu_s / len(step_times):.3f} (under the profiler)\n"
    )
    print("| op | self CPU % | self CPU ms per step | calls per step |")
    print("|---|---:|---:|---:|")
    for event in events[: args.rows]:
        name = event.key if len(event.key) <= 70 else event.key[:67] + "..."
        print(
            f"| `{name}` | {100 * event.self_cpu_time_total / total:.1f}% "
            f"| {event.self_cpu_time_total / 1e3 / len(step_times):.2f} | {event.count / len(step_times):.1f} |"
        )


if __name__ == "__main__":
    main()
