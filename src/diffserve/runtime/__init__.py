"""The engine's runtime: the request loop (`Engine`), the scheduler (`StepScheduler`), the runner
(`ModelRunner`) and the memory model; nothing here knows about ZeroMQ, HTTP or the CLI."""

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
