"""`RequestCache`: one request's cache accelerator, whatever the method, as the batch sees it.

Each DiT forward, for each request in the batch (`batch.py`):

1. `plan(step, num_steps)`: COMPUTE (the blocks must run: warm-up, a mask's 1, a limit reached), REUSE
   (a schedule says so: MagCache, TaylorSeer's interval, a static mask) or MEASURE (decide from a probe).
2. The probe, where the method has one (`probe`): "signal", the first block's timestep-modulated input
   (TeaCache, the step cache), before any block runs; "input", the blocks' input (EasyCache), also
   before; "latent", the request's input latents on their grid and the step's sigma (SeaCache: its
   `indicator(grid, sigma)` is the probe), before; "residual", the output of blocks
   `[probe_base, span()[0])` minus their input (DBCache), after those blocks ran. `measure(probe)` gives
   its change as a 0-d tensor (the batch fetches every request's in one transfer), `decide(change)` the
   choice, and `keep_probe` what the method remembers of it.
3. The blocks of `span()` = (first, last) run, or are replaced by `reused_residual()` added to their input;
   blocks before `first` and from `last` on always run. After a computed span, `store(residual)`.
4. `record(reused)` counts the step: steps and blocks computed or reused, reported per request.

The rows of one request (its outputs and CFG branches) decide together, unless its method keeps the CFG
branch apart (DBCache's `enable_separate_cfg`, cache-dit's): that branch's rows then have a state of their
own (`cfg_branch`), with its own probe reference, residual, counters and decisions.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Literal

import torch

from diffserve.models.cache_methods.blocks import Streams
from diffserve.models.cache_methods.taylor import TaylorSeries
from diffserve.models.cache_methods.unconditional_branch import UnconditionalBranch

Probe = Literal["none", "signal", "input", "residual", "latent"]


class Plan(enum.Enum):
    COMPUTE = "compute"
    REUSE = "reuse"
    MEASURE = "measure"


def relative_l1(current: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor | None:
    """mean |current - previous| / mean |previous| as a 0-d tensor (no host sync); None without a
    comparable previous value."""
    if previous is None or previous.shape != current.shape:
        return None
    return (current - previous).abs().mean() / previous.abs().mean().clamp_min(1e-12)


class RequestCache(ABC):
    """One request's cache state and counts. Subclasses implement a method (`models/cache_methods/`)."""

    method: ClassVar[str]
    probe: ClassVar[Probe] = "none"

    def __init__(self, num_blocks: int) -> None:
        #: The DiT's blocks, as the cache counts them (`CacheRule.num_blocks`).
        self.num_blocks = num_blocks
        #: Per step: True when the span's blocks ran, False when their residual was reused.
        self.history: list[bool] = []
        self.blocks_computed = 0
        self.blocks_reused = 0
        #: The quality tier whose preset this cache runs (None: the request named its `cache` itself).
        self.tier: str | None = None
        #: The CFG (negative prompt) branch's own cache, for a method that keeps it apart
        #: (`enable_separate_cfg`); None: the branches decide together, with this state.
        self.cfg_branch: RequestCache | None = None
        #: A method that skips the CFG request's negative branch on some steps and approximates its
        #: prediction (FasterCache's, `unconditional_branch.py`); None: both branches run every step.
        self.unconditional: UnconditionalBranch | None = None

    # -- what the batch asks ----------------------------------------------------------------------------

    @property
    def kept_states(self) -> int:
        """Hidden states per token this cache keeps (its residual, probe reference, Taylor factors): what
        the admission control counts for it."""
        return 2

    def span(self) -> tuple[int, int]:
        """(first, last): the blocks `[first, last)` that a reused step skips; default all of them."""
        return 0, self.num_blocks

    @property
    def probe_base(self) -> int:
        """A residual probe's base: the block whose input the probed blocks' output is compared with (the
        probe is the residual of blocks `[probe_base, span()[0])`)."""
        return 0

    @abstractmethod
    def plan(self, step: int, num_steps: int) -> Plan:
        """This step's plan, before any probe (see the module docstring)."""

    def measure(self, probe: torch.Tensor) -> torch.Tensor | None:
        """The probe's change since the method's reference, a 0-d tensor (None: no reference yet)."""
        raise NotImplementedError(f"{self.method} takes no probe")

    def decide(self, change: float | None, step: int, num_steps: int) -> bool:
        """True to reuse, for a MEASURE plan, given the probe's change."""
        raise NotImplementedError(f"{self.method} decides without a probe")

    def indicator(self, grid: torch.Tensor, sigma: float) -> torch.Tensor:
        """A "latent" probe from the request's latent grid and sigma."""
        raise NotImplementedError(f"{self.method} does not probe the latents")

    def keep_probe(self, probe: torch.Tensor, reused: bool) -> None:
        """Remember what the method compares the next probe with (called every step it probes)."""
        return None

    @abstractmethod
    def reused_residual(self, step: int) -> Streams:
        """What a reused step adds to the span's input (the cached residual, or its extrapolation)."""

    @abstractmethod
    def store(self, residual: Streams, step: int) -> None:
        """Keep the residual of a step that ran the span."""

    @property
    def has_residual(self) -> bool:
        """Whether a residual is cached (a step cannot reuse before one is)."""
        raise NotImplementedError

    # -- counts -----------------------------------------------------------------------------------------

    def record(self, reused: bool) -> None:
        """Count one step (its blocks from `span()`)."""
        first, last = self.span()
        skipped = last - first if reused else 0
        self.history.append(not reused)
        self.blocks_reused += skipped
        self.blocks_computed += self.num_blocks - skipped

    @property
    def steps_computed(self) -> int:
        return sum(self.history)

    @property
    def steps_reused(self) -> int:
        return len(self.history) - self.steps_computed

    def report(self) -> dict[str, Any]:
        """What a response says about this request's cache: the method, its settings, the counts, and for
        a quality tier's preset the tier (`quality`)."""
        return {
            **({} if self.tier is None else {"quality": self.tier}),
            "method": self.method,
            "settings": self.settings_report(),
            "steps_computed": self.steps_computed,
            "steps_reused": self.steps_reused,
            "blocks_computed": self.blocks_computed,
            "blocks_reused": self.blocks_reused,
            **self.extra_report(),
            **({} if self.cfg_branch is None else {"cfg_branch": self.cfg_branch.counts_report()}),
        }

    def counts_report(self) -> dict[str, Any]:
        """The steps and blocks this state computed and reused (a separate CFG branch's report)."""
        return {
            "steps_computed": self.steps_computed,
            "steps_reused": self.steps_reused,
            "blocks_computed": self.blocks_computed,
            "blocks_reused": self.blocks_reused,
        }

    def settings_report(self) -> dict[str, Any]:
        return {}

    def extra_report(self) -> dict[str, Any]:
        """Method-specific figures (MagCache's measured ratios)."""
        return {}


