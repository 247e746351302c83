"""DiT weights kept in their memory-mapped safetensors files (`--max-memory`, docs/memory.md).

A model larger than the host's memory cannot be read into it; its files can be mapped. Each tensor of
the folder's safetensors files becomes a zero-copy view of the mapping (`MappedTensor`), and the module
is left holding `meta` placeholders: the layerwise offload (`offload/layerwise.py`) then keeps the
non-block weights resident and streams each repeated block from its views when it runs, releasing the
block's pages afterwards (`madvise(MADV_DONTNEED)`), so the resident set stays near two blocks plus the
non-block weights instead of growing with every page read. Clean file pages are what the kernel can drop
anyway, so even under a hard memory cap the process is slowed down (pages re-read from disk every step),
not killed. The mapping is private (copy-on-write): nothing is ever written back to the files.

A mapping is the file: pages rewritten in place would change the weights under the running engine, and
a truncated file would kill it with SIGBUS. So the files are mapped only when nothing can rewrite them
(`owned_weights.read_only_reason`: a read-only filesystem, or no write permission for anyone), which the
log says; writable files are refused with the remedy (`chmod a-w`), and every other load copies the
weights into memory the engine owns.
"""

from __future__ import annotations

import json
import logging
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from diffserve.errors import ModelLoadError
from diffserve.loader.owned_weights import read_only_reason

logger = logging.getLogger("diffserve.loader")

#: safetensors dtype names (the header's "dtype") -> torch dtypes.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}

#: Where `load_mmapped_into` leaves a module's mapped tensors (read with `mapped_tensors`).
_MAPPED_ATTR = "_diffserve_mapped_tensors"
_PAGE = mmap.PAGESIZE
_CAN_RELEASE = hasattr(mmap.mmap, "madvise") and hasattr(mmap, "MADV_DONTNEED")


