"""The PodResources port over a real unix socket: the gRPC client against the stand-in kubelet's server.

What a consumer relies on: devices grouped per resource and de-duplicated (the kubelet sends one entry per
device per NUMA node), every failure one `PodResourcesError` with a reason (no socket, time-out, rate limit,
garbage), `gpu_node_agent_pod_resources_up` following the API's state, and a client that outlives a kubelet
restart that recreates the socket.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from agent.host.podresources import PodResourcesError, Reachability
from agent.host.podresources.client import KubeletPodResources
from agent.host.podresources.ratelimit import TokenBucket
from agent.host.podresources.simulated import DeviceRecords, InMemoryPodResources
from agent.simulate.podresources import PodResourcesServer

GPU, NIC = "nvidia.com/gpu", "gpunodeagent.io/sriov_rdma"


@pytest.fixture
def short_dir() -> Iterator[Path]:
    directory = tempfile.mkdtemp(prefix="gnapr")  # AF_UNIX paths must stay under 108 bytes
    try:
        yield Path(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def records() -> DeviceRecords:
    healthy = {GPU: frozenset({"GPU-a", "GPU-b"}), NIC: frozenset({"0000:1a:00.2", "0000:1a:00.3"})}
    records = DeviceRecords(lambda: healthy)
    records.add_pod("team-a", "trainer-0", ["main", "sidecar"])
    records.record("team-a", "trainer-0", "main", GPU, ["GPU-a"])
    records.record("team-a", "trainer-0", "main", NIC, ["0000:1a:00.2"])
    return records


@pytest.fixture
async def server(short_dir: Path, records: DeviceRecords) -> AsyncIterator[PodResourcesServer]:
    server = PodResourcesServer(records, short_dir / "pod-resources" / "kubelet.sock",
                                numa_of=lambda i: 0 if i.startswith("0000:1a") else None)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


def up(registry: CollectorRegistry) -> float | None:
    return registry.get_sample_value("gpu_node_agent_pod_resources_up")


async def until_answers(client: KubeletPodResources, timeout: float = 30.0) -> None:
    """Call `list` until the (restarted) server answers; after `timeout` s fail with the last error."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            await client.list(timeout=5)
            return
        except PodResourcesError as exc:
            if loop.time() > deadline:
                raise AssertionError(f"the restarted PodResources server never answered: {exc!r}") from exc
        await asyncio.sleep(0.05)


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
async def client(server: PodResourcesServer, registry: CollectorRegistry) -> AsyncIterator[KubeletPodResources]:
    client = KubeletPodResources(server.socket_path, reachability=Reachability(registry, server.socket_path))
    try:
        yield client
    finally:
        await client.aclose()


async def test_list_groups_devices_per_container_and_resource(client: KubeletPodResources,
                                                              records: DeviceRecords,
                                                              registry: CollectorRegistry) -> None:
    assert up(registry) == 0  # unknown until the first answer
    # a device the kubelet reports on two NUMA nodes arrives twice; the port reports it once
    records.record("team-a", "trainer-0", "main", GPU, ["GPU-a"])
    containers = {c.key: c for c in await client.list(timeout=5)}
    assert set(containers) == {("team-a", "trainer-0", "main"), ("team-a", "trainer-0", "sidecar")}
    main = containers[("team-a", "trainer-0", "main")]
    assert main.devices == {GPU: frozenset({"GPU-a"}), NIC: frozenset({"0000:1a:00.2"})}
    assert containers[("team-a", "trainer-0", "sidecar")].devices == {}
    assert up(registry) == 1


async def test_allocatable_is_every_healthy_device(client: KubeletPodResources) -> None:
    assert await client.allocatable(timeout=5) == {GPU: frozenset({"GPU-a", "GPU-b"}),
                                                   NIC: frozenset({"0000:1a:00.2", "0000:1a:00.3"})}


