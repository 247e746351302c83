"""Tiled and sliced VAE encode / decode: the parts every VAE shares, in Diffusers' scheme (what the engine
drives, `--vae-tiling` and automatic tiling, is in `diffserve/vae_tiling.py`).

Every VAE class of the repo carries the same switches as Diffusers' autoencoders (`TilingMixin`):

    use_tiling   False by default; `enable_tiling(**tile_params)` / `disable_tiling()`. The tile parameters
                 are each class's own, with Diffusers' names and defaults for that class (e.g. Wan's
                 `tile_sample_min_height/width` 256 and `tile_sample_stride_height/width` 192; AutoencoderKL's
                 `tile_sample_min_size`, `tile_latent_min_size`, `tile_overlap_factor`).
    use_slicing  False by default; `enable_slicing()` / `disable_slicing()`: a batch of B > 1 is encoded /
                 decoded one element at a time (`per_sample`), which bounds the activations by one element's.

How a tiled decode goes (Diffusers' `tiled_decode`, which results must match, so keep to it exactly):

1. The latent is cut into tiles of `tile_latent_min` rows x columns starting every `tile_latent_stride`
   (`tile_starts`); neighbouring tiles overlap by `min - stride` latents. Edge tiles are just cut short.
2. Each tile is decoded alone (video VAEs: its frames in temporal chunks with the causal cache, exactly
   as the untiled decode runs the whole frame; VAEs that tile time too cut overlapping chunks of frames).
3. `stitch_tiles`: going row by row, left to right, each tile's first `blend_height` rows are cross-faded
   with the bottom rows of the tile above (`blend_v`) and then its first `blend_width` columns with the
   right columns of the tile to its left (`blend_h`); the top-left `keep_height x keep_width` of each
   tile (one stride of output) is kept, and the kept pieces are concatenated. The blends write into the
   tile *in place*, and the next tile down / right blends against that already-blended tile: Diffusers
   does the same and the output depends on it. `blend_t` is the same cross-fade along frames, for VAEs
   that cut time into overlapping chunks.
4. The caller crops to the full output size where Diffusers does, and clamps where the untiled path does.

Tiled encode is the mirror image (tiles of pixels, blending and keeping in latents). When one tile covers
the whole input, every class takes its untiled path, so the output is bit-identical to the untiled one.

The cross-fade: in an overlap of `n` rows, row `i` becomes `a[-n + i] * (1 - i / n) + b[i] * (i / n)`;
the weights are computed in float64 and rounded to the tensor's dtype, as Python scalars are in Diffusers'
per-row loop, so float32 results equal Diffusers' bit for bit. Half-precision tiles are blended in float32
and rounded once (Diffusers rounds each product and the sum: the difference is within a half-precision ulp).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from diffserve.vae_tiling import decode_chunk_boundary

__all__ = ["decode_chunk_boundary"]  # re-exported: the VAEs call it before each decode chunk

#: Dims of the cross-fades, counted from the end so (B, C, H, W) images and (B, C, T, H, W) videos share them.
ROWS_DIM, COLUMNS_DIM, FRAMES_DIM = -2, -1, -3


def blend(a: torch.Tensor, b: torch.Tensor, extent: int, dim: int) -> torch.Tensor:
    """Cross-fade the last `extent` entries of `a` along `dim` into the first `extent` of `b`, in place.

    Entry i of the overlap becomes `a[-extent + i] * (1 - i / extent) + b[i] * (i / extent)`. `extent` is
    capped at both tensors' lengths along `dim`; 0 or less leaves `b` as it is. Returns `b`.
    """
    extent = min(a.shape[dim], b.shape[dim], extent)
    if extent <= 0:
        return b
    compute = b.dtype if b.dtype in (torch.float32, torch.float64) else torch.float32
    ramp = torch.arange(extent, dtype=torch.float64, device=b.device) / extent
    shape = [1] * b.ndim
    shape[dim] = extent
    fade_in = ramp.to(compute).view(shape)
    fade_out = (1 - ramp).to(compute).view(shape)
    head = b.narrow(dim, 0, extent)
    tail = a.narrow(dim, a.shape[dim] - extent, extent)
    mixed = tail.to(compute) * fade_out + head.to(compute) * fade_in
    head.copy_(mixed)
    return b


def blend_v(a: torch.Tensor, b: torch.Tensor, extent: int) -> torch.Tensor:
    """`blend` along rows: the tile `a` above fades into the top `extent` rows of `b` (in place, returns b)."""
    return blend(a, b, extent, ROWS_DIM)


def blend_h(a: torch.Tensor, b: torch.Tensor, extent: int) -> torch.Tensor:
    """`blend` along columns: the tile `a` to the left fades into the first `extent` columns of `b`."""
    return blend(a, b, extent, COLUMNS_DIM)


def blend_t(a: torch.Tensor, b: torch.Tensor, extent: int) -> torch.Tensor:
    """`blend` along frames of (B, C, T, H, W): the earlier chunk `a` fades into the first `extent` frames of `b`."""
    return blend(a, b, extent, FRAMES_DIM)


def tile_starts(size: int, stride: int) -> range:
    """Where the tiles along one side of `size` start: every `stride` from 0 (the last may be short)."""
    if stride < 1:
        raise ValueError(f"a tile stride must be at least 1 (latent / pixel units), got {stride}")
    return range(0, size, stride)


def stitch_tiles(
    rows: Sequence[Sequence[torch.Tensor]],
    blend_height: int,
    blend_width: int,
    keep_height: int,
    keep_width: int,
) -> torch.Tensor:
    """Blend a grid of decoded (or encoded) tiles and concatenate one stride of each into one tensor.

    `rows[i][j]` is the tile at row i, column j, all (..., H_tile, W_tile) with the same leading dims.
    Each tile is first blended with the tile above (`blend_v`, `blend_height` rows), then with the tile to
    its left (`blend_h`, `blend_width` columns), in place, in row-major order; then its top-left
    `keep_height x keep_width` is kept. The result may be larger than the wanted output (when the last tiles
    are longer than a stride): crop it where Diffusers does.
    """
    stitched_rows = []
    for i, row in enumerate(rows):
        kept = []
        for j, tile in enumerate(row):
            if i > 0:
                tile = blend_v(rows[i - 1][j], tile, blend_height)
            if j > 0:
                tile = blend_h(row[j - 1], tile, blend_width)
            kept.append(tile[..., :keep_height, :keep_width])
        stitched_rows.append(torch.cat(kept, dim=COLUMNS_DIM))
    return torch.cat(stitched_rows, dim=ROWS_DIM)


def run_tiles(
    fn: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    tile: tuple[int, int],
    stride: tuple[int, int],
    blend: tuple[int, int],
    keep: tuple[int, int],
) -> torch.Tensor:
    """`fn` on every tile of `x`'s last two dims and the outputs stitched: (rows, columns) tiles of `tile`
    starting every `stride` (`tile_starts`), run in row-major order, then `stitch_tiles` with `blend` output
    rows / columns cross-faded and `keep` kept per tile. Not cropped."""
    rows = [
        [fn(x[..., i : i + tile[0], j : j + tile[1]]) for j in tile_starts(x.shape[-1], stride[1])]
        for i in tile_starts(x.shape[-2], stride[0])
    ]
    return stitch_tiles(rows, *blend, *keep)


def run_overlapping_tiles(
    fn: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    tile: tuple[int, int],
    out_tile: tuple[int, int],
    overlap: float,
) -> torch.Tensor:
    """`run_tiles` with Diffusers' overlap-factor parameters (AutoencoderKL, HunyuanVideo-1.5): tiles of
    `tile` start every `int(tile * (1 - overlap))`; of each output (`out_tile`), `int(out_tile * overlap)`
    rows / columns are cross-faded and the rest kept. Not cropped (Diffusers does not crop either)."""
    stride = (int(tile[0] * (1 - overlap)), int(tile[1] * (1 - overlap)))
    blend = (int(out_tile[0] * overlap), int(out_tile[1] * overlap))
    return run_tiles(fn, x, tile, stride, blend, (out_tile[0] - blend[0], out_tile[1] - blend[1]))


def per_sample(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, sliced: bool) -> torch.Tensor:
    """`fn(x)`, or with `sliced` and a batch of more than one, `fn` on each batch element concatenated
    (Diffusers' slicing: the same result, one element's activations at a time). Each element is a decode
    chunk (`decode_chunk_boundary` before it)."""
    if not sliced or x.shape[0] <= 1:
        return fn(x)
    return torch.cat([_chunk(fn, element) for element in x.split(1)])


def _chunk(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    decode_chunk_boundary()
    return fn(x)


class TilingMixin:
    """`use_tiling` / `use_slicing` (False until enabled) and the switches that need no parameters.

    A VAE class adds `enable_tiling(...)` with its own Diffusers tile parameters (all optional keywords,
    None keeping the current value, so `enable_tiling()` alone turns tiling on with the defaults) and honours
    both flags in `decode` (and `encode`) exactly as its Diffusers class does.
    """

    use_tiling: bool = False
    use_slicing: bool = False

    def tiles_needed(self, x: torch.Tensor, tile_height: int, tile_width: int) -> bool:
        """Whether tiling is on and `x` (..., H, W) is larger than one `tile_height x tile_width` tile."""
        return self.use_tiling and (x.shape[-1] > tile_width or x.shape[-2] > tile_height)

    def _enable_tiling_with(self, **tile_params: float | None) -> None:
        """Turn tiling on, setting each tile parameter given: None (or 0, as in Diffusers) keeps the
        current value."""
        for name, value in tile_params.items():
            if value:
                setattr(self, name, value)
        self.use_tiling = True

    def _check_overlap_factor(self, tile_overlap_factor: float | None) -> None:
        """`enable_tiling`'s check of a fractional overlap (None: kept): it must be in (0, 1)."""
        if tile_overlap_factor is not None and not 0.0 < tile_overlap_factor < 1.0:
            raise ValueError(
                f"{self.diffusers_class_name}.enable_tiling: tile_overlap_factor must be in (0, 1), "
                f"got {tile_overlap_factor}"
            )

    def disable_tiling(self) -> None:
        """Decode (and encode) the whole frame in one go again; the tile parameters are kept."""
        self.use_tiling = False

    def enable_slicing(self) -> None:
        """Encode / decode a batch one element at a time (same result, less memory for B > 1)."""
        self.use_slicing = True

    def disable_slicing(self) -> None:
        """Encode / decode the whole batch at once."""
        self.use_slicing = False


