"""Prefix-affinity routing: the pure policy, and a real 2-replica Serve deployment on local Ray."""
from __future__ import annotations

import hashlib
import random
from types import SimpleNamespace

import pytest

from k3.serve.router import DEFAULT_MAX_IMBALANCE, prefix_route_key, rank_replicas, rendezvous_order, route_key_of

REPLICAS = ["r0", "r1", "r2", "r3"]
KEYS = [f"{i:032x}" for i in range(300)]


def preferred(key, replicas=REPLICAS, queue_lens=None, max_imbalance=4):
    return rank_replicas(key, replicas, queue_lens or {}, max_imbalance)[0]


# ---- the policy ---------------------------------------------------------------------------------

def test_same_key_same_replica_and_keys_spread():
    firsts = [preferred(k) for k in KEYS]
    assert firsts == [preferred(k) for k in KEYS]
    assert all(len(f) == 1 for f in firsts)
    counts = {r: sum(f == [r] for f in firsts) for r in REPLICAS}
    assert all(40 <= c <= 110 for c in counts.values()), counts  # ~75 each


def test_order_of_candidates_does_not_matter():
    for k in KEYS[:50]:
        assert preferred(k) == preferred(k, list(reversed(REPLICAS)))


@pytest.mark.parametrize("change", ["remove", "add"])
def test_rendezvous_moves_only_the_keys_it_must(change):
    after_set = REPLICAS[:-1] if change == "remove" else REPLICAS + ["r4"]
    before = {k: rendezvous_order(k, REPLICAS)[0] for k in KEYS}
    after = {k: rendezvous_order(k, after_set)[0] for k in KEYS}
    moved = [k for k in KEYS if before[k] != after[k]]
    if change == "remove":  # only the removed replica's keys move
        assert all(before[k] == "r3" for k in moved) and len(moved) == sum(v == "r3" for v in before.values())
    else:  # only keys the new replica takes move, about 1/5 of them
        assert all(after[k] == "r4" for k in moved) and 30 <= len(moved) <= 95


def test_full_ranking_is_every_replica_once():
    ranks = rank_replicas(KEYS[0], REPLICAS, {})
    assert sorted(r for rank in ranks for r in rank) == REPLICAS
    assert ranks[0] == [rendezvous_order(KEYS[0], REPLICAS)[0]]


@pytest.mark.parametrize("extra,moves", [(0, False), (4, False), (5, True)])
def test_busy_preferred_replica_gives_way_past_the_margin(extra, moves):
    key = KEYS[7]
    pref = rendezvous_order(key, REPLICAS)[0]
    others = [r for r in REPLICAS if r != pref]
    queue_lens = {pref: 2 + extra, others[0]: 3, others[1]: 2, others[2]: 9}
    first = preferred(key, queue_lens=queue_lens, max_imbalance=4)
    assert first == ([others[1]] if moves else [pref])


def test_unknown_queue_lengths_keep_the_preferred_replica():
    key = KEYS[3]
    pref = rendezvous_order(key, REPLICAS)[0]
    assert preferred(key, queue_lens={r: (None if r == pref else 0) for r in REPLICAS}, max_imbalance=0) == [pref]


@pytest.mark.parametrize("replicas,size", [(REPLICAS, 2), (["only"], 1), ([], 0)])
def test_no_key_is_power_of_two_choices(replicas, size):
    rng = random.Random(0)
    seen = set()
    for _ in range(50):
        ranks = rank_replicas(None, replicas, {}, rng=rng)
        if not replicas:
            assert ranks == []
            continue
        assert len(ranks) == 1 and len(ranks[0]) == size == len(set(ranks[0]))
        seen.update(ranks[0])
    assert seen == set(replicas)


def test_negative_margin_is_refused():
    with pytest.raises(ValueError, match="max_imbalance"):
        rank_replicas("k", REPLICAS, {}, max_imbalance=-1)


@pytest.mark.parametrize("request_,key", [
    (SimpleNamespace(args=[SimpleNamespace(route_key="ab")]), "ab"),
    (SimpleNamespace(args=[SimpleNamespace(route_key=None)]), None),
    (SimpleNamespace(args=[SimpleNamespace(route_key="")]), None),
    (SimpleNamespace(args=["a plain string"]), None),
    (SimpleNamespace(args=[]), None),
    (None, None),
])
def test_route_key_of(request_, key):
    assert route_key_of(request_) == key