async def test_missing_socket_is_a_state_not_a_crash(short_dir: Path, registry: CollectorRegistry) -> None:
    client = KubeletPodResources(str(short_dir / "absent.sock"), reachability=Reachability(registry, "x"))
    for _ in range(3):
        with pytest.raises(PodResourcesError) as caught:
            await client.list(timeout=0.5)
        assert caught.value.reason == "unavailable"
    assert up(registry) == 0
    await client.aclose()


async def test_slow_kubelet_times_out(server: PodResourcesServer, client: KubeletPodResources,
                                      registry: CollectorRegistry) -> None:
    await client.list(timeout=5)
    release = asyncio.Event()
    server.hold = release.wait
    try:
        with pytest.raises(PodResourcesError) as caught:
            await client.list(timeout=0.05)
        assert caught.value.reason == "timeout"
        assert up(registry) == 0
    finally:
        release.set()
        server.hold = None
    await client.list(timeout=5)
    assert up(registry) == 1


async def test_garbage_reply_is_refused(server: PodResourcesServer, client: KubeletPodResources,
                                        registry: CollectorRegistry) -> None:
    server.garbage = True
    with pytest.raises(PodResourcesError) as caught:
        await client.list(timeout=5)
    assert caught.value.reason == "invalid"
    assert up(registry) == 0


async def test_kubelet_rate_limit_is_reported_and_not_a_failure(server: PodResourcesServer,
                                                                client: KubeletPodResources,
                                                                registry: CollectorRegistry) -> None:
    await client.list(timeout=5)
    server.bucket = TokenBucket(1, 1, monotonic=lambda: 0.0)  # the kubelet's bucket drained by other clients
    server.bucket.take()
    with pytest.raises(PodResourcesError) as caught:
        await client.list(timeout=5)
    assert caught.value.reason == "rate_limited"
    assert up(registry) == 1, "a rate-limited call proves the kubelet is there"


async def test_client_keeps_inside_its_share_of_the_kubelet_limit(server: PodResourcesServer) -> None:
    now = [0.0]
    client = KubeletPodResources(server.socket_path, bucket=TokenBucket(50, 5, monotonic=lambda: now[0]))
    try:
        for _ in range(5):
            await client.list(timeout=5)
        with pytest.raises(PodResourcesError) as caught:
            await client.list(timeout=5)
        assert caught.value.reason == "rate_limited"
        assert server.calls["List"] == 5, "the refused call never reached the kubelet"
        now[0] += 0.02  # one token at 50/s
        await client.list(timeout=5)
        assert server.calls["List"] == 6
    finally:
        await client.aclose()


def test_bucket_refuses_more_than_the_kubelet_allows() -> None:
    with pytest.raises(ValueError, match="exceeds"):
        TokenBucket(200, 10)
    with pytest.raises(ValueError, match="exceeds"):
        TokenBucket(10, 20)


async def test_client_survives_a_kubelet_restart(server: PodResourcesServer, client: KubeletPodResources,
                                                 registry: CollectorRegistry) -> None:
    await client.list(timeout=5)
    await server.stop()
    assert not Path(server.socket_path).exists()
    with pytest.raises(PodResourcesError) as caught:
        await client.list(timeout=5)  # fails at once; a short deadline read "timeout" on a busy machine
    assert caught.value.reason == "unavailable"
    assert up(registry) == 0
    await server.start()
    await until_answers(client)  # the channel reconnects by path within its short reconnect backoff
    assert up(registry) == 1


async def test_in_memory_twin_has_the_same_failures(records: DeviceRecords, registry: CollectorRegistry) -> None:
    twin = InMemoryPodResources(records, Reachability(registry, "memory"))
    assert {c.key for c in await twin.list()} == {("team-a", "trainer-0", "main"), ("team-a", "trainer-0", "sidecar")}
    assert up(registry) == 1
    twin.available = False
    with pytest.raises(PodResourcesError) as caught:
        await twin.allocatable()
    assert caught.value.reason == "unavailable"
    assert up(registry) == 0
    twin.available, twin.garbage = True, True
    with pytest.raises(PodResourcesError) as caught:
        await twin.list()
    assert caught.value.reason == "invalid"
