"""Building the pools of the agent's biggest time-sliced offers does not hold the event loop (issue 37, item 1:
~20 ms of loop CPU per turn at most): 1024 replicas of each of the dgx-h100's 8 GPUs (8,192 IDs) and of the
dgx-h100-mig's 28 1g.10gb devices (28,672 IDs). Building them copied a record per replica on the loop, at start
(twice) and at each rescan, and each ListAndWatch list was built there too: 0.1-0.2 s a turn on the MIG node.

Measured from the start of the manager (construction included) until the stand-in kubelet holds the full list,
then for a rescan that changes nothing and one that takes a device (1024 replicas) away, until the kubelet holds
the new list. The kubelet runs in a process of its own (`kubelet_process`): decoding a 1.7 MB list is its work,
not the agent's. A 5 ms ticker on the loop records the loop thread's CPU between two turns, GC paused (see
test_replica_scale)."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from agent.deviceplugin.manager import DevicePluginManager
from agent.topology.model import Topology
from tests.deviceplugin.test_replica_scale import LOOP_CPU_S, LOOP_GAP_S, _collector_paused, _ticker
from tests.deviceplugin.test_time_slicing import nvidia_config, write

MakeManager = Callable[..., Awaitable[DevicePluginManager]]
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class KubeletProcess:
    """The stand-in kubelet's process and the last list count and size it reported per resource."""

    process: asyncio.subprocess.Process
    lists: dict[str, tuple[int, int]]

    async def follow(self) -> None:
        assert self.process.stdout is not None
        async for line in self.process.stdout:
            name, lists, devices = line.decode().split()
            self.lists[name] = (int(lists), int(devices))

    async def wait_for(self, resource: str, devices: int, after: int = 0, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not (self.lists.get(resource, (0, 0))[0] > after and self.lists[resource][1] == devices):
            assert time.monotonic() < deadline, f"{resource}: {self.lists.get(resource)}, want {devices} devices"
            await asyncio.sleep(0.01)


@pytest.fixture
async def kubelet_process(sockdir: str) -> AsyncIterator[KubeletProcess]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.deviceplugin.kubelet_process", sockdir, cwd=ROOT,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    assert process.stdout is not None and process.stdin is not None
    assert await asyncio.wait_for(process.stdout.readline(), 30) == b"ready\n"
    kubelet = KubeletProcess(process, {})
    following = asyncio.create_task(kubelet.follow())
    yield kubelet
    process.stdin.close()
    try:
        await asyncio.wait_for(process.wait(), 10)
    except TimeoutError:
        process.kill()
        await process.wait()
    await following


def _without_one(topology: Topology, mig: bool) -> Topology:
    """The topology with GPU 0's first MIG device (mig) or GPU 7 gone."""
    if not mig:
        return replace(topology, gpus=tuple(g for g in topology.gpus if g.index != 7))
    gpus = tuple(replace(g, mig_devices=g.mig_devices[1:]) if g.index == 0 else g for g in topology.gpus)
    return replace(topology, gpus=gpus)


@dataclass(frozen=True)
class Offer:
    """A node, its time-slicing file, the resource it serves and how many replicas."""

    topology: Topology
    text: str
    resource: str
    served: int
    mig: bool


@pytest.fixture(params=[False, True], ids=["dgx-h100-8x1024", "dgx-h100-mig-28x1024"])
def offer(request: pytest.FixtureRequest, dgx: Topology, mig_node: Topology) -> Offer:
    if request.param:
        return Offer(mig_node, "version: v1\nflags:\n  migStrategy: mixed\nsharing:\n  timeSlicing:\n    resources:\n"
                               "    - name: mig-1g.10gb\n      replicas: 1024\n", "nvidia.com/mig-1g.10gb", 28 * 1024,
                     mig=True)
    return Offer(dgx, "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n"
                      "      replicas: 1024\n", "nvidia.com/gpu", 8 * 1024, mig=False)


async def test_building_the_biggest_replica_pools_never_holds_the_loop(
        kubelet_process: KubeletProcess, sockdir: str, make_manager: MakeManager, offer: Offer,
        tmp_path: Path) -> None:
    config = nvidia_config(write(tmp_path, offer.text), sockdir)
    topology, resource, served = offer.topology, offer.resource, offer.served
    smaller = _without_one(topology, offer.mig)
    turns: dict[str, float] = {}
    gaps: list[float] = []
    took: dict[str, float] = {}

    async def measured(what: str, step: Callable[[], Awaitable[object]]) -> None:
        cpu: list[float] = []
        stop = asyncio.Event()
        with _collector_paused():
            ticker = asyncio.create_task(_ticker(gaps, stop, cpu))
            await asyncio.sleep(0.02)
            started = time.monotonic()
            await step()
            took[what] = time.monotonic() - started
            await asyncio.sleep(0.05)
            stop.set()
            await ticker
        turns[what] = max(cpu)

    managers: list[DevicePluginManager] = []

    async def start() -> None:  # construction included: `run` builds the manager on the loop too
        managers.append(await make_manager(config, topology))
        await kubelet_process.wait_for(resource, served)

    await measured("start", start)
    lists = kubelet_process.lists[resource][0]

    async def unchanged() -> None:
        await managers[0].update_topology(topology)

    async def changed() -> None:
        await managers[0].update_topology(smaller)
        await kubelet_process.wait_for(resource, served - 1024, after=lists)

    await measured("rescan, nothing changed", unchanged)
    assert kubelet_process.lists[resource][0] == lists  # no new list for the kubelet
    await measured("rescan, one device gone", changed)
    summary = ", ".join(f"{what}: {cpu * 1000:.1f} ms CPU ({took[what]:.2f} s)" for what, cpu in turns.items())
    print(f"\n{resource} x {served}: the loop's longest turn: {summary}")
    assert max(turns.values()) <= LOOP_CPU_S, f"the event loop thread ran too long in one turn: {summary}"
    assert max(gaps) < LOOP_GAP_S, f"the event loop was held for {max(gaps):.3f} s; {summary}"
    assert turns["rescan, nothing changed"] <= 0.005, summary
