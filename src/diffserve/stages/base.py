"""`Stage`: one step of a pipeline over a `Req`, holding modules, never request state. The request
fields it `needs` and `sets` are checked, and it is timed (including its device work) and logged as
SGLang Diffusion does (`[TextEncodingStage] finished in 0.0123 seconds`)."""

from __future__ import annotations

import logging
import time
from typing import ClassVar

import torch
from torch import nn

from diffserve.platforms.base import Platform
from diffserve.request import Req

logger = logging.getLogger("diffserve.stages")


def to_module(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`x` on the device and in the dtype of `module`'s (first) parameters."""
    param = next(module.parameters())
    return x.to(device=param.device, dtype=param.dtype)


class StageContractError(RuntimeError):
    """A stage ran without a field it needs, or did not set a field it promised (a pipeline bug)."""


class Stage:
    needs: ClassVar[tuple[str, ...]] = ()
    sets: ClassVar[tuple[str, ...]] = ()

    @property
    def name(self) -> str:
        return type(self).__name__

    def forward(self, req: Req) -> Req:
        raise NotImplementedError

    def __call__(self, req: Req, platform: Platform) -> Req:
        """Run `forward` on `req` with its contract checked, timed into `req.timings`."""
        missing = [f for f in self.needs if getattr(req, f) is None]
        if missing:
            raise StageContractError(f"{self.name} needs {', '.join(missing)} but they are not set")
        logger.info("[%s] started...", self.name)
        start = time.perf_counter()
        req = self.forward(req)
        platform.synchronize()
        elapsed = time.perf_counter() - start
        req.timings[self.name] = elapsed
        unset = [f for f in self.sets if getattr(req, f) is None]
        if unset:
            raise StageContractError(f"{self.name} did not set {', '.join(unset)}")
        logger.info("[%s] finished in %.4f seconds", self.name, elapsed)
        return req
