"""`diffserve generate --vae-tiling` reaches the VAE: its decode runs in tiles (and only with the flag)."""

from __future__ import annotations

from diffserve.cli.main import main


def test_vae_tiling_flag_tiles_the_decode(tiny_flux_dir, tmp_path, tiled_decodes, capfd) -> None:
    """The tiny FLUX VAE's tiles are 64 pixels (its sample_size): a 128x128 image needs several."""
    args = ["generate", "--model-path", str(tiny_flux_dir), "--prompt", "a fox", "--height", "128", "--width", "128",
            "--num-inference-steps", "1", "--seed", "1", "--output-path", str(tmp_path)]  # fmt: skip
    assert main(args) == 0
    assert tiled_decodes == [], "without --vae-tiling an image this size fits and is decoded whole"
    assert main([*args, "--vae-tiling"]) == 0
    assert tiled_decodes == [(1, 16, 16, 16)], tiled_decodes
    assert "VAE tiling (--vae-tiling) on: vae" in capfd.readouterr().err
