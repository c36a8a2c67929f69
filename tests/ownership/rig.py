"""The pairing rig shared by the ownership process tests: a stand-in kubelet serving the device-plugin API and
PodResources v1 over unix sockets, the agent's device-plugin manager with ownership facts (real gRPC client),
and optionally a stand-in for NVIDIA's GPU plugin (NIC-only mode).

`api`: whether the agent has pod specs (the own-node pod watch); without, it works from PodResources alone.
`pod_lookup`: the cluster port the agent fetches a lagging pod's spec through (None: no fetches).
`now`: the rate limits' clock (advanced by the test, 0.1 s per admission), or None for the real clock.
`cluster` / `watch`: the real lightkube port on the API double and the agent's own-node pod watch through it.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from agent.deviceplugin.manager import DevicePluginManager
from agent.deviceplugin.v1beta1 import api_pb2_grpc
from agent.host.podresources import Reachability
from agent.host.podresources.client import KubeletPodResources
from agent.host.podresources.ratelimit import TokenBucket
from agent.kube.cluster import LightkubeCluster, connect
from agent.kube.metrics import ApiRequestCounter
from agent.kube.model import PodView
from agent.kube.podwatch import NodePodWatch
from agent.kube.port import PodLookupApi
from agent.ownership.service import OwnershipService, PodSpecs
from agent.ownership.spec_fetch import PodSpecFetcher
from agent.placement.policy import achieved_levels
from agent.simulate.kubelet import LocalKubelet
from agent.simulate.node import simulated_topology
from agent.topology.model import Level, Topology
from tests.deviceplugin.conftest import FAST, dp_config
from tests.fakes import fixtures
from tests.fakes.apiserver import ApiServerDouble, container_spec, write_kubeconfig
from tests.fakes.standin_plugin import StandInPlugin

GPU, NIC = "nvidia.com/gpu", "gpunodeagent.io/sriov_rdma"
_topologies: dict[str, Topology] = {}


def topology_of(profile: str) -> Topology:
    if profile not in _topologies:
        _topologies[profile] = simulated_topology(profile, Path(tempfile.mkdtemp(prefix="gnatopo")))
    return _topologies[profile]


def pix(topology: Topology, gpu: str, vf: str) -> bool:
    return achieved_levels(topology, [gpu], [vf]) == [Level.PIX]


class Picks:
    """NVIDIA's stand-in picks `next` when offered (else the lowest ID): its `rng`."""

    def __init__(self) -> None:
        self.next = ""

    def shuffle(self, items: list[str]) -> None:
        items.sort(key=lambda i: (i != self.next, i))


