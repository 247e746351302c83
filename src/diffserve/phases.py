"""A request's three phases run apart (disaggregated serving, `diffserve serve --ray --disaggregate`).

A pipeline runs every request through three phases: **encode** (its pre-denoise stages: validation's
results, text and image encoding, latents, timesteps), **denoise** (its steps, batched with other requests
by the engine) and **decode** (its post-denoise stages: the VAE, and what follows). One engine may run
only some of them for a request: `PhaseSpan` says which (the whole request by default). Between two
engines the request travels as a `Handoff`: its state after the phases done, as bytes.

This module imports neither torch nor the rest of diffserve: the front ends and Ray Serve's replica
actors, which only pass hand-offs on, stay light. Packing a request into a hand-off and unpacking it on
a device is the runtime's (`runtime/handoff.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Phase = Literal["encode", "denoise", "decode"]
#: The phases in the order a request runs them.
PHASES: tuple[Phase, ...] = ("encode", "denoise", "decode")


@dataclass(frozen=True)
class PhaseSpan:
    """The phases one engine runs for one request: `first` to `last`, in `PHASES` order. A span that
    starts after encode takes a request that arrived as a `Handoff`; one that ends before decode gives
    its request back as a `Handoff` for the next phase."""

    first: Phase = "encode"
    last: Phase = "decode"

    def __post_init__(self) -> None:
        for phase in (self.first, self.last):
            if phase not in PHASES:
                raise ValueError(f"unknown phase {phase!r}; the phases are {', '.join(PHASES)}")
        if PHASES.index(self.first) > PHASES.index(self.last):
            raise ValueError(f"a phase span runs forward: {self.first} comes after {self.last}")

    @classmethod
    def only(cls, phase: Phase) -> PhaseSpan:
        """The span of one phase."""
        return cls(phase, phase)

    def runs(self, phase: Phase) -> bool:
        """Whether this span runs `phase`."""
        return PHASES.index(self.first) <= PHASES.index(phase) <= PHASES.index(self.last)

    @property
    def whole(self) -> bool:
        """Every phase: the request neither arrives nor leaves as a hand-off."""
        return self.first == PHASES[0] and self.last == PHASES[-1]

    @property
    def next_phase(self) -> Phase | None:
        """The phase after this span (what its hand-off is for); None when the span ends with decode."""
        index = PHASES.index(self.last) + 1
        return PHASES[index] if index < len(PHASES) else None

    def __str__(self) -> str:
        return self.first if self.first == self.last else f"{self.first}-{self.last}"


#: Every phase: what an engine runs for a request unless told otherwise.
WHOLE = PhaseSpan()


@dataclass(frozen=True)
class Handoff:
    """One request between two phases, ready to cross processes and machines: `state` is its `Req` as
    the phases done left it, every tensor on the CPU (`runtime/handoff.py` packs and unpacks it). Bytes,
    not the `Req` itself: the processes it passes through on its way (Ray Serve's replica actors, the
    object store) need neither torch nor the request's classes, and one buffer travels in one piece."""

    request_id: str
    #: The phase the request runs next (where its tensors go back to the device).
    next_phase: Phase
    state: bytes

    @property
    def nbytes(self) -> int:
        return len(self.state)
