"""Multi-rank DiT step on the CPU: 2 ranks x 1 thread (Ulysses 2, Ring 2, CFG-parallel 2, tensor-parallel 2)
against 1 rank x 1 thread and 1 rank x 2 threads, on a FLUX-architecture transformer of realistic block shape.

The model is bench_flux_vs_diffusers.py's DiT (2 double + 4 single blocks, 8 heads x 64, joint width
256 -> ~36M parameters) at 512x512 (1,024 image tokens + 512 T5 tokens), one denoising step of a
true-CFG request (batch 2: the positive and the negative branch), float32. Each configuration runs in
fresh processes over gloo (`diffserve.testing.distributed.run_distributed`): one warm-up forward, then
`--repeats` timed forwards; the median is reported. Communication time per step is the time spent in
the collectives (all-to-all, all-gather, all-reduce, and the ring's waits on its transfers), measured on
rank 0. Tensor parallelism (`tp`, `--tp-size 2`) builds the DiT on meta, shards it
(`shard_for_tensor_parallel`) and assigns each rank its slices of the seeded weights, as the loader does;
its collectives are the row-parallel layers' all-reduces of the blocks' attention and MLP outputs.

    .venv/bin/python benchmarks/bench_parallel.py                  # all modes, 512x512, 5 repeats
    .venv/bin/python benchmarks/bench_parallel.py --size 256 --repeats 3 --json out.json
    .venv/bin/python benchmarks/bench_parallel.py --modes tp       # one mode (and the 1-rank baselines)

Scaling efficiency = (1 rank x 1 thread time) / (ranks x N-rank time). The script ends with the bytes
each mode moves per step, from the tensor shapes, for this model and for FLUX.1-dev at 1024x1024,
Qwen-Image at 1024x1024 and Wan 2.1 14B at 720p on 8 GPUs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from diffserve.distributed.config import ParallelConfig
from diffserve.distributed.state import build_parallel_state, parallel_scope
from diffserve.layers.tensor_parallel import TensorParallelRank, tensor_parallel_shards
from diffserve.models.dits.flux import FluxTransformer2DModel, FluxTransformerConfig
from diffserve.testing.distributed import run_distributed

TEXT_TOKENS = 512
HEADS, HEAD_DIM = 8, 64
DOUBLE_BLOCKS, SINGLE_BLOCKS = 2, 4
ATTENTION_CALLS = DOUBLE_BLOCKS + SINGLE_BLOCKS  # one per block
BATCH = 2  # a true-CFG request: positive and negative branch
MODES = ("ulysses", "ring", "cfg", "tp")


def bench_model(tp: TensorParallelRank | None = None) -> FluxTransformer2DModel:
    """The seeded DiT, fused as the loader leaves it; with `tp`, this rank's shard of it (the same weights)."""
    torch.manual_seed(0)
    config = FluxTransformerConfig(
        patch_size=1, in_channels=64, num_layers=DOUBLE_BLOCKS, num_single_layers=SINGLE_BLOCKS,
        attention_head_dim=HEAD_DIM, num_attention_heads=HEADS, joint_attention_dim=256,
        pooled_projection_dim=256, guidance_embeds=True, axes_dims_rope=(16, 24, 24),
    )  # fmt: skip
    model = FluxTransformer2DModel(config)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    if tp is not None:  # the loader's order: shard on meta, then fill with this rank's slices only
        full = model.state_dict()
        with torch.device("meta"):
            model = FluxTransformer2DModel(config)
        model.shard_for_tensor_parallel(tp)
        specs = tensor_parallel_shards(model)
        shards = {k: specs[k].take(v).clone() if k in specs else v for k, v in full.items()}
        del full
        model.load_state_dict(shards, strict=True, assign=True)
    model.fuse_for_inference()
    return model.eval()


def step_inputs(size: int, batch: int) -> dict[str, torch.Tensor]:
    grid = size // 16  # VAE /8, then 2x2 packing
    g = torch.Generator().manual_seed(1)
    img_ids = torch.zeros(grid, grid, 3)
    img_ids[..., 1] = torch.arange(grid)[:, None]
    img_ids[..., 2] = torch.arange(grid)[None, :]
    return {
        "hidden_states": torch.randn(batch, grid * grid, 64, generator=g),
        "encoder_hidden_states": torch.randn(batch, TEXT_TOKENS, 256, generator=g),
        "pooled_projections": torch.randn(batch, 256, generator=g),
        "timestep": torch.full((batch,), 0.5),
        "guidance": torch.full((batch,), 3.5),
        "img_ids": img_ids.reshape(-1, 3),
        "txt_ids": torch.zeros(TEXT_TOKENS, 3),
    }


