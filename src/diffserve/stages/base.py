"""`Stage`: one step of a pipeline over a `Req`, holding modules, never request state. The request
fields it `needs` and `sets` are checked, and it is timed (including its device work) and logged as
SGLang Diffusion does (`[TextEncodingStage] finished in 0.0123 seconds`).

A contract names `Req` fields ("latents") and fields of the request's family conditioning
("conditioning.audio_latents"); a name that is neither is refused when the stage class is defined."""

from __future__ import annotations

import logging
import time
from dataclasses import fields
from typing import ClassVar

import torch
from torch import nn

from diffserve.platforms.base import Platform
from diffserve.request import Conditioning, Req

logger = logging.getLogger("diffserve.stages")


def to_module(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`x` on the device and in the dtype of `module`'s (first) parameters."""
    param = next(module.parameters())
    return x.to(device=param.device, dtype=param.dtype)


class StageContractError(RuntimeError):
    """A stage ran without a field it needs, or did not set a field it promised (a pipeline bug)."""


#: The prefix of a contract name that is a field of the request's `Conditioning`.
CONDITIONING = "conditioning."
_REQ_FIELDS = frozenset(f.name for f in fields(Req))


def contract_value(req: Req, name: str) -> object:
    """The value a contract name refers to: a `Req` field, or for "conditioning.<field>" that field of
    the request's conditioning (None when the request has none, or when its class lacks the field)."""
    if not name.startswith(CONDITIONING):
        return getattr(req, name)
    conditioning: Conditioning | None = req.conditioning
    return getattr(conditioning, name.removeprefix(CONDITIONING), None)


class Stage:
    needs: ClassVar[tuple[str, ...]] = ()
    sets: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: object) -> None:
        """Refuse a contract name that is not a `Req` field nor a "conditioning.<field>" (a typo would
        otherwise make the check fail at run time, or never)."""
        super().__init_subclass__(**kwargs)
        for name in (*cls.needs, *cls.sets):
            if name not in _REQ_FIELDS and not (
                name.startswith(CONDITIONING) and len(name) > len(CONDITIONING)
            ):
                raise TypeError(
                    f"{cls.__name__} declares {name!r}, which is not a Req field nor conditioning.<field>"
                )

    @property
    def name(self) -> str:
        return type(self).__name__

    def forward(self, req: Req) -> Req:
        raise NotImplementedError

    def __call__(self, req: Req, platform: Platform) -> Req:
        """Run `forward` on `req` with its contract checked, timed into `req.timings`."""
        missing = [f for f in self.needs if contract_value(req, f) is None]
        if missing:
            raise StageContractError(f"{self.name} needs {', '.join(missing)} but they are not set")
        logger.info("[%s] started...", self.name)
        start = time.perf_counter()
        req = self.forward(req)
        platform.synchronize()
        elapsed = time.perf_counter() - start
        req.timings[self.name] = elapsed
        unset = [f for f in self.sets if contract_value(req, f) is None]
        if unset:
            raise StageContractError(f"{self.name} did not set {', '.join(unset)}")
        logger.info("[%s] finished in %.4f seconds", self.name, elapsed)
        return req
