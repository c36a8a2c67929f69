"""The node the golden answers run on (`golden_answers`): the stand-in kubelet and the agent's device-plugin manager
on one simulated profile, talking over unix sockets, in one of three modes:

- `joint`: the agent serves GPUs (or MIG slices) and VFs, without the kubelet's facts (the admission context);
- `joint-facts`: the same with the ownership facts (PodResources v1 from the stand-in kubelet, and pod specs);
- `nic-only`: the agent serves the VFs only, NVIDIA's plugin (a stand-in) the GPUs and MIG slices, by UUID; the
  container's GPUs reach the agent only through PodResources.

Only public interfaces that exist before and after issue 43 are used. One differs: the facts are handed to the
manager by `use_ownership(OwnershipFacts(...))` before it and by the constructor's `ownership=` after it.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import inspect
import random
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from prometheus_client import CollectorRegistry

from agent.config.model import DevicePluginConfig
from agent.deviceplugin.manager import DevicePluginManager
from agent.deviceplugin.v1beta1 import api_pb2
from agent.host.podresources import Reachability
from agent.host.podresources.client import KubeletPodResources
from agent.host.podresources.ratelimit import TokenBucket
from agent.kube.model import PodView
from agent.ownership.service import OwnershipService
from agent.simulate.kubelet import LocalKubelet
from agent.simulate.node import simulated_topology
from agent.topology.model import Topology
from tests.fakes.standin_plugin import StandInPlugin

GPU, MIG, NIC = "nvidia.com/gpu", "nvidia.com/mig-1g.10gb", "gpunodeagent.io/sriov_rdma"
# profile -> (MIG strategy, GPU-kind resources served)
PROFILES: dict[str, tuple[str, tuple[str, ...]]] = {
    "dgx-h100": ("none", (GPU,)),
    "pcie-pairs": ("none", (GPU,)),
    "dgx-h100-mig": ("mixed", (GPU, MIG)),
}
MODES = ("joint", "joint-facts", "nic-only")


class StepClock:
    """The admission context's clock: monotonic time advanced by the run, wall time and waits real."""

    def __init__(self) -> None:
        self.t = 1000.0

    def now(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return self.t

    async def wait(self, event: asyncio.Event, timeout: float) -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), max(timeout, 0.0))
        return event.is_set()


_topologies: dict[str, tuple[Path, Topology]] = {}


def topology_of(profile: str) -> Topology:
    """The profile's topology, its sysfs tree written once per process and removed at exit (in memory where there
    is a /dev/shm: ~0.5 s for the DGX H100's tree there, ~8 s to write and 5 s to remove on this disk)."""
    if profile not in _topologies:
        shm = Path("/dev/shm")  # a private mkdtemp directory in it
        root = Path(tempfile.mkdtemp(prefix="gngoldsys", dir=shm if shm.is_dir() else None))
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        _topologies[profile] = root, simulated_topology(profile, root)
    return _topologies[profile][1]


def nvidia_devices(topology: Topology, resource: str, strategy: str) -> list[str]:
    """What NVIDIA's plugin serves as `resource` (whole GPUs by UUID; with `mixed`, MIG slices by MIG UUID)."""
    if resource == MIG:
        return sorted(m.uuid for g in topology.gpus for m in g.mig_devices)
    return sorted(g.uuid for g in topology.gpus if g.uuid and not (strategy == "mixed" and g.mig_devices))


