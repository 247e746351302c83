"""`Stage`: one step of a pipeline over a `Req`.

A stage declares the request fields it needs (checked before it runs) and the fields it sets
(checked after), and the base class times it and logs it the way users of SGLang Diffusion expect
(`[TextEncodingStage] finished in 0.0123 seconds`). Stages hold modules, never request state.

The caller passes the platform the stage's modules run on (`stage(req, platform)`; pipelines pass
their `context.platform`): the timing waits for that platform's queued work, so a stage's time
includes its device work, and two pipelines on different platforms each wait for their own device.
"""

from __future__ import annotations

import logging
import time
from typing import ClassVar

from diffserve.platforms.base import Platform
from diffserve.request import Req

logger = logging.getLogger("diffserve.stages")


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
        """Run `forward` on `req` with its contract checked, timed into `req.timings` (waiting for
        `platform`'s queued work before the clock stops)."""
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