class StridedTilingMixin(TilingMixin):
    """`TilingMixin` for the VAEs whose Diffusers tile parameters are pixel sizes and strides (DC-AE, Wan,
    Qwen-Image, LTX-2): tiles of `tile_sample_min_height x _width` pixels every `tile_sample_stride_*`
    pixels, which `run_strided_tiles` cuts in the input's units and stitches in the output's."""

    tile_sample_min_height: int
    tile_sample_min_width: int
    tile_sample_stride_height: int
    tile_sample_stride_width: int

    def enable_tiling(
        self,
        tile_sample_min_height: int | None = None,
        tile_sample_min_width: int | None = None,
        tile_sample_stride_height: int | None = None,
        tile_sample_stride_width: int | None = None,
    ) -> None:
        """Encode / decode frames larger than a tile in overlapping tiles (Diffusers' parameters, in pixels:
        tiles of `tile_sample_min_*`, one every `tile_sample_stride_*`); None keeps the current value."""
        self._enable_tiling_with(
            tile_sample_min_height=tile_sample_min_height,
            tile_sample_min_width=tile_sample_min_width,
            tile_sample_stride_height=tile_sample_stride_height,
            tile_sample_stride_width=tile_sample_stride_width,
        )

    def run_strided_tiles(
        self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, in_scale: int, out_scale: int
    ) -> torch.Tensor:
        """`run_tiles` over this VAE's tiles: the input has `in_scale` pixels per unit (1 for pixels, the
        compression ratio for latents), the output `out_scale`; each output tile keeps one stride and
        blends the rest of the tile, each rounded down to output units. Not cropped."""
        tile_h, tile_w = self.tile_sample_min_height, self.tile_sample_min_width
        stride_h, stride_w = self.tile_sample_stride_height, self.tile_sample_stride_width
        return run_tiles(
            fn,
            x,
            (tile_h // in_scale, tile_w // in_scale),
            (stride_h // in_scale, stride_w // in_scale),
            (tile_h // out_scale - stride_h // out_scale, tile_w // out_scale - stride_w // out_scale),
            (stride_h // out_scale, stride_w // out_scale),
        )
