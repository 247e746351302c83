"""The request router of the `EngineReplica` deployments (Ray Serve's request-router API): a job goes to
the replica with the fewest denoising steps waiting, not round robin.

A diffusion request's cost is its steps, and replicas run step batches: two queued 50-step requests are
more work than five 4-step ones. Each replica reports its load with `record_routing_stats` (every
`STATS_PERIOD_S`: its engine's state and `waiting_steps`, the steps its requests in flight have still to
run); between two reports this router adds the steps of the jobs it sent and that have not finished
(what a report does not show yet), and ranks ready replicas by the larger of the two. Ray Serve then
picks, within the best rank, the replica with the shortest queue that accepts the request.

A call carrying `replica_id=...` (LoRA admin ops, cancels, /server_info's per-replica view) goes to that
replica only. Replicas whose engine is not ready (restarting) take no new jobs.

The ingress reaches the router of its handle through `router_registry.router_for(deployment)`, for the
replica list (/server_info, /metrics, LoRA fan-out). Ray Serve ships this module to the handle's process
by value (a copy): it keeps no state of its own, only what router_registry.py, imported as usual, holds.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from diffserve.deploy import router_registry
from diffserve.deploy.router_registry import ReplicaView
from diffserve.server.protocol import GenerateJob

#: How often Ray Serve asks each replica for its `record_routing_stats` (seconds).
STATS_PERIOD_S = 0.5
#: The method whose calls are jobs (counted as outstanding steps until they complete).
JOB_METHOD = "submit"


def job_steps(request: PendingRequest) -> int:
    """The denoising steps a job call asks for (0 when the request leaves it to the model's default,
    which the replica's next report accounts for)."""
    job = request.args[0] if request.args else request.kwargs.get("job")
    if not isinstance(job, GenerateJob):
        return 0
    return int(job.params.num_inference_steps or 0)


class WaitingStepsRouter(RequestRouter):
    """Fewest waiting steps first; `replica_id` targets one replica (module docstring)."""

    def initialize_state(self, **kwargs: Any) -> None:
        #: Jobs this router sent and that have not completed: internal request id -> (replica, steps).
        self._outstanding: dict[str, tuple[ReplicaID, int]] = {}
        self._turn = 0
        router_registry.register(self._deployment_id.name, self)

    def replicas(self) -> list[ReplicaView]:
        """The running replicas and their last reports (a snapshot, safe from any thread)."""
        return [
            ReplicaView(r.replica_id.unique_id, r.node_id or "", dict(r.routing_stats or {}))
            for r in list(self._replicas.values())
        ]

    def _outstanding_steps(self, replica_id: ReplicaID) -> int:
        return sum(steps for rid, steps in list(self._outstanding.values()) if rid == replica_id)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            # One ranking per attempt: Ray Serve backs off before the next instead of spinning.
            pending_request.routing_context.should_backoff = True
            target = pending_request.kwargs.get("replica_id")
            if target is not None:
                return [[r for r in candidate_replicas if r.replica_id.unique_id == target]]
        ready = [r for r in candidate_replicas if (r.routing_stats or {}).get("state", "ready") == "ready"]

        def score(replica: RunningReplica) -> int:
            reported = int((replica.routing_stats or {}).get("waiting_steps", 0))
            return max(reported, self._outstanding_steps(replica.replica_id))

        # Ties taken in turn (Ray Serve takes the first of a rank among equally short queues).
        self._turn = (self._turn + 1) % max(len(ready), 1)
        ranks: dict[int, list[RunningReplica]] = {}
        for replica in ready[self._turn :] + ready[: self._turn]:
            ranks.setdefault(score(replica), []).append(replica)
        return [ranks[key] for key in sorted(ranks)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        if pending_request.metadata.call_method == JOB_METHOD:
            steps = job_steps(pending_request)
            self._outstanding[pending_request.metadata.internal_request_id] = (replica_id, steps)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._outstanding.pop(internal_request_id, None)
