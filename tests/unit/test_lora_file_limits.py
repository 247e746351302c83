"""Issue 31 items 14, 15 and 20: what `read_lora_file` refuses, quickly and as a `LoraError` naming the file
and the limit (never a RecursionError, an OSError or minutes of parsing): a header over
MAX_LORA_HEADER_BYTES, more than MAX_LORA_TENSORS tensors, JSON nested too deeply, non-float or empty
(rank-0) tensors, NaN or infinite values, and paths the OS refuses. What it reads is copied out of the
file: no map of it stays open."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from diffserve.errors import LoraError
from diffserve.loader.lora_formats import read_lora_file
from diffserve.loader.lora_formats.safetensors_file import MAX_LORA_HEADER_BYTES, MAX_LORA_TENSORS

MODULE = "transformer.transformer_blocks.0.attn.to_q"


def pair(path: Path, rank: int = 2, dtype: torch.dtype = torch.float32, fill: float | None = None) -> Path:
    down = torch.randn(rank, 8).to(dtype)
    if fill is not None:
        down[0, 0] = fill
    save_file(
        {f"{MODULE}.lora_A.weight": down, f"{MODULE}.lora_B.weight": torch.randn(8, rank).to(dtype)},
        str(path),
    )
    return path


def raw(path: Path, header: bytes) -> Path:
    path.write_bytes(len(header).to_bytes(8, "little") + header)
    return path


def zero_size_tensors(count: int) -> bytes:
    entry = b'{"dtype":"F32","shape":[0],"data_offsets":[0,0]}'
    return b"{" + b",".join(b'"t%d":%s' % (i, entry) for i in range(count)) + b"}"


def refused(path: Path, *words: str, within_s: float = 5.0) -> str:
    start = time.perf_counter()
    with pytest.raises(LoraError) as info:
        read_lora_file(path)
    assert time.perf_counter() - start < within_s, (
        f"refusing {path.name} took {time.perf_counter() - start:.1f} s"
    )
    message = str(info.value)
    for word in words:
        assert word in message, message
    return message


def test_a_header_over_the_size_limit_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "huge.safetensors"
    with path.open("wb") as f:
        f.write((MAX_LORA_HEADER_BYTES + 1).to_bytes(8, "little"))
        f.truncate(8 + MAX_LORA_HEADER_BYTES + 1)
    refused(path, "MAX_LORA_HEADER_BYTES", "16 MiB")


def test_a_header_declaring_too_many_tensors_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    """The issue's file declared 1.4 million zero-size tensors (83 MB): 48.6 s to refuse. Within the size
    cap, 250,000 of them are refused by their count, in well under a second."""
    path = raw(tmp_path / "many.safetensors", zero_size_tensors(250_000))
    assert path.stat().st_size < MAX_LORA_HEADER_BYTES
    refused(path, "250000 tensors", f"the {MAX_LORA_TENSORS}", "MAX_LORA_TENSORS", within_s=2.0)
    # Just over the limit, counted after parsing as well.
    refused(raw(tmp_path / "over.safetensors", zero_size_tensors(MAX_LORA_TENSORS + 1)), "MAX_LORA_TENSORS")


def test_a_header_nested_too_deeply_is_a_lora_error(tmp_path: Path) -> None:
    path = raw(tmp_path / "nested.safetensors", b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    refused(path, "nested too deeply")
    path = raw(tmp_path / "nested-objects.safetensors", b'{"a":' * 100_000 + b"1" + b"}" * 100_000)
    refused(path, "nested too deeply")


def test_non_float_and_empty_tensors_are_refused(tmp_path: Path) -> None:
    refused(pair(tmp_path / "int64.safetensors", dtype=torch.int64), "dtype I64", "floating point")
    refused(pair(tmp_path / "int8.safetensors", dtype=torch.int8), "dtype I8")
    refused(pair(tmp_path / "bool.safetensors", dtype=torch.bool), "dtype BOOL")
    refused(pair(tmp_path / "rank0.safetensors", rank=0), "is empty", "rank-0")
    # An integer alpha scalar is what some trainers write: accepted.
    path = tmp_path / "int-alpha.safetensors"
    save_file(
        {
            f"{MODULE}.lora_down.weight": torch.randn(2, 8),
            f"{MODULE}.lora_up.weight": torch.randn(8, 2),
            f"{MODULE}.alpha": torch.tensor(4, dtype=torch.int64),
        },
        str(path),
    )
    assert set(read_lora_file(path)[0]) == {
        f"{MODULE}.lora_down.weight",
        f"{MODULE}.lora_up.weight",
        f"{MODULE}.alpha",
    }


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_non_finite_values_are_refused(tmp_path: Path, value: float, dtype: torch.dtype) -> None:
    refused(pair(tmp_path / "bad.safetensors", dtype=dtype, fill=value), "NaN or infinite", "lora_A")


def test_paths_the_os_refuses_are_lora_errors(tmp_path: Path) -> None:
    refused(tmp_path / "a\x00b.safetensors", "NUL byte")
    refused(tmp_path / ("x" * 5000 + ".safetensors"), "cannot be used")
    refused(tmp_path.joinpath(*["d"] * 3000, "x.safetensors"), "cannot be used")


def test_the_tensors_read_are_not_maps_of_the_file(tmp_path: Path) -> None:
    path = pair(tmp_path / "mapped.safetensors")
    tensors, _ = read_lora_file(path)
    with open("/proc/self/maps") as maps:
        assert str(path) not in maps.read()
    before = {k: t.clone() for k, t in tensors.items()}
    pair(path)  # rewritten in place
    path.write_bytes(b"")  # then truncated: a map would now fault (SIGBUS)
    assert all(torch.equal(tensors[k], before[k]) for k in tensors)