def chain(tokens, page_size=4):
    """Chain hashes of full pages, as the engine's prefix cache makes them."""
    out, parent = [], b""
    for i in range(len(tokens) // page_size):
        parent = hashlib.blake2b(parent + bytes(tokens[i * page_size:(i + 1) * page_size]), digest_size=16).digest()
        out.append(parent)
    return out


def test_prefix_route_key_covers_the_first_pages_only():
    a = list(range(100))
    same_head = a[:16] + [7] * 40
    other_head = [1] + a[1:]
    assert prefix_route_key(chain(a), num_pages=4) == chain(a)[3].hex()
    assert prefix_route_key(chain(a)) == prefix_route_key(chain(same_head))
    assert prefix_route_key(chain(a)) != prefix_route_key(chain(other_head))
    assert prefix_route_key(chain(a[:6])) == chain(a)[0].hex()  # one full page
    assert prefix_route_key(chain(a[:3])) is None
    with pytest.raises(ValueError):
        prefix_route_key(chain(a), num_pages=0)


def test_the_route_key_of_a_prompts_first_pages_is_the_whole_prompts():
    """The decode replica hashes only the first DEFAULT_ROUTE_PAGES pages for the key."""
    from k3.serve.engine.cache_manager import page_hashes
    from k3.serve.router import DEFAULT_ROUTE_PAGES

    prompt = list(range(3, 1000))
    for ps in (8, 16):
        head = prompt[:DEFAULT_ROUTE_PAGES * ps]
        assert prefix_route_key(page_hashes(head, ps)) == prefix_route_key(page_hashes(prompt, ps))


# ---- on Ray Serve -------------------------------------------------------------------------------

@pytest.mark.ray
def test_same_key_requests_land_on_the_same_replica(serve_session):
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    # max_ongoing_requests above the 40 requests in flight: a full replica would (rightly) pass
    # requests on to the next rank
    @serve.deployment(num_replicas=2, max_ongoing_requests=100, ray_actor_options={"num_cpus": 0},
                      request_router_config=RequestRouterConfig(
                          request_router_class="k3.serve.router.PrefixAffinityRouter",
                          request_router_kwargs={"max_imbalance": 1000}))
    class WhoAmI:
        async def __call__(self, req) -> str:
            return serve.get_replica_context().replica_id.unique_id

    try:
        handle = serve.run(WhoAmI.bind(), name="router_test", route_prefix=None)
        # the handle learns of the replicas asynchronously: wait until unkeyed requests reach both
        unkeyed: set[str] = set()
        for _ in range(60):
            unkeyed.add(handle.remote(SimpleNamespace(route_key=None)).result(timeout_s=60))
            if len(unkeyed) == 2:
                break
        assert len(unkeyed) == 2  # power of two choices reaches both replicas
        keys = KEYS[:8]
        responses = [(k, handle.remote(SimpleNamespace(route_key=k))) for k in keys for _ in range(5)]
        landed: dict[str, set[str]] = {}
        for k, resp in responses:
            landed.setdefault(k, set()).add(resp.result(timeout_s=60))
        assert all(len(v) == 1 for v in landed.values()), landed
        # each key went to the replica the rendezvous order names
        for k, v in landed.items():
            assert v == {rendezvous_order(k, sorted(unkeyed))[0]}
    finally:
        serve.delete("router_test")


@pytest.mark.ray
@pytest.mark.parametrize("keyed", [True, False])
def test_calls_made_inside_one_request_are_all_routed(serve_session, keyed):
    """Every handle call a replica makes while it serves one request carries that request's
    internal id (Serve's request context), as the n choices of one completion reach the prefill
    deployment. Each must be routed promptly, none left spinning in the router."""
    import asyncio
    import time

    from ray import serve
    from ray.serve.config import RequestRouterConfig

    @serve.deployment(num_replicas=2, max_ongoing_requests=100, ray_actor_options={"num_cpus": 0},
                      request_router_config=RequestRouterConfig(
                          request_router_class="k3.serve.router.PrefixAffinityRouter"))
    class Back:
        async def __call__(self, req) -> str:
            await asyncio.sleep(0.05)
            return serve.get_replica_context().replica_id.unique_id

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Fan:
        def __init__(self, back) -> None:
            self.back = back

        async def __call__(self, n: int, key: str | None) -> list[str]:
            return await asyncio.gather(*[self.back.remote(SimpleNamespace(route_key=key)) for _ in range(n)])

    try:
        handle = serve.run(Fan.bind(Back.bind()), name="fan_test", route_prefix=None)
        for n in (1, 8, 8):
            t0 = time.perf_counter()
            landed = handle.remote(n, KEYS[3] if keyed else None).result(timeout_s=30)
            assert len(landed) == n and time.perf_counter() - t0 < 10, (n, time.perf_counter() - t0)
            if keyed:  # one prompt, one replica, until it is more than max_imbalance requests ahead
                most = max(landed.count(r) for r in set(landed))
                assert most >= min(n, DEFAULT_MAX_IMBALANCE + 1), landed
    finally:
        serve.delete("fan_test")
