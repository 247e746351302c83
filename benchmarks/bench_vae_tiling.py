"""Peak memory and time of a Wan 2.1 VAE decode with and without tiling (`models/vaes/tiling.py`).

The VAE has the released Wan 2.1 shape (base_dim 96, z_dim 16: `AutoencoderKLWan()`'s defaults) and random
weights, float32 on the CPU. Each mode runs in its own subprocess so its peak is its own: the peak is the rise
of VmHWM (resident set high-water mark, reset after the model is built and the latents drawn) over the
decode, on a CUDA device `torch.cuda.max_memory_allocated`. Tiling uses Diffusers' default tiles (256-pixel
tiles every 192 pixels). The table also gives the PSNR of the tiled output against the untiled one (random
weights: this measures nothing about quality on a real checkpoint, where the tiles blend far better).

    python benchmarks/bench_vae_tiling.py --height 480 --width 832 --frames 1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

MB = 2**20


def decode_once(height: int, width: int, frames: int, tiled: bool, device: str, out: Path | None) -> dict:
    """Build the VAE, decode one clip of random latents, and report the peak memory above the start."""
    from diffserve.models.vaes.autoencoder_kl_wan import AutoencoderKLWan
    from diffserve.platforms.cpu import read_vm_hwm_bytes, reset_vm_hwm

    torch.manual_seed(0)
    vae = AutoencoderKLWan().to(device).eval()
    if tiled:
        vae.enable_tiling()
    f, t = vae.spatial_compression_ratio, vae.temporal_compression_ratio
    latents = torch.randn(1, 16, (frames - 1) // t + 1, height // f, width // f, device=device)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        if not reset_vm_hwm():
            raise SystemExit("VmHWM cannot be reset here (not Linux, or /proc/self/clear_refs refused)")
        base = read_vm_hwm_bytes() or 0
    start = time.perf_counter()
    with torch.inference_mode():
        video = vae.decode(latents)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if cuda else read_vm_hwm_bytes() or 0
    if out is not None:
        np.save(out, ((video.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).cpu().numpy())
    return {"peak_mb": (peak - base) / MB, "seconds": seconds, "shape": list(video.shape)}


def run_mode(args: argparse.Namespace, tiled: bool, out: Path) -> dict:
    cmd = [sys.executable, __file__, "--child", "--height", str(args.height), "--width", str(args.width),
           "--frames", str(args.frames), "--device", args.device, "--save", str(out)]  # fmt: skip
    if tiled:
        cmd.append("--tiled")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--frames", type=int, default=1, help="output frames, 1 + 4k")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tiled", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--save", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        save = None if args.save is None else Path(args.save)
        print(json.dumps(decode_once(args.height, args.width, args.frames, args.tiled, args.device, save)))
        return

    from diffserve.testing.image_metrics import psnr_uint8

    with tempfile.TemporaryDirectory() as folder:
        results = {tiled: run_mode(args, tiled, Path(folder) / f"{tiled}.npy") for tiled in (False, True)}
        psnr = psnr_uint8(np.load(Path(folder) / "True.npy"), np.load(Path(folder) / "False.npy"))
    print(f"Wan 2.1 VAE (base_dim 96, random weights, float32, {args.device}) decoding "
          f"{args.width}x{args.height} x {args.frames} frame(s) -> {results[False]['shape']}")  # fmt: skip
    print(f"{'mode':<10} {'peak MB':>10} {'seconds':>9}")
    for tiled, row in results.items():
        print(f"{'tiled' if tiled else 'untiled':<10} {row['peak_mb']:>10.0f} {row['seconds']:>9.1f}")
    ratio = results[False]["peak_mb"] / max(results[True]["peak_mb"], 1e-9)
    print(
        f"tiled peak is 1/{ratio:.1f} of the untiled one; tiled vs untiled output {psnr:.1f} dB (random weights)"
    )


if __name__ == "__main__":
    main()
