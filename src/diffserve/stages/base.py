"""`Stage`: one step of a pipeline over a `Req`, holding modules, never request state. The request
fields it `needs` and `sets` are checked, and it is timed (including its device work) and logged as
SGLang Diffusion does (`[TextEncodingStage] finished in 0.0123 seconds`).

A contract names `Req` fields ("latents") and fields of the objects `Req` groups them in, as
"<group>.<field>": its `Schedule` ("schedule.guidance"), its `RequestOutputs` ("outputs.images"), and its
family's conditioning ("conditioning.audio_latents", any field name: the class is the family's). A name that
is none of these is refused when the stage class is defined."""

from __future__ import annotations

import logging
import time
import types
from dataclasses import fields, is_dataclass
from typing import ClassVar, get_args, get_type_hints

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


def _groups() -> dict[str, type]:
    """The `Req` fields that hold a dataclass (optionally None), by name, with that class."""
    groups = {}
    for name, hint in get_type_hints(Req).items():
        candidates = get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        classes = [c for c in candidates if isinstance(c, type) and is_dataclass(c)]
        if len(classes) == 1:
            groups[name] = classes[0]
    return groups


_REQ_FIELDS = frozenset(f.name for f in fields(Req))
_GROUPS = _groups()


def _is_contract_name(name: str) -> bool:
    """A `Req` field, or "<group>.<field>" of a grouped object's class; any field of the conditioning, whose
    class (a subclass of `Conditioning`) is the family's."""
    group, dot, member = name.partition(".")
    if not dot:
        return name in _REQ_FIELDS
    cls = _GROUPS.get(group)
    if cls is None or not member:
        return False
    return cls is Conditioning or member in {f.name for f in fields(cls)}


def contract_value(req: Req, name: str) -> object:
    """The value a contract name refers to: a `Req` field, or for "<group>.<field>" that field of the
    grouped object (None when the request has none, or when its conditioning's class lacks the field)."""
    group, dot, member = name.partition(".")
    value = getattr(req, group)
    if not dot or value is None:
        return value
    return getattr(value, member, None)


class Stage:
    needs: ClassVar[tuple[str, ...]] = ()
    sets: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: object) -> None:
        """Refuse a contract name that is not a `Req` field nor a "<group>.<field>" (a typo would
        otherwise make the check fail at run time, or never)."""
        super().__init_subclass__(**kwargs)
        for name in (*cls.needs, *cls.sets):
            if not _is_contract_name(name):
                raise TypeError(
                    f"{cls.__name__} declares {name!r}, which is not a Req field nor <group>.<field> "
                    f"(groups: {', '.join(sorted(_GROUPS))})"
                )

    @property
    def name(self) -> str:
        return type(self).__name__

    def forward(self, req: Req) -> Req:
        raise NotImplementedError

    def __call__(self, req: Req, platform: Platform) -> Req:
        """Run `forward` on `req` with its contract checked, timed into `req.timings.stages`."""
        missing = [f for f in self.needs if contract_value(req, f) is None]
        if missing:
            raise StageContractError(f"{self.name} needs {', '.join(missing)} but they are not set")
        logger.info("[%s] started...", self.name)
        start = time.perf_counter()
        req = self.forward(req)
        platform.synchronize()
        elapsed = time.perf_counter() - start
        req.timings.stages[self.name] = elapsed
        unset = [f for f in self.sets if contract_value(req, f) is None]
        if unset:
            raise StageContractError(f"{self.name} did not set {', '.join(unset)}")
        logger.info("[%s] finished in %.4f seconds", self.name, elapsed)
        return req
