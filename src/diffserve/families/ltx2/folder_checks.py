"""Load-time checks that an LTX-2 folder's components fit together as Diffusers' LTX2Pipeline /
LTX2ImageToVideoPipeline use them.

Those pipelines pack the video latents into 1x1x1 tokens and the audio latents into one token per latent
step (every channel and mel bin of it), whatever the DiT's patch sizes say, and step each token stream
with the DiT's prediction. A folder whose configs disagree with that makes Diffusers fail in the middle
of a generation: a DiT `patch_size` / `patch_size_t` other than 1 (its `proj_in` gets unpatched
tokens), an `audio_patch_size_t` other than 1 (the audio RoPE has one position per `audio_patch_size_t`
steps, the tokens one per step), channel counts that differ from the VAEs' latents, and a scheduler with
`invert_sigmas` (its schedule starts at sigma 0, and the guidance's x0 <-> velocity conversion divides by
sigma: every value is NaN). diffserve refuses such a folder when it loads, naming the keys.

The DiT's `audio_patch_size` (mel) is read by no code path of these pipelines (the audio RoPE is
temporal only), so any value runs, as in Diffusers.
"""

from __future__ import annotations

from typing import Any

from diffserve.loader.folder_fit import refuse_unfit_folder
from diffserve.models.dits.ltx2 import LTX2VideoTransformer3DModel
from diffserve.models.vaes.autoencoder_kl_ltx2 import AutoencoderKLLTX2Video
from diffserve.models.vaes.autoencoder_kl_ltx2_audio import AutoencoderKLLTX2Audio


def check_ltx2_folder(
    transformer: LTX2VideoTransformer3DModel,
    vae: AutoencoderKLLTX2Video,
    audio_vae: AutoencoderKLLTX2Audio,
    scheduler_config: dict[str, Any],
) -> None:
    """ModelLoadError naming the config keys unless the DiT, both VAEs and the scheduler fit together as
    the Diffusers pipelines use them (module docstring)."""
    dit = transformer.config
    problems = []
    if (dit.patch_size, dit.patch_size_t) != (1, 1):
        problems.append(
            f"transformer patch_size={dit.patch_size}, patch_size_t={dit.patch_size_t}: the pipelines pack "
            "video latents into 1x1x1 tokens, so both must be 1"
        )
    if dit.audio_patch_size_t != 1:
        problems.append(
            f"transformer audio_patch_size_t={dit.audio_patch_size_t}: the pipelines make one audio token per "
            "latent step and the audio RoPE one position per audio_patch_size_t steps, so it must be 1"
        )
    latent_channels = int(vae.config["latent_channels"])
    for key in ("in_channels", "out_channels"):
        if getattr(dit, key) != latent_channels:
            problems.append(
                f"transformer {key}={getattr(dit, key)} differs from the video VAE's latent_channels "
                f"({latent_channels})"
            )
    audio_channels = int(audio_vae.config["latent_channels"]) * audio_vae.latent_mel_bins
    audio_source = (
        f"the audio VAE's latent_channels x mel_bins // {audio_vae.mel_compression_ratio} "
        f"({audio_vae.config['latent_channels']} x {audio_vae.latent_mel_bins})"
    )
    for key in ("audio_in_channels", "audio_out_channels"):
        if getattr(dit, key) != audio_channels:
            problems.append(f"transformer {key}={getattr(dit, key)} differs from {audio_source}")
    if audio_vae.config["base_channels"] != audio_channels:
        problems.append(
            f"audio_vae base_channels={audio_vae.config['base_channels']} (the length of its latent statistics) "
            f"differs from {audio_source}"
        )
    if scheduler_config.get("invert_sigmas"):
        problems.append(
            "scheduler invert_sigmas=True: the schedule starts at sigma 0, where the guidance's x0 <-> velocity "
            "conversion divides by sigma (Diffusers returns NaN)"
        )
    refuse_unfit_folder("LTX-2", problems)
