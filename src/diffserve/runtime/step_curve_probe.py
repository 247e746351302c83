"""The batch policy's first measurements, taken at the server's warm-up: DiT steps of 1, 2, 4, ... probe
requests at the probe size, two of each (the first pays a shape's one-off costs and is left out), into the
policy's curve (runtime/batch_policy.py). Other sizes are measured while serving, where the policy
explores. Runs while no other request does: the probes are stepped directly, never queued or decoded. On
one rank one probe is encoded and the others are copies of it (an edit model's input-image encoding is
most of a tiny model's request); only their step times matter."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import replace

from diffserve.configs.sampling_params import SamplingParams
from diffserve.request import Req, new_request_id
from diffserve.runtime.batch_policy import token_bucket
from diffserve.runtime.engine import Engine
from diffserve.runtime.memory import RequestCost

logger = logging.getLogger("diffserve.runtime")

STEPS_PER_BATCH = 2


def batch_sizes_to_probe(most: int) -> list[int]:
    """1, 2, 4, ... up to `most`, which is always included."""
    sizes = [1]
    while sizes[-1] * 2 < most:
        sizes.append(sizes[-1] * 2)
    return sizes if sizes[-1] == most else [*sizes, most]


def measure_step_curve(engine: Engine, params: SamplingParams, most: int) -> list[int]:
    """Step up to `most` copies of `params` (seeds 0, 1, ...) in batches of `batch_sizes_to_probe`, as many
    as the scheduler's limits and memory model admit together; returns the batch sizes measured."""
    sizes = batch_sizes_to_probe(most)
    steps = STEPS_PER_BATCH * len(sizes) + 1  # the first probe runs in every batch
    reqs: list[Req] = []
    costs: list[RequestCost] = []
    try:
        for seed in range(sizes[-1]):
            copy = bool(reqs) and not engine.runner.mirrors_requests
            if copy:
                req, cost = dataclasses.replace(reqs[0], request_id=new_request_id()), costs[0]
            else:
                req = engine.runner.validate(
                    Req(params=replace(params, seed=seed, num_inference_steps=steps))
                )
                cost = engine.cost(req)
            if costs and not engine.scheduler.within_limits(costs, cost):
                break
            reqs.append(req if copy else engine.runner.pre_denoise(req))
            costs.append(cost)
        measured = [k for k in sizes if k <= len(reqs)]
        curve = engine.scheduler.policy.curve
        rows_each = costs[0].branches * costs[0].outputs
        bucket = token_bucket(costs[0].tokens)
        for k in measured:
            for _ in range(STEPS_PER_BATCH):
                engine.runner.denoise_step(reqs[:k], curve.samples(bucket, rows_each * k))
        engine.runner.flush_step_times()
    finally:
        for req in reqs:
            engine.runner.release(req)
    logger.info("Batch policy: step times measured at batches of %s: %s", measured, curve.snapshot())
    return measured
