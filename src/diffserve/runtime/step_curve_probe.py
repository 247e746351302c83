"""The batch policy's first measurements, taken at the server's warm-up: DiT steps of 1, 2, 4, ... probe
requests at the probe size, two of each (the first pays a shape's one-off costs and is left out), into the
policy's curve (runtime/batch_policy.py). Other sizes are measured while serving, where the policy
explores. Runs while no other request does: the probes are stepped directly, never queued or decoded. On
one rank one probe is encoded and the others are copies of it (an edit model's input-image encoding is
most of a tiny model's request) that share its inputs but each step a state of its own (`probe_copy`);
only their step times matter. A probe request with fewer denoising steps than the measurement runs (a
family whose probe has nothing to denoise) is not measured: that is logged, and the policy measures while
serving."""

from __future__ import annotations

import logging
from copy import deepcopy
from dataclasses import replace

from diffserve.configs.sampling_params import SamplingParams
from diffserve.request import Req, new_request_id, stepped_fields
from diffserve.runtime.batch_policy import token_bucket
from diffserve.runtime.contract import PipelineFacts
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


def probe_copy(req: Req) -> Req:
    """Another request (a new id) with `req`'s inputs, shared (a step only reads them), and its own copy of
    what a step advances: the fields with a `stepped` role, on `Req` and on its conditioning. Copies that
    shared those would step one another's state: SkyReels-V2 diffusion forcing keeps its frame groups'
    scheduler states in its conditioning, and a copy's first step would restart the states the first
    probe's next step continues. The random generators are shared: the numbers they draw do not matter."""
    own: dict[str, object] = {name: deepcopy(getattr(req, name)) for name in stepped_fields(req)}
    conditioning = req.conditioning
    if conditioning is not None:
        stepped = {name: deepcopy(getattr(conditioning, name)) for name in stepped_fields(conditioning)}
        own["conditioning"] = replace(conditioning, **stepped)
    return replace(req, request_id=new_request_id(), **own)  # type: ignore[arg-type]


def curve_probe_params(facts: PipelineFacts, params: SamplingParams, most: int, seed: int) -> SamplingParams:
    """The measurement's request `seed` of probe `params`: enough steps for the first probe to run in every
    batch of `batch_sizes_to_probe(most)`, and never fewer than the family's `probe_steps`."""
    steps = STEPS_PER_BATCH * len(batch_sizes_to_probe(most)) + 1  # the first probe runs in every batch
    return facts.with_probe_settings(replace(params, seed=seed, num_inference_steps=steps))


def measure_step_curve(engine: Engine, params: SamplingParams, most: int) -> list[int]:
    """Step up to `most` copies of `params` (seeds 0, 1, ...) in batches of `batch_sizes_to_probe`, as many
    as the scheduler's limits and memory model admit together; returns the batch sizes measured (none when
    the probe request has fewer denoising steps than the first probe would run: logged)."""
    sizes = batch_sizes_to_probe(most)
    facts = engine.pipeline.facts
    reqs: list[Req] = []
    costs: list[RequestCost] = []
    try:
        for seed in range(sizes[-1]):
            copy = bool(reqs) and not engine.runner.mirrors_requests
            if copy:
                req, cost = probe_copy(reqs[0]), costs[0]
            else:
                req = engine.runner.validate(Req(params=curve_probe_params(facts, params, most, seed)))
                cost = engine.cost(req)
            if costs and not engine.scheduler.within_limits(costs, cost):
                break
            reqs.append(req if copy else engine.runner.pre_denoise(req))
            costs.append(cost)
        measured = [k for k in sizes if k <= len(reqs)]
        needed = STEPS_PER_BATCH * len(measured)  # the first probe's
        if reqs[0].num_steps < needed:
            logger.info(
                "Batch policy: step times are not measured at warm-up: the probe request of %s has %d "
                "denoising steps (for %d requested), the measurement needs %d; measuring while serving",
                facts.name, reqs[0].num_steps, reqs[0].params.num_inference_steps, needed,
            )  # fmt: skip
            return []
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
