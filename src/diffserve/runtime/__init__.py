"""The engine's runtime: one request loop (`Engine`), the scheduler that decides what runs (`StepScheduler`),
the runner that executes it (`ModelRunner`), and the memory model that admits requests.

Nothing here knows about ZeroMQ, HTTP or the CLI: the API, the CLI and the server's engine process drive
the `Engine`, and tests drive it in-process.
"""

from diffserve.runtime.contract import EnginePipeline, PipelineFacts
from diffserve.runtime.engine import Engine, EngineEvents
from diffserve.runtime.memory import MemoryModel, RequestCost, RequestTooLargeError
from diffserve.runtime.runner import ModelRunner
from diffserve.runtime.scheduler import ScheduledRequest, SchedulerConfig, StepScheduler

__all__ = [
    "Engine",
    "EngineEvents",
    "EnginePipeline",
    "MemoryModel",
    "ModelRunner",
    "PipelineFacts",
    "RequestCost",
    "RequestTooLargeError",
    "ScheduledRequest",
    "SchedulerConfig",
    "StepScheduler",
]
