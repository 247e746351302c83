"""DenoisingStage: runs a pipeline's `denoise_step` over one request until its steps are spent.

The step function takes a *list* of requests so the same code serves step-level batching later;
this stage is the single-request driver with the progress bar and per-step timings users expect.
The loop never waits for the device: step times come from marks in the device's work queue, read
once the device has passed them (`platforms/step_timer.py`), so the host queues step i + 1 while
the device still runs step i.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from tqdm.auto import tqdm

from diffserve.errors import RequestCancelledError
from diffserve.platforms import current_platform
from diffserve.platforms.step_timer import StepTimer
from diffserve.request import Req
from diffserve.stages.base import Stage

logger = logging.getLogger("diffserve.stages")

DenoiseStep = Callable[[list[Req]], None]

#: Seconds per step (not steps per second): the figure users compare between engines.
BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_inv_fmt}]"


class DenoisingStage(Stage):
    needs = ("latents", "sigmas", "timesteps", "prompt_embeds")
    sets = ("latents",)

    def __init__(self, denoise_step: DenoiseStep, show_progress: bool = True) -> None:
        self.denoise_step = denoise_step
        self.show_progress = show_progress

    def forward(self, req: Req) -> Req:
        timer = StepTimer(current_platform())
        try:
            self.run_steps(req, timer)
        except RequestCancelledError:
            timer.flush()  # the steps it took keep their times
            raise
        timer.flush()
        if req.step_times:
            logger.info(
                "[%s] average time per step: %.4f seconds", self.name, sum(req.step_times) / len(req.step_times)
            )
        log_step_cache(req)
        return req

    def run_steps(self, req: Req, timer: StepTimer) -> None:
        """Step `req` until its steps are spent (or it is cancelled), with a progress bar."""
        with tqdm(total=req.num_steps, disable=not self.show_progress, unit="step", bar_format=BAR_FORMAT) as bar:
            while not req.is_denoised:
                if req.cancelled:
                    raise RequestCancelledError(f"request {req.request_id} cancelled at step {req.step_index}")
                start = timer.start()
                self.denoise_step([req])
                timer.stop(start, req.step_times)
                bar.update(1)
                if req.on_step is not None:
                    req.on_step(req)


def log_step_cache(req: Req) -> None:
    """An approximate-quality request says how many of its steps ran the DiT blocks in full (the
    single-request driver above and the engine's `Pipeline.run_post_denoise` both call it)."""
    cache = req.step_cache
    if cache is not None:
        logger.info(
            "[%s] quality=%s: %d of %d steps computed in full, %d reused the cached residual",
            req.request_id[:8], req.params.quality, cache.steps_computed, req.num_steps, cache.steps_reused,
        )
