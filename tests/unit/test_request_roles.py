"""`Req`, its `Schedule` and the families' `Conditioning` classes declare how generic code treats their
fields (`request.role`); CFG branch views, the step state they copy, batch keys, schedule cuts and stage
contracts are derived from those declarations, so a family never lists its fields in the runtime."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import get_type_hints

import pytest
import torch

import diffserve.registry  # noqa: F401  (imports every family package: all conditioning classes exist)
from diffserve.configs.sampling_params import SamplingParams
from diffserve.families.hunyuan_video15.conditioning import HunyuanVideo15Conditioning
from diffserve.families.ltx2.conditioning import LTX2Conditioning
from diffserve.families.z_image.conditioning import ZImageConditioning
from diffserve.platforms import CpuPlatform
from diffserve.request import (
    Conditioning,
    LatentSize,
    Req,
    RequestOutputs,
    Schedule,
    Timings,
    batch_signature,
    field_role,
    negative_pairs,
    per_step_fields,
    role,
    stepped_fields,
)
from diffserve.runtime.runner import CfgBranchView, branch_view, copy_step_state
from diffserve.stages.base import Stage, StageContractError
from diffserve.stages.image_to_image import truncate_schedule
from diffserve.stages.reference_images import ReferenceImages


def _req(**values: object) -> Req:
    return Req(params=SamplingParams(prompt="x"), do_cfg=True, **values)  # type: ignore[arg-type]


def _all_conditioning_classes() -> list[type[Conditioning]]:
    found, todo = [], [Conditioning]
    while todo:
        for sub in todo.pop().__subclasses__():
            found.append(sub)
            todo.append(sub)
    return found


def test_req_stays_small() -> None:
    """`Req` holds what every request has: family-specific state lives in the families' conditioning
    classes, and what belongs together (the schedule, the outputs, the timings) in one typed object."""
    assert len(fields(Req)) <= 26  # 26: `generated`, read by the memory model for every request
    hints = get_type_hints(Req)
    assert hints["schedule"] == Schedule | None
    assert (hints["outputs"], hints["timings"]) == (RequestOutputs, Timings)


@pytest.mark.parametrize("cls", _all_conditioning_classes(), ids=lambda c: c.__name__)
def test_every_conditioning_class_declares_valid_roles(cls: type[Conditioning]) -> None:
    """An empty one can be made (a request starts with it), each negative field pairs with a positive
    field of its class and defaults to None (a view of the positive branch clears it)."""
    empty = cls()
    for positive, negative in negative_pairs(empty):
        assert positive in {f.name for f in fields(cls)}
        assert getattr(empty, negative) is None
    assert {field_role(f).batch for f in fields(cls)} <= {None, "shape", "value"}


def test_the_families_conditioning_moved_off_req() -> None:
    names = {f.name for f in fields(Req)}
    for cls in _all_conditioning_classes():
        assert not names & {f.name for f in fields(cls)}, f"{cls.__name__} repeats a Req field"


def test_branch_view_swaps_every_declared_negative_field_on_req_and_conditioning() -> None:
    t = {name: torch.full((1,), float(i)) for i, name in enumerate("abcdefghij")}
    conditioning = HunyuanVideo15Conditioning(
        prompt_embeds_mask=t["a"],
        negative_prompt_embeds_mask=t["b"],
        prompt_embeds_2=t["c"],
        negative_prompt_embeds_2=t["d"],
        prompt_embeds_mask_2=t["e"],
        negative_prompt_embeds_mask_2=t["f"],
        condition_latents=t["g"],
    )
    req = _req(prompt_embeds=t["h"], negative_prompt_embeds=t["i"], latents=t["j"], conditioning=conditioning)

    positive, negative = branch_view(req, 0), branch_view(req, 1)
    assert isinstance(negative, CfgBranchView) and negative.source is req and not negative.do_cfg
    assert positive.prompt_embeds is t["h"] and negative.prompt_embeds is t["i"]
    p, n = positive.conditioning, negative.conditioning
    assert isinstance(p, HunyuanVideo15Conditioning) and isinstance(n, HunyuanVideo15Conditioning)
    assert (p.prompt_embeds_mask, p.prompt_embeds_2, p.prompt_embeds_mask_2) == (t["a"], t["c"], t["e"])
    assert (n.prompt_embeds_mask, n.prompt_embeds_2, n.prompt_embeds_mask_2) == (t["b"], t["d"], t["f"])
    for view in (positive, negative):
        assert view.negative_prompt_embeds is None
        assert view.conditioning is not conditioning  # a copy: the request's own keeps both branches
        assert all(getattr(view.conditioning, neg) is None for _, neg in negative_pairs(conditioning))
        assert view.conditioning.condition_latents is t["g"] and view.latents is t["j"]
    assert conditioning.negative_prompt_embeds_mask is t["b"]


@dataclass
class NewTextBranch(Conditioning):
    """A family with a text branch the runtime has never heard of."""

    lyrics_embeds: torch.Tensor | None = None
    negative_lyrics_embeds: torch.Tensor | None = field(
        default=None, metadata=role(negative_of="lyrics_embeds")
    )
    melody: torch.Tensor | None = field(default=None, metadata=role(stepped=True, batch="shape"))


def test_a_new_family_text_branch_needs_only_its_declaration() -> None:
    positive_text, negative_text = torch.zeros(1), torch.ones(1)
    req = _req(conditioning=NewTextBranch(positive_text, negative_text, torch.zeros(2, 5, 3)))
    view = branch_view(req, 1)
    assert isinstance(view.conditioning, NewTextBranch)
    assert (
        view.conditioning.lyrics_embeds is negative_text and view.conditioning.negative_lyrics_embeds is None
    )

    # The view's step advances its own copy of the stepped conditioning field; it is copied back.
    view.conditioning.melody = torch.full((2, 5, 3), 7.0)
    view.step_index = 3
    copy_step_state(view, req)
    assert req.step_index == 3 and torch.equal(NewTextBranch.of(req).melody, torch.full((2, 5, 3), 7.0))
    assert batch_signature(req.conditioning) == (("melody", (5, 3)),)


def test_step_state_is_declared() -> None:
    assert stepped_fields(_req()) == ["latents", "step_index", "scheduler_state", "last_prediction"]
    assert stepped_fields(LTX2Conditioning()) == ["audio_latents"]


def test_batch_signature_compares_declared_shapes_and_values() -> None:
    a = ReferenceImages(condition_latents=torch.zeros(2, 8, 4), condition_shapes=[(1, 2, 4)])
    b = ReferenceImages(condition_latents=torch.zeros(1, 8, 4), condition_shapes=[(1, 2, 4)])
    transposed = ReferenceImages(condition_latents=torch.zeros(1, 8, 4), condition_shapes=[(1, 4, 2)])
    assert batch_signature(a) == batch_signature(b) != batch_signature(transposed)
    assert batch_signature(ReferenceImages()) == (("condition_latents", None), ("condition_shapes", ()))
    assert batch_signature(None) == ()


def test_image_to_image_cuts_declared_per_step_tables() -> None:
    """What the schedule and the conditioning declare `per_step` is cut; the rest is shared, not copied."""
    assert per_step_fields(Schedule.of_length(1)) == ["sigmas", "timesteps", "host_sigmas", "host_timesteps"]
    sigmas, guidance = torch.arange(5.0), torch.ones(1)
    req = _req(schedule=Schedule(sigmas, sigmas[:4], sigmas.clone(), guidance))
    ZImageConditioning.of(req).dit_timesteps = sigmas[:4] * 10
    truncate_schedule(req, 2)
    assert torch.equal(ZImageConditioning.of(req).dit_timesteps, torch.tensor([20.0, 30.0]))
    schedule = req.schedule
    assert schedule is not None and schedule.num_steps == req.num_steps == 2
    assert torch.equal(schedule.timesteps, torch.tensor([2.0, 3.0]))
    assert torch.equal(schedule.sigmas, schedule.host_sigmas) and schedule.sigmas.tolist() == [2.0, 3.0, 4.0]
    assert schedule.guidance is guidance


def test_conditioning_of_attaches_one_and_refuses_another_class() -> None:
    req = _req()
    made = LTX2Conditioning.of(req)
    assert req.conditioning is made and LTX2Conditioning.of(req) is made
    with pytest.raises(TypeError, match="LTX2Conditioning, not a ZImageConditioning"):
        ZImageConditioning.of(req)


class SetsAudio(Stage):
    needs = ("conditioning.audio_prompt_embeds",)
    sets = ("conditioning.audio_latents",)

    def forward(self, req: Req) -> Req:
        LTX2Conditioning.of(req).audio_latents = torch.zeros(1)
        return req


class SetsImages(Stage):
    needs = ("schedule", "latent_size")
    sets = ("outputs.images",)

    def forward(self, req: Req) -> Req:
        return req


def test_stage_contracts_name_fields_of_grouped_objects() -> None:
    req = _req(schedule=Schedule.of_length(2))
    with pytest.raises(StageContractError, match="needs latent_size"):
        SetsImages()(req, CpuPlatform())
    req.latent_size = LatentSize(4, 4)
    with pytest.raises(StageContractError, match="did not set outputs.images"):
        SetsImages()(req, CpuPlatform())
    req.outputs = RequestOutputs(images=[])
    assert SetsImages()(req, CpuPlatform()) is req


def test_stage_contracts_name_conditioning_fields() -> None:
    with pytest.raises(StageContractError, match="needs conditioning.audio_prompt_embeds"):
        SetsAudio()(_req(), CpuPlatform())
    req = _req(conditioning=LTX2Conditioning(audio_prompt_embeds=torch.zeros(1)))
    assert LTX2Conditioning.of(SetsAudio()(req, CpuPlatform())).audio_latents is not None


@pytest.mark.parametrize(
    "name", ["prompt_embed", "schedule.sigma", "outputs.paths", "latents.shape", "conditioning."]
)
def test_a_contract_naming_no_field_is_refused_when_the_stage_is_defined(name: str) -> None:
    with pytest.raises(TypeError, match="not a Req field"):

        class Typo(Stage):  # noqa: F841
            needs = (name,)
