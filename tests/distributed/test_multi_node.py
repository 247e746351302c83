"""Two "nodes" on this machine over the loopback: `diffserve generate --nnodes 2 --node-rank K
--dist-init-addr 127.0.0.1:PORT` in two processes, one rank each (Ulysses 2), meeting through
torch.distributed's own TCP rendezvous. Node 0 writes the image (the one-rank image), node 1 follows and
writes nothing, and both exit 0."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
from PIL import Image

from diffserve.api import DiffGenerator
from diffserve.testing.ports import unassigned_port

ARGS = ["--prompt", "a fox", "--height", "64", "--width", "48", "--num-inference-steps", "2", "--seed", "1"]


def test_two_nodes_over_the_loopback_make_the_one_rank_image(tiny_flux_dir, tmp_path) -> None:
    port = unassigned_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}

    def node(rank: int) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "diffserve.cli.main", "generate", "--model-path", str(tiny_flux_dir), *ARGS,
               "--num-gpus", "2", "--nnodes", "2", "--node-rank", str(rank),
               "--dist-init-addr", f"127.0.0.1:{port}", "--output-path", str(tmp_path / f"node{rank}")]  # fmt: skip
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)

    follower, leader = node(1), node(0)
    try:
        leader_out, _ = leader.communicate(timeout=300)
        follower_out, _ = follower.communicate(timeout=60)
    finally:
        for process in (leader, follower):
            if process.poll() is None:
                process.kill()
    assert leader.returncode == 0, leader_out[-3000:]
    assert follower.returncode == 0, follower_out[-3000:]
    (png,) = (tmp_path / "node0").glob("*.png")
    assert not (tmp_path / "node1").exists() or not list((tmp_path / "node1").glob("*.png"))

    with DiffGenerator.from_pretrained(tiny_flux_dir, show_progress=False) as one_rank:
        expected = np.asarray(
            one_rank.generate("a fox", height=64, width=48, num_inference_steps=2, seed=1).images[0]
        )
    got = np.asarray(Image.open(png).convert("RGB"))
    assert np.abs(got.astype(int) - expected.astype(int)).max() <= 1
