"""`DiffGenerator.generate(prompt=[...])` against one `generate` call per prompt, on the shipped demo model.

Both arms run in the same process on the same generator, alternating per round (batched first in odd
rounds, sequential first in even ones), after one untimed warm-up of each. The batched arm submits all
prompts to the engine at once, so their denoising steps share DiT batches; the sequential arm runs one
request at a time. Reported: each arm's median wall time, the paired per-round speed-up, and the largest
pixel difference between a prompt's batched image and its sequential one.

    .venv/bin/python benchmarks/bench_prompt_batching.py --prompts 8 --steps 20 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from diffserve import DiffGenerator
from diffserve.configs.demo_model import demo_model_path
from diffserve.demo import shapes_data

SETTINGS = {
    "height": 64,
    "width": 64,
    "max_sequence_length": 16,
    "true_cfg_scale": 3.0,
    "negative_prompt": "",
}


def demo_prompts(count: int) -> list[str]:
    """`count` held-out demo-model prompts (attribute combinations the model never saw in training)."""
    combos = shapes_data.held_out_combinations()
    sizes = list(shapes_data.SIZES)
    return [
        shapes_data.caption(shapes_data.Attributes(c.shape, c.colour, sizes[i % 2], c.position, c.background))
        for i, c in enumerate(combos[:count])
    ]


def pixels(images) -> np.ndarray:
    return np.stack([np.asarray(image) for image in images]).astype(np.int16)


def run_batched(gen: DiffGenerator, prompts: list[str], steps: int) -> tuple[float, np.ndarray]:
    start = time.perf_counter()
    outputs = gen.generate(prompt=prompts, seed=0, num_inference_steps=steps, **SETTINGS)
    return time.perf_counter() - start, pixels([out.images[0] for out in outputs])


def run_sequential(gen: DiffGenerator, prompts: list[str], steps: int) -> tuple[float, np.ndarray]:
    start = time.perf_counter()
    outputs = [gen.generate(prompt=p, seed=0, num_inference_steps=steps, **SETTINGS) for p in prompts]
    return time.perf_counter() - start, pixels([out.images[0] for out in outputs])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    gen = DiffGenerator.from_pretrained(demo_model_path(), device="cpu", dtype="float32", show_progress=False)
    prompts = demo_prompts(args.prompts)
    run_batched(gen, prompts, 2)  # warm-up of both arms (allocator, caches)
    run_sequential(gen, prompts, 2)
    batched, sequential, ratios, max_diff = [], [], [], 0
    for round_index in range(args.rounds):
        arms = [run_batched, run_sequential] if round_index % 2 == 0 else [run_sequential, run_batched]
        results = {arm.__name__: arm(gen, prompts, args.steps) for arm in arms}
        (b_time, b_pixels), (s_time, s_pixels) = results["run_batched"], results["run_sequential"]
        batched.append(b_time)
        sequential.append(s_time)
        ratios.append(s_time / b_time)
        max_diff = max(max_diff, int(np.abs(b_pixels - s_pixels).max()))
    print(f"{args.prompts} prompts x {args.steps} steps, {args.rounds} rounds (demo model, 64x64, CFG on)")
    print(f"sequential: median {statistics.median(sequential):.2f} s")
    print(f"batched:    median {statistics.median(batched):.2f} s")
    print(
        f"speed-up (paired per round): median {statistics.median(ratios):.2f}x, rounds {[f'{r:.2f}' for r in ratios]}"
    )
    print(f"max pixel difference batched vs sequential: {max_diff} uint8 level(s)")


if __name__ == "__main__":
    main()
