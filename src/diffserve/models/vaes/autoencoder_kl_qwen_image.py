"""Diffusers' `AutoencoderKLQwenImage`: Qwen-Image's VAE, a fine-tune of the Wan 2.1 video VAE.

The network is Wan 2.1's VAE (`AutoencoderKLWan`, the shared causal 3-D VAE of `causal3d_blocks.py`);
this class takes Qwen-Image's config keys for it. Images are single-frame videos (T = 1), which is how Qwen-Image uses
it. State-dict keys match Diffusers', so checkpoints load with `strict=True` into a model built on the
meta device.
"""

from __future__ import annotations

from typing import Any, ClassVar

from diffserve.models.vaes.autoencoder_kl_wan import WAN_VAE_CONFIG_DEFAULTS, AutoencoderKLWan

#: Diffusers' `AutoencoderKLQwenImage` config keys and defaults (the released Qwen-Image VAE uses these): Wan
#: 2.1's, with `input_channels` for both `in_channels` and `out_channels` and none of Wan 2.2's keys.
#: `temperal_downsample` keeps Diffusers' spelling; `dropout` is accepted and unused (inference only).
QWEN_IMAGE_VAE_CONFIG_DEFAULTS: dict[str, Any] = {
    **{
        key: WAN_VAE_CONFIG_DEFAULTS[key]
        for key in (
            "base_dim",
            "z_dim",
            "dim_mult",
            "num_res_blocks",
            "attn_scales",
            "temperal_downsample",
            "dropout",
        )
    },
    "input_channels": 3,
    "latents_mean": WAN_VAE_CONFIG_DEFAULTS["latents_mean"],
    "latents_std": WAN_VAE_CONFIG_DEFAULTS["latents_std"],
}


class AutoencoderKLQwenImage(AutoencoderKLWan):
    """Qwen-Image's VAE with Diffusers' config keys and state-dict names: the Wan 2.1 network.

    Build it with keyword config values (`QWEN_IMAGE_VAE_CONFIG_DEFAULTS`; or `from_config(config_json_dict)`);
    under `torch.device("meta")` it allocates nothing, and `load_state_dict(sd, assign=True, strict=True)`
    fills it.
    """

    diffusers_class_name: ClassVar[str] = "AutoencoderKLQwenImage"
    config_defaults = QWEN_IMAGE_VAE_CONFIG_DEFAULTS

    def __init__(self, *, input_channels: int = 3, **wan_config: Any) -> None:
        """`input_channels` is Wan's `in_channels` and `out_channels`; the other keys are Wan's own."""
        super().__init__(in_channels=input_channels, out_channels=input_channels, **wan_config)
        wan = self.config
        self.config = {
            key: input_channels if key == "input_channels" else wan[key]
            for key in QWEN_IMAGE_VAE_CONFIG_DEFAULTS
        }