class CommClock:
    """Seconds spent in the collectives the sequence-parallel and CFG code calls (patched in place)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        for name in ("all_to_all_single", "all_gather", "all_gather_into_tensor", "all_reduce"):
            setattr(dist, name, self._timed(getattr(dist, name)))
        batch_isend_irecv = dist.batch_isend_irecv

        def timed_p2p(ops):
            return [_TimedWork(work, self) for work in batch_isend_irecv(ops)]

        dist.batch_isend_irecv = timed_p2p

    def _timed(self, fn):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return call


class _TimedWork:
    def __init__(self, work, clock: CommClock) -> None:
        self.work, self.clock = work, clock

    def wait(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.work.wait(*args, **kwargs)
        finally:
            self.clock.seconds += time.perf_counter() - start


def _time_forwards(model, inputs, repeats: int, clock: CommClock | None) -> tuple[list[float], list[float]]:
    with torch.no_grad():
        model(**inputs)  # warm-up
        steps, comms = [], []
        for _ in range(repeats):
            if dist.is_initialized():
                dist.barrier()
            before = clock.seconds if clock else 0.0
            start = time.perf_counter()
            model(**inputs)
            steps.append(time.perf_counter() - start)
            comms.append((clock.seconds - before) if clock else 0.0)
    return steps, comms


def single_rank(
    rank: int, world: int, threads: int, size: int, repeats: int
) -> tuple[list[float], list[float]]:
    torch.set_num_threads(threads)
    return _time_forwards(bench_model(), step_inputs(size, BATCH), repeats, None)


def rank_main(rank: int, world: int, mode: str, size: int, repeats: int) -> tuple[list[float], list[float]]:
    config = {
        "ulysses": ParallelConfig(num_gpus=world, ulysses_degree=world),
        "ring": ParallelConfig(num_gpus=world, ring_degree=world),
        "cfg": ParallelConfig(num_gpus=world, enable_cfg_parallel=True),
        "tp": ParallelConfig(num_gpus=world, tp_size=world),
    }[mode]
    state = build_parallel_state(config, local_rank=rank, control_timeout=timedelta(seconds=600))
    clock = CommClock()
    model = bench_model(state if mode == "tp" else None)
    if mode == "cfg":  # each cfg rank runs its branch's row; the outputs are all-gathered
        shared = ("img_ids", "txt_ids")
        inputs = {k: v if k in shared else v[rank : rank + 1] for k, v in step_inputs(size, BATCH).items()}
        forward = model.forward

        def cfg_forward(**kwargs):
            out = forward(**kwargs)
            parts = [torch.empty_like(out) for _ in range(world)]
            dist.all_gather(parts, out.contiguous(), group=state.cfg_group)
            return torch.cat(parts)

        model.forward = cfg_forward
        return _time_forwards(model, inputs, repeats, clock)
    with parallel_scope(state):
        return _time_forwards(model, step_inputs(size, BATCH), repeats, clock)


@dataclass
class Row:
    config: str
    ranks: int
    threads_per_rank: int
    step_s: float
    comm_s: float
    speedup_vs_1x1: float
    efficiency: float


def flux_tp_rows(image: int, text: int, double: int, single: int) -> int:
    """Token rows a FLUX DiT's row-parallel layers all-reduce per forward and batch row, summed over them:
    a double-stream block reduces its attention and MLP outputs of both streams (2 x all tokens), a
    single-stream block its fused output (all tokens; the last one its image rows only)."""
    return double * 2 * (image + text) + max(single - 1, 0) * (image + text) + (image if single else 0)


def qwen_image_tp_rows(image: int, text: int, blocks: int) -> int:
    """The same for Qwen-Image (double-stream blocks only; the last block skips its text stream's output
    projection and MLP, so it reduces its image rows only, twice)."""
    return (blocks - 1) * 2 * (image + text) + 2 * image


def wan_tp_rows(tokens: int, blocks: int) -> int:
    """The same for Wan: self-attention, cross-attention and FFN outputs, all over the video tokens. (Its
    across-heads QK-norms also all-reduce one fp32 sum per token and norm: about 0.1% more, left out.)"""
    return blocks * 3 * tokens


def bytes_per_step(mode: str, batch: int, tokens: int, heads: int, head_dim: int, calls: int, p: int,
                   item: int, out_tokens: int, out_channels: int, tp_rows: int) -> float:  # fmt: skip
    """Bytes one rank sends per denoising step in `mode` over `p` ranks (attention in `calls` blocks;
    `tp_rows` token rows of width heads x head_dim all-reduced per batch row under TP)."""
    full = batch * tokens * heads * head_dim * item  # one of q, k, v or the output, whole sequence
    if mode == "ulysses":  # q, k, v all-to-all in, the output back: each rank keeps 1/p of what it holds
        return calls * 4 * (full / p) * (p - 1) / p
    if mode == "ring":  # its K and V shard goes to each of the p-1 other ranks in turn
        return calls * 2 * (full / p) * (p - 1)
    if mode == "cfg":  # the DiT output of its branch, all-gathered once per step
        return (batch / p) * out_tokens * out_channels * item * (p - 1)
    if mode == "tp":  # ring all-reduce of every row-parallel output: each rank sends 2 (p-1)/p of it
        return batch * tp_rows * heads * head_dim * item * 2 * (p - 1) / p
    raise ValueError(mode)


def projection_lines() -> list[str]:
    """Bytes per step per mode for two production models on 8 GPUs, and the time on NVLink."""
    nvlink = 450e9  # H100 NVLink, bytes/s per direction per GPU (900 GB/s both ways)
    models = {
        # tokens: 4096 image + 512 text; 19 double + 38 single blocks; output 4096 x 64; bf16
        "FLUX.1-dev 1024x1024": dict(tokens=4608, heads=24, head_dim=128, calls=57, out_tokens=4096,
                                     out_channels=64, tp_rows=flux_tp_rows(4096, 512, 19, 38)),
        # tokens: 4096 image + a 256-token prompt (Qwen2.5-VL, not padded to a fixed length); 60 blocks
        "Qwen-Image 1024x1024": dict(tokens=4352, heads=24, head_dim=128, calls=60, out_tokens=4096,
                                     out_channels=64, tp_rows=qwen_image_tp_rows(4096, 256, 60)),
        # 1280x720, 81 frames -> 21 latent frames x 45 x 80 / (2x2 patches) = 75,600 tokens; 40 blocks
        "Wan 2.1 14B 720p": dict(tokens=75600, heads=40, head_dim=128, calls=40, out_tokens=75600,
                                 out_channels=64, tp_rows=wan_tp_rows(75600, 40)),
    }  # fmt: skip
    lines = []
    for name, shape in models.items():
        for mode, p in (("ulysses", 8), ("ring", 8), ("cfg", 2), ("tp", 8)):
            sent = bytes_per_step(mode, 2, p=p, item=2, **shape)
            lines.append(
                f"  {name:<22} {mode:<8} p={p}: {sent / 1e9:7.3f} GB sent per rank per step "
                f"-> {sent / nvlink * 1e3:7.2f} ms on NVLink (450 GB/s)"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", type=int, default=512, help="image side in pixels (default 512)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"--modes: unknown {', '.join(unknown)}; choose from {', '.join(MODES)}")

    base_steps, _ = run_distributed(single_rank, 1, 1, args.size, args.repeats, timeout_s=1800)[0]
    base = statistics.median(base_steps)
    rows = [Row("1 rank x 1 thread", 1, 1, base, 0.0, 1.0, 1.0)]
    two_threads, _ = run_distributed(single_rank, 1, 2, args.size, args.repeats, timeout_s=1800)[0]
    t2 = statistics.median(two_threads)
    rows.append(Row("1 rank x 2 threads", 1, 2, t2, 0.0, base / t2, base / t2 / 2))
    for mode in modes:
        steps, comms = run_distributed(rank_main, 2, mode, args.size, args.repeats, timeout_s=1800)[0]
        step = statistics.median(steps)
        rows.append(
            Row(
                f"{mode} 2 ranks x 1 thread",
                2,
                1,
                step,
                statistics.median(comms),
                base / step,
                base / step / 2,
            )
        )

    tokens = (args.size // 16) ** 2
    print(f"\nFLUX-architecture DiT (~36M params), {args.size}x{args.size} ({tokens} image + {TEXT_TOKENS} text "
          f"tokens), batch {BATCH} (true CFG), fp32, CPU, median of {args.repeats}:")  # fmt: skip
    print(f"{'configuration':<28} {'step s':>8} {'comm s':>8} {'speed-up':>9} {'efficiency':>10}")
    for r in rows:
        print(f"{r.config:<28} {r.step_s:8.3f} {r.comm_s:8.3f} {r.speedup_vs_1x1:8.2f}x {r.efficiency:9.0%}")
    print("\nBytes sent per rank per step (this model, fp32, 2 ranks):")
    tp_rows = flux_tp_rows(tokens, TEXT_TOKENS, DOUBLE_BLOCKS, SINGLE_BLOCKS)
    for mode in modes:
        sent = bytes_per_step(
            mode, BATCH, tokens + TEXT_TOKENS, HEADS, HEAD_DIM, ATTENTION_CALLS, 2, 4, tokens, 64, tp_rows
        )
        note = ""
        if mode == "tp":
            reduced = BATCH * tp_rows * HEADS * HEAD_DIM * 4
            calls = 4 * DOUBLE_BLOCKS + SINGLE_BLOCKS
            note = f"  ({calls} all-reduces, {reduced / 1e6:.1f} MB reduced in all)"
        print(f"  {mode:<8} {sent / 1e6:8.1f} MB{note}")
    print("\nProjection, 8 GPUs (bf16, batch 2 = one true-CFG request):")
    print("\n".join(projection_lines()))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
