"""`PodSpecFetcher` on its own: what one preference call fetches, who waits how long, what is kept and for how long,
and how each fetch is counted (`gpu_node_agent_pod_spec_fetches_total{outcome}`).

The API side is the in-memory cluster (`agent.kube.simulated`) behind `HeldLookups`, a `PodLookupApi` that records
every request and can hold its answers until the test releases them (the API server being slow). The process
tests (test_fetched_specs.py) cover the same paths through the real HTTP port and the real kubelet sockets; here
each rule is checked alone, and without timing assertions: a "slow" API server is one held on an event.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from prometheus_client import CollectorRegistry

from agent.host.podresources.simulated import DeviceRecords, InMemoryPodResources
from agent.kube.errors import ApiServerError
from agent.kube.model import PodView
from agent.kube.simulated import InMemoryCluster
from agent.ownership import spec_fetch
from agent.ownership.service import OwnershipService
from agent.ownership.spec_fetch import PodKey, PodSpecFetcher
from tests.fakes.apiserver import container_spec
from tests.ownership.rig import until

GPU, NIC = "nvidia.com/gpu", "gpunodeagent.io/sriov_rdma"
FETCHES = "gpu_node_agent_pod_spec_fetches_total"
LONG = 30.0  # a deadline no test reaches: waits end on events, never on time


def pod_view(name: str) -> PodView:
    return PodView.from_dict({"metadata": {"namespace": "ml", "name": name, "uid": f"uid-{name}"},
                              "spec": {"nodeName": "node-a", "containers": [container_spec("main", {GPU: 1, NIC: 1})]}})


class HeldLookups:
    """`PodLookupApi` over an in-memory cluster: records every request; while `hold` is set each answer waits
    for `release`; names in `failing` get a 503."""

    def __init__(self, cluster: InMemoryCluster) -> None:
        self.cluster = cluster
        self.requests: list[PodKey] = []
        self.hold = False
        self.released = asyncio.Event()
        self.failing: set[PodKey] = set()

    async def find_node_pod(self, namespace: str, name: str) -> PodView | None:
        self.requests.append((namespace, name))
        if self.hold:
            await self.released.wait()
        if (namespace, name) in self.failing:
            raise ApiServerError(503, "etcdserver: request timed out")
        return await self.cluster.find_node_pod(namespace, name)


class Rig:
    def __init__(self, pods: int, late_s: float = LONG) -> None:
        self.names = [f"p{i}" for i in range(pods)]
        self.cluster = InMemoryCluster("node-a", pods=[pod_view(n) for n in self.names])
        self.api = HeldLookups(self.cluster)
        self.registry = CollectorRegistry()
        self.fetcher = PodSpecFetcher(self.api, self.registry, late_s=late_s)

    def key(self, i: int) -> PodKey:
        return "ml", self.names[i]

    def outcomes(self) -> dict[str, float]:
        return {o: self.registry.get_sample_value(FETCHES, {"outcome": o}) or 0.0 for o in spec_fetch.OUTCOMES}


def counted(**outcomes: float) -> dict[str, float]:
    return {o: float(outcomes.get(o, 0)) for o in spec_fetch.OUTCOMES}


@pytest.fixture
async def rig() -> Rig:
    return Rig(pods=8)


async def test_at_most_four_pods_are_fetched_per_call_and_the_rest_wait_for_a_later_call(rig: Rig) -> None:
    keys = [rig.key(i) for i in range(6)]
    got = await rig.fetcher.fetch([keys[0], *keys], LONG)  # a repeated key is one fetch
    assert spec_fetch.MAX_PODS == 4
    assert rig.api.requests == keys[:4] and set(got) == set(keys[:4])
    assert rig.outcomes() == counted(found=4)
    # the 5th and 6th were neither requested nor remembered: they are simply not known to this call (the lookup
    # then decides without them); a later call asking again fetches them, skipping what is kept already
    assert rig.fetcher.spec(keys[4]) is None and rig.fetcher.spec(keys[5]) is None
    got = await rig.fetcher.fetch(keys, LONG)
    assert rig.api.requests == keys and set(got) == set(keys)  # the kept ones are returned too
    assert rig.outcomes() == counted(found=6)
    assert rig.fetcher.spec(keys[5]) == rig.cluster.pods[keys[5]]


async def test_a_second_call_joins_the_fetch_in_flight(rig: Rig) -> None:
    rig.api.hold = True
    first = asyncio.create_task(rig.fetcher.fetch([rig.key(0), rig.key(1)], LONG))
    await until(lambda: len(rig.api.requests) == 2)
    second = asyncio.create_task(rig.fetcher.fetch([rig.key(1), rig.key(2)], LONG))
    await until(lambda: len(rig.api.requests) == 3)
    rig.api.released.set()
    got_first, got_second = await asyncio.gather(first, second)
    assert rig.api.requests == [rig.key(0), rig.key(1), rig.key(2)]  # pod 1 once, for both calls
    assert set(got_first) == {rig.key(0), rig.key(1)} and set(got_second) == {rig.key(1), rig.key(2)}
    assert got_first[rig.key(1)] is got_second[rig.key(1)]
    assert rig.outcomes() == counted(found=3)  # each fetch counted once, however many calls waited on it


async def test_the_call_returns_at_its_deadline_and_the_late_answer_is_kept_for_the_next_call(rig: Rig) -> None:
    rig.api.hold = True
    got = await rig.fetcher.fetch([rig.key(0)], 0.01)  # the API server holds the answer past the deadline
    assert got == {} and rig.api.requests == [rig.key(0)] and not rig.api.released.is_set()
    assert rig.outcomes() == counted()  # nothing has ended yet
    # the next call while it is still out joins it (no second request) and gets the late answer
    joined = asyncio.create_task(rig.fetcher.fetch([rig.key(0)], LONG))
    rig.api.released.set()
    assert set(await joined) == {rig.key(0)}
    assert rig.outcomes() == counted(late=1)  # its first caller had stopped waiting
    assert await rig.fetcher.fetch([rig.key(0)], 0.0) == {rig.key(0): rig.cluster.pods[rig.key(0)]}
    assert rig.api.requests == [rig.key(0)]  # kept: no request for it again


async def test_a_late_answer_nobody_waits_for_is_kept_too(rig: Rig) -> None:
    rig.api.hold = True
    assert await rig.fetcher.fetch([rig.key(0), rig.key(1)], 0.0) == {}
    rig.api.released.set()
    await until(lambda: rig.outcomes() == counted(late=2))
    assert rig.fetcher.spec(rig.key(1)) == rig.cluster.pods[rig.key(1)]


async def test_a_caller_cancelled_while_waiting_leaves_its_fetches_late(rig: Rig) -> None:
    # The kubelet cancels a preference call it stopped waiting for: the answer that comes later did not serve that
    # call in time, whatever the call's own deadline said.
    rig.api.hold = True
    caller = asyncio.create_task(rig.fetcher.fetch([rig.key(0)], LONG))
    await until(lambda: rig.api.requests == [rig.key(0)])
    caller.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await caller
    rig.api.released.set()
    await until(lambda: rig.outcomes() != counted())
    assert rig.outcomes() == counted(late=1)
    assert rig.fetcher.spec(rig.key(0)) is not None


async def test_the_fetch_bound_ends_a_stuck_fetch_as_an_error_and_the_next_call_asks_again() -> None:
    assert PodSpecFetcher(HeldLookups(InMemoryCluster("node-a")), None).late_s == spec_fetch.LATE_S == 2.0
    rig = Rig(pods=2, late_s=0.05)  # the same bound, shortened: the API server never answers while held
    rig.api.hold = True
    assert await rig.fetcher.fetch([rig.key(0)], 0.0) == {}
    await until(lambda: rig.outcomes() != counted())
    assert rig.outcomes() == counted(error=1) and rig.fetcher.spec(rig.key(0)) is None
    rig.api.hold = False
    got = await rig.fetcher.fetch([rig.key(0)], LONG)
    assert set(got) == {rig.key(0)} and rig.api.requests == [rig.key(0), rig.key(0)]
    assert rig.outcomes() == counted(error=1, found=1)


async def test_not_found_and_error_are_counted_and_nothing_is_kept(rig: Rig) -> None:
    gone = ("ml", "gone")  # deleted before the fetch (or never on this node: the field selector finds nothing)
    rig.api.failing.add(rig.key(1))
    got = await rig.fetcher.fetch([gone, rig.key(1), rig.key(2)], LONG)
    assert set(got) == {rig.key(2)}
    assert rig.outcomes() == counted(found=1, not_found=1, error=1)
    assert rig.fetcher.spec(gone) is None and rig.fetcher.spec(rig.key(1)) is None
    rig.api.failing.clear()
    assert set(await rig.fetcher.fetch([gone, rig.key(1)], LONG)) == {rig.key(1)}  # both asked again
    assert rig.api.requests.count(gone) == 2 and rig.api.requests.count(rig.key(1)) == 2
    assert rig.outcomes() == counted(found=2, not_found=2, error=1)


async def test_at_most_64_specs_are_kept_and_the_oldest_goes_first() -> None:
    rig = Rig(pods=spec_fetch.CAPACITY + 1)
    for start in range(0, spec_fetch.CAPACITY, spec_fetch.MAX_PODS):
        await rig.fetcher.fetch([rig.key(i) for i in range(start, start + spec_fetch.MAX_PODS)], LONG)
    assert len(rig.fetcher.fetched) == spec_fetch.CAPACITY
    newest = rig.key(spec_fetch.CAPACITY)
    await rig.fetcher.fetch([newest], LONG)
    assert len(rig.fetcher.fetched) == spec_fetch.CAPACITY
    assert rig.fetcher.spec(rig.key(0)) is None  # the first fetched: its pod was admitted long since
    assert rig.fetcher.spec(rig.key(1)) is not None and rig.fetcher.spec(newest) is not None
    await rig.fetcher.fetch([rig.key(0)], LONG)  # asked for again: a new request
    assert rig.api.requests.count(rig.key(0)) == 2 and rig.fetcher.spec(rig.key(1)) is None


async def test_aclose_cancels_fetches_in_flight(rig: Rig) -> None:
    rig.api.hold = True
    assert await rig.fetcher.fetch([rig.key(0)], 0.0) == {}
    await rig.fetcher.aclose()
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("pod-spec-fetch")]  # awaited, gone
    rig.api.released.set()
    assert rig.fetcher.spec(rig.key(0)) is None and rig.outcomes() == counted()


# -- what the ownership service keeps: a spec goes when the watch has the pod or the kubelet lists it no more ----


def listed_pod(records: DeviceRecords, name: str) -> None:
    records.add_pod("ml", name, ["main"])
    records.record("ml", name, "main", GPU, [f"GPU-{name}"])


@pytest.mark.parametrize("watching", [True, False])
async def test_a_lookup_drops_the_specs_the_watch_delivered_or_the_kubelet_no_longer_lists(
        rig: Rig, watching: bool) -> None:
    records = DeviceRecords()
    for i in range(3):
        listed_pod(records, rig.names[i])
    watched: dict[PodKey, PodView] = {}
    service = OwnershipService(InMemoryPodResources(records), pod_specs=(lambda: watched) if watching else None,
                               registry=CollectorRegistry(), spec_fetcher=rig.fetcher, lookup_timeout=LONG)
    await rig.fetcher.fetch([rig.key(0), rig.key(1), rig.key(2)], LONG)
    await service.lookup(NIC, [GPU])  # a first lookup: everything still listed, the watch has nothing
    assert set(rig.fetcher.fetched) == {rig.key(0), rig.key(1), rig.key(2)}

    records.remove_pod(*rig.key(2))  # the kubelet stops listing pod 2 (it ended)
    if watching:
        watched[rig.key(1)] = rig.cluster.pods[rig.key(1)]  # the watch caught up on pod 1
    await service.lookup(NIC, [GPU])
    # without a watch only the kubelet's listing matters
    assert set(rig.fetcher.fetched) == ({rig.key(0)} if watching else {rig.key(0), rig.key(1)})
    assert service.pod(*rig.key(0)) == rig.cluster.pods[rig.key(0)]  # still served from the fetched copy
    assert service.pod(*rig.key(2)) is None
    if watching:
        assert service.pod(*rig.key(1)) is watched[rig.key(1)]