class CachedResidual:
    """A request's cached residual (`Streams`): the last computed one, or, per stream with a TaylorSeer
    order, its Taylor extrapolation to the reusing step (`taylor.py`)."""

    def __init__(
        self, image_order: int | None = None, text_order: int | None = None, first_difference_step: int = 0
    ) -> None:
        self.residual: Streams | None = None
        self.image_series = None if image_order is None else TaylorSeries(image_order, first_difference_step)
        self.text_series = None if text_order is None else TaylorSeries(text_order, first_difference_step)

    @property
    def present(self) -> bool:
        return self.residual is not None

    def store(self, residual: Streams, step: int) -> None:
        text = None if residual.text is None else residual.text.detach()
        self.residual = Streams(residual.image.detach(), text)
        if self.image_series is not None:
            self.image_series.update(self.residual.image, step)
        if self.text_series is not None and text is not None:
            self.text_series.update(text, step)

    def at(self, step: int) -> Streams:
        """The residual to add at `step` (RuntimeError before any was stored)."""
        if self.residual is None:
            raise RuntimeError("no residual is cached yet: a step must compute the blocks first")
        image, text = self.residual.image, self.residual.text
        if self.image_series is not None:
            image = self.image_series.predict(step)
        if self.text_series is not None and text is not None:
            text = self.text_series.predict(step)
        return Streams(image, text)
