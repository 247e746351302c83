"""Refusing at load a model folder whose components do not fit together.

A folder whose configs disagree (a DiT reading other latent channels than its VAE writes, a text width
other than its encoder's, ...) makes Diffusers fail in the middle of the first generation, deep inside
torch. Each family's `folder_checks.py` lists what does not fit, each entry naming its config keys;
`refuse_unfit_folder` turns that list into one load error, worded the same for every family.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from diffserve.errors import ModelLoadError


def refuse_unfit_folder(pipeline: str, problems: Sequence[str]) -> None:
    """ModelLoadError listing `problems` when there are any; `pipeline` names the folder's pipeline."""
    if problems:
        raise ModelLoadError(
            f"this {pipeline} folder's components do not fit together: " + "; ".join(problems)
        )


def encoder_hidden_size(encoder: nn.Module) -> int:
    """The width of a transformers encoder's hidden states, which a DiT's text projection must take: a
    vision-language model's is its language model's (`PretrainedConfig.get_text_config()`)."""
    return int(encoder.config.get_text_config().hidden_size)
