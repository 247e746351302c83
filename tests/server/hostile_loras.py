"""Hostile LoRA files for the server suites (issue 31 items 14, 15 and 20): what a client who can put files
in --lora-dir (or name them) may try. Each writer returns the file's name relative to the folder."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from server_process import ServerProcess, serving

from diffserve.testing.tiny_lora import dit_linears, write_random_lora

#: The issue's file declared 1.4 million zero-size tensors in an 83 MB header (48.6 s to refuse, every
#: generation stalled meanwhile); a million of them take 58 MB (over the header size cap) ...
HUGE_HEADER_TENSORS = 1_000_000
#: ... and 200,000 take 11 MB (under it: over the tensor count cap).
MANY_TENSORS = 200_000


def write_raw(path: Path, header: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(len(header).to_bytes(8, "little") + header)
    return path


def zero_size_tensors(count: int) -> bytes:
    entry = b'{"dtype":"F32","shape":[0],"data_offsets":[0,0]}'
    return b"{" + b",".join(b'"t%d":%s' % (i, entry) for i in range(count)) + b"}"


def write_pair(model_dir: Path, path: Path, rank: int = 2, dtype=torch.float32, fill=None) -> Path:
    """A one-layer LoRA on a real Linear of `model_dir`'s DiT (`fill`: one value put in its down factor)."""
    name, (out_features, in_features) = next(
        (n, shape) for n, shape in dit_linears(model_dir).items() if n.endswith("attn.to_q")
    )
    down = (torch.randn(rank, in_features) * 0.05).to(dtype)
    if fill is not None and rank:
        down[0, 0] = fill
    up = (torch.randn(out_features, rank) * 0.05).to(dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({f"transformer.{name}.lora_A.weight": down, f"transformer.{name}.lora_B.weight": up}, str(path))
    return path


def write_hostile_loras(model_dir: Path, folder: Path) -> dict[str, str]:
    """Good and hostile adapter files in `folder`, by role: their paths relative to it."""
    write_random_lora(model_dir, folder / "style.safetensors", rank=2, seed=1, std=0.1)
    write_random_lora(model_dir, folder / "other.safetensors", rank=2, seed=2, std=0.1)
    write_raw(folder / "huge-header.safetensors", zero_size_tensors(HUGE_HEADER_TENSORS))
    write_raw(folder / "many-tensors.safetensors", zero_size_tensors(MANY_TENSORS))
    write_raw(folder / "nested.safetensors", b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    write_pair(model_dir, folder / "nan.safetensors", fill=float("nan"))
    write_pair(model_dir, folder / "inf.safetensors", fill=float("inf"))
    write_pair(model_dir, folder / "int64.safetensors", dtype=torch.int64)
    write_pair(model_dir, folder / "rank0.safetensors", rank=0)
    return {p.stem: p.name for p in folder.glob("*.safetensors")}


#: (what, POST /v1/loras body, the error's param, words its message has): each must be a 400, never a 500.


@contextmanager
def serving_hostile_loras(model_dir: Path, work: Path, *extra: str, **kwargs: Any) -> Iterator[ServerProcess]:
    """A server (`server_process.serving`, no warm-up) whose --lora-dir, `work/loras`, holds the hostile
    files next to good ones (`write_hostile_loras`)."""
    write_hostile_loras(model_dir, work / "loras")
    with serving(model_dir, work, "--lora-dir", str(work / "loras"), "--no-warmup", *extra, **kwargs) as srv:
        yield srv


HOSTILE_LOADS: list[tuple[str, dict, str, str]] = [
    ("nul-byte-path", {"name": "x", "path": "style\x00.safetensors"}, "path", "NUL byte"),
    ("5000-char-name", {"name": "n" * 5000, "path": "style.safetensors"}, "name", ""),
    ("name-with-newline", {"name": "a\n", "path": "style.safetensors"}, "name", "not valid"),
    ("3000-level-path", {"name": "x", "path": "/".join(["d"] * 3000) + "/x.safetensors"}, "path", ""),
    ("5000-char-path", {"name": "x", "path": "p" * 5000 + ".safetensors"}, "path", ""),
    ("huge-header", {"name": "x", "path": "huge-header.safetensors"}, "path", "MAX_LORA_HEADER_BYTES"),
    ("many-tensors", {"name": "x", "path": "many-tensors.safetensors"}, "path", "MAX_LORA_TENSORS"),
    ("nested-header", {"name": "x", "path": "nested.safetensors"}, "path", "nested too deeply"),
    ("nan-weights", {"name": "x", "path": "nan.safetensors"}, "path", "NaN or infinite"),
    ("inf-weights", {"name": "x", "path": "inf.safetensors"}, "path", "NaN or infinite"),
    ("int64-weights", {"name": "x", "path": "int64.safetensors"}, "path", "dtype I64"),
    ("rank-0", {"name": "x", "path": "rank0.safetensors"}, "path", "rank-0"),
]
