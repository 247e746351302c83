"""The engine's runtime: the step-level request scheduler and the memory model that admits requests.

`StepScheduler` (scheduler.py) is the loop that decides, at every denoising step boundary, which
requests run; `MemoryModel` (memory.py) says how much memory a request needs and how much there is.
Neither knows about ZeroMQ or HTTP: the engine process drives them, and tests drive them in-process.
"""

from diffserve.runtime.memory import MemoryModel, RequestCost, RequestTooLargeError, calibrate_memory_model
from diffserve.runtime.scheduler import ScheduledRequest, SchedulerConfig, SchedulerEvents, StepScheduler

__all__ = [
    "MemoryModel",
    "RequestCost",
    "RequestTooLargeError",
    "ScheduledRequest",
    "SchedulerConfig",
    "SchedulerEvents",
    "StepScheduler",
    "calibrate_memory_model",
]
