"""PrefixAffinityRouter: Ray Serve's request router for the engine replicas (RequestRouter, Ray's
extension point for choosing a replica), with affinity.py's policy.

Ray's RequestRouter does the rest: it keeps the live replicas (the controller tells it when one
starts, dies or is replaced), their queue depths (requests in flight, counted as requests are
sent and finish, probed when unknown), tries each rank this router returns in order, takes the
least busy replica of a rank that accepts, and backs off and retries while none does. Without
Ray's FIFOMixin on purpose: a replica chosen for one request's prefix must go to that request,
not to the oldest one waiting.

The request's key (affinity.prefix_key) travels in its Job, computed once where the prompt is
made (remote.py); the router only reads it.

Ray's PrefixCacheAffinityRouter (ray.serve.llm) does the same for Ray's LLM servers, from the
prompt's characters in a prefix-tree actor that each decision waits on; this one keys on the
very block hashes the replicas' prefix caches use, and decides in the router's own loop.
"""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from flashformer.serve.cluster.affinity import PrefixIndex, choose


class PrefixAffinityRouter(RequestRouter):
    """Routes a Job to the least busy of the replicas holding its longest known prefix
    (affinity.choose), the less busy of two drawn at random otherwise. request_router_kwargs: imbalance (requests more in flight than the
    least busy replica before affinity gives way), capacity (block hashes remembered)."""

    def initialize_state(self, imbalance: int = 8, capacity: int = 1 << 17, **_) -> None:
        if imbalance < 0:
            raise ValueError(f"imbalance must be at least 0; got {imbalance}")
        self.index = PrefixIndex(capacity)
        self.imbalance = imbalance
        self.decisions = {"affinity": 0, "balance": 0}

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        by_id = {replica.replica_id: replica for replica in candidate_replicas}
        cache = self.replica_queue_len_cache
        queues = {replica_id: cache.get(replica_id) for replica_id in by_id}
        ranks, why = choose(self.index, _key_of(pending_request), queues, self.imbalance)
        self.decisions[why] += 1
        return [[by_id[replica_id] for replica_id in rank] for rank in ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self.index.record(_key_of(pending_request), replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.forget(replica_id)


def _key_of(pending_request: PendingRequest | None) -> tuple[bytes, ...]:
    """The Job's prefix key; () for a call without a Job (stats, describe: any replica will do)."""
    if pending_request is None:
        return ()
    for arg in pending_request.args:
        key = getattr(arg, "prefix", None)
        if key is not None:
            return key
    return ()
