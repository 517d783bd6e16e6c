"""Prefix-affinity routing for the prefill deployment: a request goes to the replica most likely to
hold its prompt's prefix in cache, unless that replica is much busier than the others.

The contract with callers: the first positional argument of the call has an attribute
`route_key: str | None`, the hex chain hash of the prompt's first pages (`prefix_route_key` of
the prompt's page hashes, which the engine computes for its prefix cache).

- Same key, same replica: rendezvous (highest-random-weight) hashing of the key against each
  replica id. When a replica joins or leaves, only the keys whose top replica changed move
  (about 1/n of them), not all of them as with `hash(key) % n`.
- Balanced against load: if the preferred replica's queue is longer than the shortest queue by
  more than `max_imbalance`, the request goes to the least loaded replica instead.
- No key (a prompt shorter than one page): power of two choices, as Serve's default router.

`rank_replicas` is the whole policy as a pure function; `PrefixAffinityRouter` feeds it Serve's
replicas and queue lengths:

    @serve.deployment(request_router_config=RequestRouterConfig(
        request_router_class="k3.serve.router.PrefixAffinityRouter",
        request_router_kwargs={"max_imbalance": 4}))
    class PrefillServer: ...
"""
from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping, Sequence

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

DEFAULT_MAX_IMBALANCE = 4
DEFAULT_ROUTE_PAGES = 4


def prefix_route_key(page_hashes: Sequence[bytes], num_pages: int = DEFAULT_ROUTE_PAGES) -> str | None:
    """The routing key of a prompt from the chain hashes of its full pages (each hash covers every
    page before it): the hex of the hash of page `num_pages` (of the last full page when the prompt
    is shorter; None without a full page). Prompts sharing those first pages share the key."""
    if num_pages < 1:
        raise ValueError(f"num_pages must be >= 1, got {num_pages}")
    if not page_hashes:
        return None
    return bytes(page_hashes[min(num_pages, len(page_hashes)) - 1]).hex()


def rendezvous_order(key: str, replica_ids: Sequence[str]) -> list[str]:
    """`replica_ids` from the key's most to least preferred (highest-random-weight hashing)."""
    def weight(rid: str) -> bytes:
        return hashlib.blake2b(f"{key}\0{rid}".encode(), digest_size=8).digest()

    return sorted(replica_ids, key=weight, reverse=True)


def rank_replicas(route_key: str | None, replica_ids: Sequence[str], queue_lens: Mapping[str, int | None],
                  max_imbalance: int = DEFAULT_MAX_IMBALANCE, rng: random.Random | None = None) -> list[list[str]]:
    """The routing policy: ranks of replica ids, most preferred first (Serve tries rank by rank and
    takes the shortest queue inside a rank).

    Args:
        route_key: the request's prefix key, or None.
        replica_ids: the candidate replicas.
        queue_lens: each replica's queue length; a missing or None entry counts as unknown, and an
            unknown preferred replica is trusted (its queue is probed when it is tried).
        max_imbalance: how many more queued requests than the least loaded replica the preferred
            replica may have before the request goes elsewhere.
        rng: randomness for power of two choices (seed it in tests).
    """
    if max_imbalance < 0:
        raise ValueError(f"max_imbalance must be >= 0, got {max_imbalance}")
    ids = list(dict.fromkeys(replica_ids))
    if not ids:
        return []
    if route_key is None:
        rng = rng or random
        return [rng.sample(ids, min(2, len(ids)))]
    order = rendezvous_order(route_key, ids)
    preferred = order[0]
    known = {r: q for r in ids if (q := queue_lens.get(r)) is not None}
    if known and preferred in known:
        shortest = min(known.values())
        if known[preferred] - shortest > max_imbalance:
            least = min(known, key=lambda r: (known[r], order.index(r)))
            return [[least]] + [[r] for r in order if r != least]
    return [[r] for r in order]


def route_key_of(pending_request: PendingRequest | None) -> str | None:
    """The `route_key` attribute of the request's first positional argument, if it has one."""
    if pending_request is None or not pending_request.args:
        return None
    key = getattr(pending_request.args[0], "route_key", None)
    return key if isinstance(key, str) and key else None


class PrefixAffinityRouter(RequestRouter):
    """Ray Serve request router for prefill replicas (see the module doc).

    Serve builds one per deployment handle, in the caller's process; `request_router_kwargs`
    reach `initialize_state`. Requests are matched to their own routing decision (no FIFO mixin:
    FIFO hands a replica chosen for one request's prefix to whichever request is oldest), by
    `_fulfill_next_pending_request`, the hook Serve's own mixins override for that.
    """

    def initialize_state(self, max_imbalance: int = DEFAULT_MAX_IMBALANCE, seed: int | None = None) -> None:
        if max_imbalance < 0:
            raise ValueError(f"max_imbalance must be >= 0, got {max_imbalance}")
        self.max_imbalance = max_imbalance
        self.rng = random.Random(seed)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not hasattr(self, "max_imbalance"):  # built without request_router_kwargs
            self.initialize_state()
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        key = route_key_of(pending_request)
        queue_lens: dict[str, int | None] = {}
        if key is not None:
            queue_lens = await self._queue_lens(candidate_replicas)
        ranks = rank_replicas(key, list(by_id), queue_lens, self.max_imbalance, self.rng)
        return [[by_id[i] for i in rank] for rank in ranks]

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata=None) -> None:
        """Hand `replica` to the oldest pending request with the routed request's internal id.

        Serve's default matches by that id through an index that keeps one request per id. But
        every handle call a replica makes while serving one request inherits that request's id
        (Serve's request context): the n choices of one completion reach the prefill deployment
        under one id. The index held only the first; once it was served the others matched
        nothing, and their routing tasks looped without ever awaiting (queue lengths cached),
        starving the caller's router loop, its queue-length probes and every prefill reply
        (n >= 3 choices timed out). Here the requests sharing an id are the choices of one
        completion (one prompt, one route key): the replica chosen for one is right for each."""
        if request_metadata is None:
            return
        for pr in self._pending_requests_to_fulfill:
            if not pr.future.done() and pr.metadata.internal_request_id == request_metadata.internal_request_id:
                self._cancel_routing_task_for_pending_request(pr)
                self._record_queue_wait_time(pr)
                pr.future.set_result(replica)
                self._remove_pending_request_from_indices(pr)
                return

    async def _queue_lens(self, replicas: list[RunningReplica]) -> dict[str, int | None]:
        """Queue lengths from Serve's cache where fresh, probing the rest (as Serve's own routers do)."""
        out: dict[str, int | None] = {}
        missing = []
        for r in replicas:
            q = self.replica_queue_len_cache.get(r.replica_id)
            if q is None:
                missing.append(r)
            out[r.replica_id.unique_id] = q
        if missing:
            for r, q in await self._probe_queue_lens(missing, 0):
                out[r.replica_id.unique_id] = q
        return out
