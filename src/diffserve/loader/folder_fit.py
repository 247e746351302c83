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
from diffserve.models.schedulers.dpm_solver_flow import DPMSolverFlowScheduler
from diffserve.models.schedulers.flow_match_euler import FlowMatchEulerScheduler
from diffserve.models.schedulers.unipc_flow import UniPCFlowScheduler


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


def refuse_dynamic_shifting_without_mu(
    scheduler: FlowMatchEulerScheduler | UniPCFlowScheduler | DPMSolverFlowScheduler, pipeline: str
) -> None:
    """ModelLoadError for a scheduler that shifts its schedule by a resolution `mu` (`use_dynamic_shifting`)
    in a pipeline that passes none, as its Diffusers counterpart does (which then fails at every call):
    FlowMatchEuler and UniPC need one. A DPM-Solver keeps its static `flow_shift` without one, as in
    Diffusers, so it is taken."""
    if scheduler.config.get("use_dynamic_shifting") and not isinstance(scheduler, DPMSolverFlowScheduler):
        raise ModelLoadError(
            f"scheduler/scheduler_config.json: use_dynamic_shifting=True is not supported by {pipeline}: it "
            f"passes its {type(scheduler).__name__} no resolution shift mu (as Diffusers' pipeline, which fails "
            "at every call); set use_dynamic_shifting to false (the config's static shift then applies)"
        )
