"""Packing a request into a `Handoff` (phases.py) after some of its phases, and unpacking it on another
engine's device for the next one.

What crosses is the `Req` as the phases done left it, whatever its family: its resolved params, noise
generator and CFG decision (input validation), its text embeddings, latents, latent grid, input-image
latents and family conditioning (encoding), its `Schedule`, step count and step times (denoising),
its timings. What does not cross is what belongs to the engine that ran the phase:

- always: its control hooks (`cancel_event`, `on_step`: the next engine sets its own) and the LoRA
  adapters it pinned (`loras`: ids in its own registry; the denoising engine pins its own);
- once denoised: what only the denoising steps read (`DENOISE_ONLY_FIELDS`): the DiT's embedding of the
  text, the multistep scheduler's history, the last prediction (previews), the step cache's residuals.

Tensors on an accelerator are copied to the CPU when packed and go to the receiving engine's device when
unpacked; tensors the request keeps on the CPU on purpose (`Schedule.host_sigmas`) stay there. The
values are bit-identical on arrival: a request run in phases on several engines computes what it would
on one.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
from typing import Any

import torch

from diffserve.phases import Handoff, Phase
from diffserve.request import Req

#: The fields a request's engine keeps for itself, cleared (to these values) in every hand-off.
LOCAL_FIELDS: dict[str, Any] = {"cancel_event": None, "on_step": None, "loras": ()}
#: The fields only its denoising steps read, cleared in a hand-off to the decode phase.
DENOISE_ONLY_FIELDS: dict[str, Any] = {
    "dit_context": None,
    "scheduler_state": None,
    "last_prediction": None,
    "step_cache": None,
}
#: The persistent id of a tensor that was on an accelerator: ("device", its index in the tensor list).
_DEVICE = "device"


class _Packer(pickle.Pickler):
    """Pickles a request with every accelerator tensor replaced by its index in `tensors` (a CPU copy,
    each tensor once however often the request refers to it)."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self._indices: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> tuple[str, int] | None:
        if isinstance(obj, torch.Tensor) and obj.device.type != "cpu":
            index = self._indices.get(id(obj))
            if index is None:
                index = self._indices[id(obj)] = len(self.tensors)
                self.tensors.append(obj.detach().cpu())
            return (_DEVICE, index)
        if isinstance(obj, torch.Generator) and obj.device.type != "cpu":
            raise TypeError(
                f"a request's noise generator on {obj.device} cannot be handed to another engine (its "
                "state belongs to that device); requests draw their noise from a CPU generator"
            )
        return None


class _Unpacker(pickle.Unpickler):
    """Unpickles a request packed by `_Packer`, its accelerator tensors taken from `tensors`."""

    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor]) -> None:
        super().__init__(file)
        self.tensors = tensors

    def persistent_load(self, pid: Any) -> torch.Tensor:
        kind, index = pid
        if kind != _DEVICE:
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r} in a request hand-off")
        return self.tensors[index]


def pack_handoff(req: Req, next_phase: Phase) -> Handoff:
    """`req` after the phases before `next_phase`, as a `Handoff` (module docstring). `req` itself is
    unchanged (its tensors are copied to the CPU, not moved)."""
    if next_phase == "encode":
        raise ValueError("a request is handed off after a phase: to denoise or decode, not to encode")
    if req.schedule is None:
        raise ValueError(f"request {req.request_id} has not been encoded: it has no schedule to hand off")
    if next_phase == "decode" and not req.is_denoised:
        raise ValueError(
            f"request {req.request_id} is at step {req.step_index} of {req.num_steps}: it is not ready to decode"
        )
    cleared = {**LOCAL_FIELDS, **(DENOISE_ONLY_FIELDS if next_phase == "decode" else {})}
    shipped = dataclasses.replace(req, **cleared)
    graph = io.BytesIO()
    packer = _Packer(graph)
    packer.dump(shipped)
    state = pickle.dumps((packer.tensors, graph.getvalue()), protocol=pickle.HIGHEST_PROTOCOL)
    return Handoff(request_id=req.request_id, next_phase=next_phase, state=state)


def unpack_handoff(handoff: Handoff, device: torch.device) -> Req:
    """The request of `handoff`, its accelerator tensors on `device` (module docstring). Raises
    ValueError when what arrived is not a request ready for `handoff.next_phase`."""
    tensors, graph = pickle.loads(handoff.state)
    moved = [tensor.to(device) for tensor in tensors]
    req = _Unpacker(io.BytesIO(graph), moved).load()
    if not isinstance(req, Req):
        raise ValueError(
            f"the hand-off of request {handoff.request_id} holds a {type(req).__name__}, not a Req"
        )
    if req.request_id != handoff.request_id:
        raise ValueError(f"the hand-off of request {handoff.request_id} holds request {req.request_id}")
    if req.schedule is None or (handoff.next_phase == "decode" and not req.is_denoised):
        raise ValueError(f"request {req.request_id} arrived not ready for its {handoff.next_phase} phase")
    return req
