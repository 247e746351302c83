"""Breakable CUDA graphs (`--enable-cuda-graph`): the DiT's repeated blocks captured per (batch bucket,
token bucket) at warm-up and replayed with static buffers, broken around what cannot be captured.

- `buckets.py`: the batch and token buckets a call is padded up to;
- `padders.py`: the prompt padders (masked text, native length, fixed length) families name in their records;
- `runner.py`: `GraphRunner`, capture, replay, break points, eager fallbacks and their log lines;
- `backends.py`: `CudaGraphBackend` (torch.cuda.CUDAGraph) and `DryRunBackend` (no CUDA: records,
  recomputes eagerly through the same buffers; the tests and `tools/gpu/check.sh --dry-run`);
- `install.py`: what the engine calls at load and around its warm-up.
"""

from diffserve.runtime.cuda_graph.backends import CaptureBackend, CudaGraphBackend, DryRunBackend
from diffserve.runtime.cuda_graph.buckets import Buckets
from diffserve.runtime.cuda_graph.install import check_cuda_graph_args, install_cuda_graphs, warmup_capture
from diffserve.runtime.cuda_graph.padders import PromptPadder, padder_for
from diffserve.runtime.cuda_graph.runner import CaptureMismatchError, GraphRunner

__all__ = [
    "Buckets",
    "CaptureBackend",
    "CaptureMismatchError",
    "CudaGraphBackend",
    "DryRunBackend",
    "GraphRunner",
    "PromptPadder",
    "check_cuda_graph_args",
    "install_cuda_graphs",
    "padder_for",
    "warmup_capture",
]
