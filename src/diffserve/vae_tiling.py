"""The VAE tiling switches the engine drives: `--vae-tiling` turns every VAE's tiling on at load, and the
memory model can tile one request's decode (`tiled_decode_scope`) when its untiled decode would not fit.

And the decode's chunk boundaries: every VAE decode loop calls `decode_chunk_boundary()` before each of its
chunks (a latent frame of a causal video VAE, a spatial or temporal tile, a batch element, an up block of
a whole-clip video decoder). The engine sets a hook there for one request's decode (`decode_chunk_scope`):
a cancelled request's decode stops at the next boundary, and the engine runs other requests' denoising
steps between two chunks (runtime/decode_task.py). Outside a scope (previews, parity tests) it does nothing.

The tiled decode itself is each VAE's (`models/vaes/tiling.py` holds the shared blending); this module
needs no model code, so the runtime and the parallel decode can use it without importing the models.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class SupportsTiling(Protocol):
    """A VAE with Diffusers' tiling and slicing switches (what `--vae-tiling` and automatic tiling drive)."""

    use_tiling: bool
    use_slicing: bool

    def enable_tiling(self) -> None: ...

    def disable_tiling(self) -> None: ...

    def enable_slicing(self) -> None: ...

    def disable_slicing(self) -> None: ...


def enable_tiling_on(components: Mapping[str, object]) -> list[str]:
    """`--vae-tiling`: `enable_tiling()` (each class's Diffusers defaults) on every component that has the
    switch; returns their names (the engine logs them)."""
    names = []
    for name, component in components.items():
        if isinstance(component, SupportsTiling):
            component.enable_tiling()
            names.append(name)
    return names


def tile_area(vae: SupportsTiling) -> int:
    """Output pixels of one tile (what one tiled decoder call makes per frame): `tile_sample_min_height x
    tile_sample_min_width`, or `tile_sample_min_size` squared for the AutoencoderKL family (Diffusers' names)."""
    sizes = vars(vae)
    if "tile_sample_min_height" in sizes and "tile_sample_min_width" in sizes:
        return int(sizes["tile_sample_min_height"]) * int(sizes["tile_sample_min_width"])
    if "tile_sample_min_size" in sizes:
        return int(sizes["tile_sample_min_size"]) ** 2
    raise TypeError(f"{type(vae).__name__} names its tile size neither as Diffusers' video nor image VAEs do")


@contextmanager
def tiling_scope(vae: SupportsTiling, on: bool) -> Iterator[None]:
    """Decode with tiling on (its current tile parameters) or off inside the block; the switch is restored
    after (automatic tiling: one request's decode)."""
    before = vae.use_tiling
    vae.use_tiling = on
    try:
        yield
    finally:
        vae.use_tiling = before


_tiled_decode: ContextVar[bool] = ContextVar("diffserve_tiled_decode", default=False)


@contextmanager
def tiled_decode_scope(on: bool) -> Iterator[None]:
    """Inside the block, decodes through `decode_split` are tiled when `on` (the engine's automatic tiling
    of one request's decode, decided by its memory model), whatever the VAE's own switch says."""
    token = _tiled_decode.set(on)
    try:
        yield
    finally:
        _tiled_decode.reset(token)


def tiled_decode_requested() -> bool:
    """Whether the decode in progress here was asked to be tiled (`tiled_decode_scope`)."""
    return _tiled_decode.get()


@contextmanager
def requested_tiling(vae: object) -> Iterator[None]:
    """Inside the block, `vae` tiles when this request's decode was asked to (`tiled_decode_scope`) and it
    has the switch; for decoders called with more than latents (LTX-2's timestep), which `decode_split`
    cannot take."""
    if isinstance(vae, SupportsTiling) and not vae.use_tiling and tiled_decode_requested():
        with tiling_scope(vae, True):
            yield
    else:
        yield


_chunk_hook: ContextVar[Callable[[], None] | None] = ContextVar("diffserve_decode_chunk_hook", default=None)


@contextmanager
def decode_chunk_scope(hook: Callable[[], None] | None) -> Iterator[None]:
    """Inside the block, `hook()` runs at every chunk boundary of a VAE decode (None: nothing runs). It may
    raise (a cancelled request: RequestCancelledError, which ends the decode) or pause the decode."""
    token = _chunk_hook.set(hook)
    try:
        yield
    finally:
        _chunk_hook.reset(token)


def decode_chunk_boundary() -> None:
    """Called by a VAE decode loop before each chunk: runs the hook of `decode_chunk_scope`, if any."""
    hook = _chunk_hook.get()
    if hook is not None:
        hook()


_output_hook: ContextVar[Callable[[Any], None] | None] = ContextVar("diffserve_decode_output", default=None)


@contextmanager
def decode_output_scope(hook: Callable[[Any], None] | None) -> Iterator[None]:
    """Inside the block, a VAE that decodes a clip whole (one device, untiled) hands each temporal chunk's
    final pixels to `hook` as soon as it has them (`decode_chunk_output`): a streamed video job publishes
    them while the rest decodes (outputs/fmp4.py). None: nothing is handed out."""
    token = _output_hook.set(hook)
    try:
        yield
    finally:
        _output_hook.reset(token)


def decode_output_wanted() -> bool:
    """Whether a decode in progress here should hand out its chunks (`decode_output_scope`)."""
    return _output_hook.get() is not None


def decode_chunk_output(pixels: Any) -> None:
    """Called by a VAE with one temporal chunk of the clip it decodes, (B, C, frames, H, W) in [-1, 1], in
    order: runs the hook of `decode_output_scope`, if any."""
    hook = _output_hook.get()
    if hook is not None:
        hook(pixels)