@dataclass
class Node:
    """Stand-in kubelet (with PodResources), the agent's manager with ownership facts, optionally NVIDIA's plugin."""

    directory: Path
    topology: Topology
    serve_gpus: bool
    api: bool = True
    lookup_timeout: float = 1.0
    real_clock: bool = False
    kubelet: LocalKubelet = field(init=False)
    specs: dict[tuple[str, str], PodView] = field(default_factory=dict)
    manager: DevicePluginManager | None = None
    service: OwnershipService | None = None
    nvidia: StandInPlugin | None = None
    now: float = 0.0  # the rate limits' clock unless `real_clock`: the test advances it per admission
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    watched: PodSpecs | None = None  # pod specs from a real own-node pod watch instead of `specs`
    pod_lookup: PodLookupApi | None = None
    fetch_late_s: float = 30.0  # a fetch's own bound: generous, the tests hold answers on purpose
    config_changes: dict[str, object] = field(default_factory=dict)  # device-plugin settings (time-slicing...)
    gpus_by_bus_id: bool = False  # NVIDIA's stand-in names GPUs by PCI bus id (a plugin or node without NVML)

    def __post_init__(self) -> None:
        self.kubelet = LocalKubelet(self.directory / "dp", rng=random.Random(7),  # noqa: S311
                                    pod_resources_socket=self.directory / "pr" / "kubelet.sock")
        assert self.kubelet.pod_resources is not None  # its rate limit runs on the same admission clock
        self.kubelet.pod_resources.bucket = TokenBucket(100, 10, monotonic=self.clock)

    @property
    def clock(self) -> Callable[[], float]:
        return time.monotonic if self.real_clock else (lambda: self.now)

    async def start_agent(self, *, first_poll: bool = True, poll_first: bool = False) -> None:
        """A (re)started agent: a fresh manager, allocator and ownership service. `first_poll` False: the ownership
        poll's first reading has not come back when the kubelet starts calling (the race after a restart).
        `poll_first`: the poll's first reading comes before the plugins (re)register, as the agent's ownership
        subsystem starts beside the device plugins (the kubelet then has none of their devices as allocatable)."""
        assert self.kubelet.pod_resources is not None
        self.registry = registry = CollectorRegistry()
        client = KubeletPodResources(self.kubelet.pod_resources.socket_path,
                                     reachability=Reachability(registry, "test"),
                                     bucket=TokenBucket(monotonic=self.clock))
        specs = self.watched or ((lambda: self.specs) if self.api else None)
        fetcher = None if self.pod_lookup is None else PodSpecFetcher(self.pod_lookup, registry,
                                                                      late_s=self.fetch_late_s)
        self.service = OwnershipService(client, pod_specs=specs, registry=registry,
                                        lookup_timeout=self.lookup_timeout, spec_fetcher=fetcher)
        config = dp_config(str(self.directory / "dp"), serve_gpus=self.serve_gpus, **self.config_changes)
        self.manager = DevicePluginManager(config, self.topology, registry=registry, **FAST,
                                           plugin_registry_dir=str(self.directory / "reg"),
                                           cdi_spec_dir=str(self.directory / "cdi"), ownership=self.service)
        ours = (GPU, NIC) if self.serve_gpus else (NIC,)
        before = {r: self.kubelet.plugins.get(r) for r in ours}  # a restart: wait for the new registrations
        if poll_first:
            await self.service.refresh()
        await self.manager.start()
        await self.kubelet.wait_for(lambda: all(r in self.kubelet.plugins and self.kubelet.plugins[r].lists > 0
                                                and self.kubelet.plugins[r].connected for r in (GPU, NIC))
                                    and all(self.kubelet.plugins[r] is not before[r] for r in ours))
        if first_poll and not poll_first:
            await self.service.refresh()  # what the ownership subsystem does first

    async def stop_agent(self) -> None:
        if self.manager is not None:
            await self.manager.stop()
        if self.service is not None:
            if self.service.spec_fetcher is not None:
                await self.service.spec_fetcher.aclose()
            await self.service.port.aclose()

    def gpu_ids(self) -> list[str]:
        if self.gpus_by_bus_id:
            return sorted(g.bus_id for g in self.topology.gpus)
        return sorted(g.uuid for g in self.topology.gpus if g.uuid)

    def free(self, resource: str) -> set[str]:
        return self.kubelet.plugins[resource].healthy() - self.kubelet.allocated.get(resource, set())

    def pod(self, name: str, requests: dict[str, int]) -> tuple[str, str]:
        self.specs[("ml", name)] = PodView.from_dict({"metadata": {"namespace": "ml", "name": name},
                                                      "spec": {"containers": [container_spec("main", requests)]}})
        return "ml", name

    def sample(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0


def offered_only(node: Node) -> None:
    for resource, offered, preferred in node.kubelet.preferences:
        assert set(preferred) <= offered, f"{resource}: preferred {preferred} outside the offer"


@pytest.fixture
async def node_factory() -> AsyncIterator:
    made: list[Node] = []

    async def make(serve_gpus: bool, profile: str = "pcie-pairs", **options: object) -> Node:
        node = Node(Path(tempfile.mkdtemp(prefix="gnapair")), topology_of(profile), serve_gpus,
                    **options)  # type: ignore[arg-type]
        made.append(node)
        await node.kubelet.start()
        if not serve_gpus:
            node.nvidia = StandInPlugin(node.directory / "dp", GPU, node.gpu_ids(), rng=random.Random(3))  # noqa: S311
            await node.nvidia.start()
        await node.start_agent()
        return node

    yield make
    for node in made:
        await node.stop_agent()
        if node.nvidia is not None:
            await node.nvidia.stop()
        await node.kubelet.stop()
        shutil.rmtree(node.directory, ignore_errors=True)


@pytest.fixture
async def cluster(api: ApiServerDouble, tmp_path: Path) -> AsyncIterator[LightkubeCluster]:
    """The agent's real cluster port (lightkube) on the API double."""
    port = connect(fixtures.NODE, ApiRequestCounter(CollectorRegistry()),
                   str(write_kubeconfig(tmp_path / "kc", api.url)), timeout=2.0)
    yield port
    await port.aclose()


@pytest.fixture
async def watch(api: ApiServerDouble, cluster: LightkubeCluster) -> AsyncIterator[NodePodWatch]:
    """The own-node pod watch, synced (its first list done) before the test starts."""
    pods = NodePodWatch(cluster, lambda _pods: None, rng=random.Random(1))  # noqa: S311
    stop = asyncio.Event()
    task = asyncio.create_task(pods.run(stop))
    try:
        await until(lambda: pods.synced)
        yield pods
    finally:
        if api.pod_watch_gate is not None:
            api.pod_watch_gate.set()
        stop.set()
        await task


async def until(condition: Callable[[], bool], deadline: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline
    while not condition():
        assert loop.time() < end, "condition not met in time"
        await asyncio.sleep(0.01)


def api_pod(api: ApiServerDouble, name: str, requests: dict[str, int]) -> tuple[str, str]:
    """A pod in namespace ml on the double's node, one container asking for `requests`."""
    api.add_pod("ml", name, containers=[container_spec("main", requests)])
    return "ml", name


class TimedStub:
    """The kubelet's stub, timing each GetPreferredAllocation as the kubelet sees it."""

    def __init__(self, stub: api_pb2_grpc.DevicePluginStub, into: list[tuple[float, float]]) -> None:
        self._stub, self._into = stub, into

    def __getattr__(self, name: str) -> object:
        return getattr(self._stub, name)

    async def GetPreferredAllocation(self, request: object, **kwargs: object) -> object:  # the gRPC method name
        started = time.monotonic()
        try:
            return await self._stub.GetPreferredAllocation(request, **kwargs)  # type: ignore[arg-type]
        finally:
            self._into.append((started, time.monotonic() - started))