@dataclass
class Node:
    profile: str
    mode: str
    directory: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="gngold")))
    clock: StepClock = field(default_factory=StepClock)
    kubelet: LocalKubelet | None = None
    manager: DevicePluginManager | None = None
    service: OwnershipService | None = None
    nvidia: list[StandInPlugin] = field(default_factory=list)
    specs: dict[tuple[str, str], PodView] = field(default_factory=dict)
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)  # the agent's metrics

    async def __aenter__(self) -> Node:
        try:
            await self._start()
        except BaseException:
            await self.__aexit__()  # what started stops, the scratch directory goes
            raise
        return self

    async def _start(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r}: one of {', '.join(MODES)}")
        strategy, resources = PROFILES[self.profile]
        topology = topology_of(self.profile)
        facts, serve_gpus = self.mode != "joint", self.mode != "nic-only"
        self.kubelet = kubelet = LocalKubelet(self.directory / "dp", rng=random.Random(0),  # noqa: S311
                                              pod_resources_socket=self.directory / "pr" / "kubelet.sock"
                                              if facts else None)
        if kubelet.pod_resources is not None:
            # the kubelet's own limit, on the run's clock (0.1 s per container): never reached here
            kubelet.pod_resources.bucket = TokenBucket(100, 10, monotonic=self.clock.monotonic)
        await kubelet.start()
        if not serve_gpus:
            for resource in resources:
                plugin = StandInPlugin(self.directory / "dp", resource, nvidia_devices(topology, resource, strategy),
                                       rng=random.Random(3))  # noqa: S311
                await plugin.start()
                self.nvidia.append(plugin)
        registry = self.registry
        if facts:
            assert kubelet.pod_resources is not None
            client = KubeletPodResources(kubelet.pod_resources.socket_path,
                                         reachability=Reachability(registry, "golden"),
                                         bucket=TokenBucket(monotonic=self.clock.monotonic))
            self.service = OwnershipService(client, pod_specs=lambda: self.specs, registry=registry,
                                            lookup_timeout=5.0)
        config = DevicePluginConfig(device_plugin_dir=str(self.directory / "dp"), serve_gpus=serve_gpus,
                                    mig_strategy=strategy)
        options: dict[str, Any] = {}
        if self.service is not None and "ownership" in inspect.signature(DevicePluginManager).parameters:
            options["ownership"] = self.service  # after issue 43's work; before it, `use_ownership` below
        self.manager = manager = DevicePluginManager(
            config, topology, registry=registry, plugin_registry_dir=str(self.directory / "reg"),
            cdi_spec_dir=str(self.directory / "cdi"), clock=self.clock, poll_interval=0.05, register_timeout=2.0,
            **options)
        if self.service is not None and not options:
            from agent.deviceplugin.facts import OwnershipFacts

            manager.use_ownership(OwnershipFacts(self.service, manager.pools, GPU))  # type: ignore[attr-defined]
        await manager.start()
        wanted = (*resources, NIC)
        await kubelet.wait_for(lambda: all(r in kubelet.plugins and kubelet.plugins[r].lists > 0
                                           and kubelet.plugins[r].connected for r in wanted))
        if self.service is not None:
            await self.service.refresh()  # what the ownership subsystem does first

    async def __aexit__(self, *exc: object) -> None:
        if self.manager is not None:
            await self.manager.stop()
        if self.service is not None:
            await self.service.port.aclose()
        for plugin in self.nvidia:
            await plugin.stop()
        if self.kubelet is not None:
            await self.kubelet.stop()
        shutil.rmtree(self.directory, ignore_errors=True)

    @property
    def ours(self) -> set[str]:
        """The resources the agent serves (the rest are NVIDIA's stand-in's)."""
        return {NIC} | (set() if self.mode == "nic-only" else set(PROFILES[self.profile][1]))

    def devices(self, resource: str) -> list[str]:
        assert self.kubelet is not None
        return sorted(self.kubelet.plugins[resource].healthy())

    def start_pod(self, number: int, requests: dict[str, int]) -> None:
        """The kubelet lists the pod of container `number` (with the facts: in PodResources and its spec)."""
        if self.kubelet is None or self.service is None:
            return
        key = ("golden", f"c{number}")
        limits = {name: str(size) for name, size in requests.items()}
        self.specs[key] = PodView.from_dict({"metadata": {"namespace": key[0], "name": key[1]}, "spec": {
            "containers": [{"name": "main", "image": "busybox", "resources": {"limits": limits}}]}})
        self.kubelet.records.add_pod(*key, ["main"])

    def held(self, number: int, resource: str, ids: list[str]) -> None:
        if self.kubelet is not None and self.service is not None:
            self.kubelet.records.record("golden", f"c{number}", "main", resource, ids)

    def end_pod(self, number: int) -> None:
        if self.kubelet is not None and self.service is not None:
            self.kubelet.records.remove_pod("golden", f"c{number}")
            self.specs.pop(("golden", f"c{number}"), None)

    async def prefer(self, resource: str, available: list[str], must: list[str], size: int) -> list[str]:
        assert self.kubelet is not None
        reply = await self.kubelet.plugins[resource].stub.GetPreferredAllocation(
            api_pb2.PreferredAllocationRequest(container_requests=[api_pb2.ContainerPreferredAllocationRequest(
                available_deviceIDs=available, must_include_deviceIDs=must, allocation_size=size)]))
        return list(reply.container_responses[0].deviceIDs) if reply.container_responses else []

    async def allocate(self, resource: str, ids: list[str]) -> bool:
        """The plugin's Allocate; False when it refuses (the answer then is the refusal)."""
        assert self.kubelet is not None
        try:
            await self.kubelet.plugins[resource].stub.Allocate(api_pb2.AllocateRequest(
                container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=ids)]))
        except grpc.aio.AioRpcError:
            return False
        return True