class MappedFile:
    """One safetensors file mapped privately (read-only use, copy-on-write), with its parsed header."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with path.open("rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(header_len))
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError, struct.error) as exc:  # ValueError: bad JSON, or an empty file
            raise ModelLoadError(f"cannot map {path}: not a readable safetensors file ({exc})") from exc
        header.pop("__metadata__", None)
        self.header: dict[str, dict] = header
        self.data_start = 8 + header_len

    def tensor(self, key: str) -> MappedTensor:
        """Tensor `key` as a zero-copy view of the mapping (its pages are read when it is first used)."""
        entry = self.header[key]
        dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ModelLoadError(
                f"{self.path}: tensor {key!r} has dtype {entry['dtype']}, which is not supported"
            )
        shape = tuple(entry["shape"])
        begin, end = entry["data_offsets"]
        start, numel = self.data_start + begin, 1
        for size in shape:
            numel *= size
        if end - begin != numel * dtype.itemsize or self.data_start + end > len(self._map):
            raise ModelLoadError(f"{self.path}: tensor {key!r} lies outside the file (truncated or corrupt)")
        if numel == 0:
            view = torch.empty(shape, dtype=dtype)
        elif start % dtype.itemsize:
            raise ModelLoadError(f"{self.path}: tensor {key!r} is not aligned to its element size")
        else:
            view = torch.frombuffer(self._map, dtype=dtype, count=numel, offset=start).view(shape)
        return MappedTensor(view, self, start, end - begin)

    def advise(self, start: int, length: int, advice: int) -> None:
        """`madvise` the pages covering bytes [start, start + length) of the file."""
        first = start - start % _PAGE
        last = min(start + length, len(self._map))
        if last > first:
            self._map.madvise(advice, first, last - first)


@dataclass(frozen=True)
class MappedTensor:
    """One tensor of a mapped file: its zero-copy view (the file's dtype) and the byte range it spans."""

    view: torch.Tensor
    file: MappedFile
    start: int
    length: int

    def host_tensor(self) -> torch.Tensor:
        """The tensor in host memory (a view of the file's pages: reading it pages them in)."""
        return self.view

    def will_need(self) -> None:
        """Ask the kernel to read the tensor's pages ahead, in the background (`MADV_WILLNEED`)."""
        if _CAN_RELEASE and self.length:
            self.file.advise(self.start, self.length, mmap.MADV_WILLNEED)

    def release(self) -> None:
        """Drop the tensor's pages from this process's resident set (`MADV_DONTNEED`); a later read
        faults them back in from the file (or the page cache). Pages it shares with a neighbouring
        tensor are dropped too: being clean, they are simply read again when used."""
        if _CAN_RELEASE and self.length:
            self.file.advise(self.start, self.length, mmap.MADV_DONTNEED)


def mapped_tensors(module: nn.Module) -> dict[str, MappedTensor] | None:
    """The mapped tensors `load_mmapped_into` left on `module` (by state-dict key), or None."""
    return module.__dict__.get(_MAPPED_ATTR)


def forget_mapped_tensors(module: nn.Module) -> None:
    """Drop `module`'s record of its mapped tensors (once every tensor has been materialized)."""
    module.__dict__.pop(_MAPPED_ATTR, None)


def _target_dtype(file_dtype: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor runs in: floating-point ones in `dtype`, others as stored."""
    return dtype if file_dtype.is_floating_point else file_dtype


def _verified_read_only(files: list[Path]) -> list[str]:
    """Why each of `files` may stay mapped (nothing can rewrite it); a `ModelLoadError` naming the
    writable ones and what to do."""
    reasons = [read_only_reason(path) for path in files]
    writable = [str(path) for path, reason in zip(files, reasons, strict=True) if reason is None]
    if writable:
        raise ModelLoadError(
            "the DiT's weights would stay memory-mapped in their files (--max-memory, or --offload auto on a "
            "host short of memory), so those files must not change while the engine runs, and these are "
            f"writable: {', '.join(writable)}. A file rewritten in place would change the weights of the next "
            "image, a truncated one would kill the engine (SIGBUS). Make them read-only (chmod a-w "
            "<files>) or serve them from a read-only filesystem, or give the engine the memory to copy "
            "them in (a larger --max-memory)"
        )
    return [reason for reason in reasons if reason is not None]


def load_mmapped_into(module: nn.Module, files: list[Path], dtype: torch.dtype) -> int:
    """Map the tensors of `files` for the (meta-built) `module` instead of reading them.

    Every tensor's key and shape are checked against the module (a `ModelLoadError` names mismatches);
    the module's tensors become `meta` placeholders in the dtype they will run in (floating-point ones in
    `dtype`), and the zero-copy views are left for the layerwise offload (`mapped_tensors`), which must be
    installed before the module runs: it materializes the non-block weights and streams the blocks.
    Nothing is read yet; returns the bytes mapped. The loader must neither fuse nor quantize a mapped
    model (both would read, and copy, every weight): it runs unfused, as FLUX's forward can. Only files
    nothing can rewrite are mapped (a `ModelLoadError` names writable ones, before anything is mapped).
    """
    reasons = _verified_read_only(files)
    expected = {k: v.shape for k, v in module.state_dict().items()}
    mapped: dict[str, MappedTensor] = {}
    for path in files:
        opened = MappedFile(path)
        for key in opened.header:
            if key in mapped:
                raise ModelLoadError(f"tensor {key!r} is in more than one of the files of {path.parent}")
            mapped[key] = opened.tensor(key)
    missing, unexpected = sorted(expected.keys() - mapped.keys()), sorted(mapped.keys() - expected.keys())
    if missing or unexpected:
        parts = [f"missing keys: {', '.join(missing[:8])}"] if missing else []
        parts += [f"unexpected keys: {', '.join(unexpected[:8])}"] if unexpected else []
        raise ModelLoadError(
            f"weights in {files[0].parent} do not match {type(module).__name__}: " + "; ".join(parts)
        )
    placeholders: dict[str, torch.Tensor] = {}
    for key, tensor in mapped.items():
        if tensor.view.shape != expected[key]:
            raise ModelLoadError(
                f"{tensor.file.path}: tensor {key!r} has shape {tuple(tensor.view.shape)}, "
                f"the model config expects {tuple(expected[key])}"
            )
        target = _target_dtype(tensor.view.dtype, dtype)
        placeholders[key] = torch.empty(tensor.view.shape, dtype=target, device="meta")
    module.load_state_dict(placeholders, strict=True, assign=True)
    module.__dict__[_MAPPED_ATTR] = mapped
    num_bytes = sum(t.length for t in mapped.values())
    logger.info(
        "%s: %d tensors (%.3f GiB) memory-mapped from %d file(s) in %s, not read; kept mapped as verified "
        "read-only (%s)%s",
        type(module).__name__,
        len(mapped),
        num_bytes / 2**30,
        len(files),
        files[0].parent,
        "; ".join(sorted(set(reasons))),
        "" if _CAN_RELEASE else " (this OS has no madvise: used pages stay resident until it reclaims them)",
    )
    return num_bytes
