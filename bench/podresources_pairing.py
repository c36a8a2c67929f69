"""PIX fraction of 1 GPU + 1 NIC containers with and without the kubelet's PodResources facts, and the cost of
the lookup inside GetPreferredAllocation.

For each profile (pcie-pairs, dgx-h100) the stand-in kubelet (serving PodResources v1 over a unix socket) admits
pods through the agent's real `DevicePluginManager` over gRPC, resource by resource in a random order, with
churn (pods end at random, at most 6 live). Scenarios:

- `nic-only spread`: GPUs served by a stand-in for NVIDIA's plugin (UUID IDs, its own random picks), the agent
  serves only VFs and knows nothing of the container's GPUs (the policy before PodResources: spread over PFs).
- `nic-only facts`: the same, with the PodResources lookup (`--no-serve-gpus` as shipped).
- `nic-only no-api`: the same without pod specs (no API access): the kubelet's records alone.
- `nic-only lagging`: pod specs, but each pod reaches the agent's pod watch only after its admission (a watch that
  lags: the pod is created at the instant the kubelet admits it).
- `joint guess`: the agent serves both (`--serve-gpus`), 20 % single-resource pods interleaved, the admission
  context's time-window guess only.
- `joint facts`: the same with the PodResources lookup.
- `joint restarts`: the same without API access, the agent restarted twice mid-churn, each time answering the
  kubelet before its ownership poll's first reading.
- `joint early restarts`: the same, but each time the poll's first reading comes before the device plugins
  register again (the kubelet then has none of their devices as allocatable), as the ownership subsystem starts
  beside them.

Misses: NIC-only, a GPU-first container whose VF is not PIX while a VF under its GPU's switch was free; joint, a
container not PIX while a free GPU and a free VF shared a switch when its admission began. Fallbacks: preference
calls without the partner, by reason (`gpu_node_agent_preference_fallbacks_total`).

PIX fraction = containers whose GPU and VF share a PCIe switch / all GPU+NIC containers, overall and split by
which resource the kubelet allocated first. The rate limits (client 50/s, kubelet 100/s) run on a clock that
advances 0.1 s per admission, so the policy is measured, not the bench's speed. Latency: the partner lookup
(one `List` over the socket + matching against pod specs) timed inside the preference calls of `joint facts`,
and the whole GetPreferredAllocation as the kubelet's stub sees it, with and without the lookup.

    python bench/podresources_pairing.py [--steps N | --containers N] [--seed S] [--load N] [--scenarios ...]

`--load N` runs N busy-looping processes beside it (2 takes both cores of the development VM).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing
import os
import random
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.fakes: the stand-in NVIDIA plugin

from prometheus_client import CollectorRegistry

from agent.deviceplugin.manager import DevicePluginManager
from agent.deviceplugin.v1beta1 import api_pb2_grpc
from agent.host.podresources.client import KubeletPodResources
from agent.host.podresources.ratelimit import TokenBucket
from agent.kube.model import PodView
from agent.ownership.service import OwnershipService
from agent.placement.policy import achieved_levels
from agent.simulate.kubelet import AdmissionError, LocalKubelet
from agent.simulate.node import simulated_topology
from agent.topology.model import Level, Topology
from tests.deviceplugin.conftest import FAST, dp_config
from tests.fakes.apiserver import container_spec
from tests.fakes.standin_plugin import StandInPlugin

GPU, NIC = "nvidia.com/gpu", "gpunodeagent.io/sriov_rdma"
PROFILES = ("pcie-pairs", "dgx-h100")
SCENARIOS = ("nic-only spread", "nic-only facts", "nic-only no-api", "nic-only lagging", "joint guess",
             "joint facts", "joint restarts", "joint early restarts")


def spin(stop) -> None:  # stop: a multiprocessing Event
    while not stop.is_set():
        sum(range(10_000))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


class TimedStub:
    """Times every GetPreferredAllocation the kubelet sends (its stub's view: socket, servicer, lookup, policy)."""

    def __init__(self, stub: api_pb2_grpc.DevicePluginStub, into: list[float]) -> None:
        self._stub, self._into = stub, into

    def __getattr__(self, name: str):
        return getattr(self._stub, name)

    async def GetPreferredAllocation(self, request, **kwargs):
        started = time.perf_counter()
        try:
            return await self._stub.GetPreferredAllocation(request, **kwargs)
        finally:
            self._into.append(time.perf_counter() - started)


def free(kubelet: LocalKubelet, resource: str) -> set[str]:
    return kubelet.plugins[resource].healthy() - kubelet.allocated.get(resource, set())


def is_pix(topology: Topology, gpus: Iterable[str], vfs: Iterable[str]) -> bool:
    return achieved_levels(topology, list(gpus), list(vfs)) == [Level.PIX]


async def churn(kubelet: LocalKubelet, specs: dict[tuple[str, str], PodView], topology: Topology, *, joint: bool,
                steps: int, containers: int | None, seed: int, now: list[float], lagging: bool,
                restart: Callable[[], Awaitable[None]] | None) -> dict[str, list[bool]]:
    """Admit and end pods; per first resource, whether each GPU+NIC container got a PIX pair ('gpu-first',
    'nic-first') and whether it was a miss ('miss')."""
    rng = random.Random(seed)
    live: list[tuple[str, str]] = []
    pix: dict[str, list[bool]] = defaultdict(list)
    restarts = {steps // 3, 2 * steps // 3} if containers is None else {containers // 3, 2 * containers // 3}
    step = 0
    while (step < steps) if containers is None else (len(pix["gpu-first"]) + len(pix["nic-first"]) < containers):
        step += 1
        now[0] += 0.1
        progress = step if containers is None else len(pix["gpu-first"]) + len(pix["nic-first"])
        if restart is not None and progress in restarts:
            restarts.discard(progress)
            await restart()
        if live and (len(live) >= 6 or rng.random() < 0.35):
            kubelet.end_pod(*live.pop(rng.randrange(len(live))))
            continue
        roll = rng.random()
        requests = {GPU: 1, NIC: 1}
        if joint and roll < 0.2:
            requests = {GPU: 1} if roll < 0.1 else {NIC: 1}
        order = [GPU, NIC] if rng.random() < 0.5 else [NIC, GPU]
        order = [r for r in order if r in requests]
        key = ("bench", f"p{step}")
        spec = PodView.from_dict({"metadata": {"namespace": key[0], "name": key[1]},
                                  "spec": {"containers": [container_spec("main", requests)]}})
        if not lagging:
            specs[key] = spec
        free_gpus, free_vfs = free(kubelet, GPU), free(kubelet, NIC)
        try:
            got = await kubelet.admit(requests, order=order, pod=key)
        except AdmissionError:
            continue
        finally:
            specs[key] = spec  # a lagging watch delivers it after the admission
        live.append(key)
        if len(requests) == 2:
            first = "gpu-first" if order[0] == GPU else "nic-first"
            paired = is_pix(topology, got[GPU], got[NIC])
            pix[first].append(paired)
            if joint:
                possible = any(is_pix(topology, [g], [v]) for g in free_gpus for v in free_vfs)
            else:
                possible = first == "gpu-first" and any(is_pix(topology, got[GPU], [v]) for v in free_vfs)
            pix["miss"].append(possible and not paired)
    return pix


class Agent:
    """The agent's manager and ownership service on one stand-in kubelet; `start` again after `stop` is a restart
    (fresh allocator, ownership service and metrics; the kubelet keeps its records). Counters add up over runs."""

    def __init__(self, kubelet: LocalKubelet, topology: Topology, directory: Path, *, joint: bool, facts: bool,
                 specs: dict[tuple[str, str], PodView] | None, now: list[float]) -> None:
        self.kubelet, self.topology, self.directory = kubelet, topology, directory
        self.joint, self.facts, self.specs, self.now = joint, facts, specs, now
        self.registries: list[CollectorRegistry] = []
        self.lookups: list[float] = []
        self.preference_rpc: list[float] = []
        self.manager: DevicePluginManager | None = None
        self.client: KubeletPodResources | None = None
        self.poll_first = False  # a restart's first poll reading comes before the plugins register again

    async def start(self, *, first_poll: bool = True) -> None:
        assert self.kubelet.pod_resources is not None
        registry = CollectorRegistry()
        self.registries.append(registry)
        specs = self.specs
        self.client = KubeletPodResources(self.kubelet.pod_resources.socket_path,
                                          bucket=TokenBucket(monotonic=lambda: self.now[0]))
        service = OwnershipService(self.client, pod_specs=(lambda: specs) if specs is not None else None,
                                   registry=registry)
        self.manager = manager = DevicePluginManager(
            dp_config(str(self.directory / "dp"), serve_gpus=self.joint), self.topology, registry=registry, **FAST,
            plugin_registry_dir=str(self.directory / "reg"), cdi_spec_dir=str(self.directory / "c"),
            ownership=service if self.facts else None)
        if manager.facts is not None:
            ownership = manager.facts
            plain = ownership.partner

            async def timed(pool):  # the lookup as the servicer awaits it
                started = time.perf_counter()
                try:
                    return await plain(pool)
                finally:
                    self.lookups.append(time.perf_counter() - started)

            ownership.partner = timed  # type: ignore[method-assign]  # measured: the servers take it at start
        ours = (GPU, NIC) if self.joint else (NIC,)
        before = {r: self.kubelet.plugins.get(r) for r in ours}
        if self.poll_first and not first_poll:
            await service.refresh()
        await manager.start()
        await self.kubelet.wait_for(lambda: all(r in self.kubelet.plugins and self.kubelet.plugins[r].lists
                                                and self.kubelet.plugins[r].connected for r in (GPU, NIC))
                                    and all(self.kubelet.plugins[r] is not before[r] for r in ours), 30)
        if first_poll:
            await service.refresh()
        view = self.kubelet.plugins[NIC]
        view.stub = TimedStub(view.stub, self.preference_rpc)  # type: ignore[assignment]

    async def stop(self) -> None:
        if self.manager is not None:
            await self.manager.stop()
        if self.client is not None:
            await self.client.aclose()

    async def restart(self) -> None:
        await self.stop()
        await self.start(first_poll=False)

    def total(self, name: str, **labels: str) -> int:
        return int(sum(r.get_sample_value(name, labels) or 0 for r in self.registries))

    def fallbacks(self) -> str:
        by_reason: dict[str, int] = defaultdict(int)
        for registry in self.registries:
            for family in registry.collect():
                if family.name == "gpu_node_agent_preference_fallbacks":
                    for sample in family.samples:
                        if sample.name.endswith("_total"):
                            by_reason[sample.labels["reason"]] += int(sample.value)
        return ",".join(f"{reason}={n}" for reason, n in sorted(by_reason.items()) if n) or "-"


async def run(profile: str, topology: Topology, scenario: str, args: argparse.Namespace) -> dict:
    joint, facts = scenario.startswith("joint"), scenario.endswith(("facts", "no-api", "lagging", "restarts"))
    api = not scenario.endswith(("no-api", "restarts"))
    directory = Path(tempfile.mkdtemp(prefix="gnabp"))
    now = [0.0]
    kubelet = LocalKubelet(directory / "dp", rng=random.Random(args.seed),
                           pod_resources_socket=directory / "pr" / "kubelet.sock")
    assert kubelet.pod_resources is not None
    kubelet.pod_resources.bucket = TokenBucket(100, 10, monotonic=lambda: now[0])
    specs: dict[tuple[str, str], PodView] = {}
    agent = Agent(kubelet, topology, directory, joint=joint, facts=facts, specs=specs if api else None, now=now)
    agent.poll_first = scenario == "joint early restarts"
    nvidia = None
    await kubelet.start()
    if not joint:
        nvidia = StandInPlugin(directory / "dp", GPU, sorted(g.uuid for g in topology.gpus if g.uuid),
                               rng=random.Random(args.seed + 1))
        await nvidia.start()
    try:
        await agent.start()
        pix = await churn(kubelet, specs, topology, joint=joint, steps=args.steps, containers=args.containers,
                          seed=args.seed, now=now, lagging=scenario.endswith("lagging"),
                          restart=agent.restart if scenario.endswith("restarts") else None)
    finally:
        await agent.stop()
        if nvidia is not None:
            await nvidia.stop()
        await kubelet.stop()
        shutil.rmtree(directory, ignore_errors=True)
    every = pix["gpu-first"] + pix["nic-first"]
    return {"profile": profile, "scenario": scenario, "n": len(every),
            "pix": sum(every) / max(1, len(every)),
            "gpu-first": f"{sum(pix['gpu-first'])}/{len(pix['gpu-first'])}",
            "nic-first": f"{sum(pix['nic-first'])}/{len(pix['nic-first'])}",
            "misses": sum(pix["miss"]),
            "lookups": agent.lookups, "rpc": agent.preference_rpc,
            "exact": agent.total("gpu_node_agent_pod_resources_lookups_total", result="exact"),
            "failed": agent.total("gpu_node_agent_pod_resources_lookups_total", result="failed"),
            "fallbacks": agent.fallbacks()}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400, help="admissions and pod ends")
    parser.add_argument("--containers", type=int, default=None,
                        help="run until this many 1 GPU + 1 NIC containers were admitted instead of --steps")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--load", type=int, default=0)
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    start_load = os.getloadavg()[0]
    stop = multiprocessing.Event()
    spinners = [multiprocessing.Process(target=spin, args=(stop,), daemon=True) for _ in range(args.load)]
    for process in spinners:
        process.start()
    try:
        await report(args)
    finally:
        stop.set()
        for process in spinners:
            process.join()
    print(f"{args.load} busy processes beside it; 1-min load average at the start {start_load:.1f}, at the end "
          f"{os.getloadavg()[0]:.1f}")


async def report(args: argparse.Namespace) -> None:
    print(f"{'profile':<11} {'scenario':<20} {'containers':>10} {'PIX':>6} {'GPU-first':>10} {'NIC-first':>10}"
          f" {'misses':>6} {'lookups exact/failed':>21}  fallbacks")
    rpc: dict[str, list[float]] = {}
    lookups: list[float] = []
    for profile in PROFILES:
        topology = simulated_topology(profile, Path(tempfile.mkdtemp(prefix="gnabt")))
        for scenario in args.scenarios:
            r = await run(profile, topology, scenario, args)
            print(f"{profile:<11} {scenario:<20} {r['n']:>10} {r['pix']:>6.1%} {r['gpu-first']:>10} "
                  f"{r['nic-first']:>10} {r['misses']:>6} {r['exact']:>12}/{r['failed']:<8}  {r['fallbacks']}",
                  flush=True)
            if scenario.startswith("joint"):
                rpc.setdefault(scenario, []).extend(r["rpc"])
                lookups.extend(r["lookups"])
    print()
    if lookups:
        print(f"partner lookup inside the preference call (joint): p50 {percentile(lookups, 0.5) * 1e3:.2f} ms, "
              f"p99 {percentile(lookups, 0.99) * 1e3:.2f} ms ({len(lookups)} calls)")
    for scenario, values in rpc.items():
        print(f"NIC GetPreferredAllocation at the kubelet's stub, {scenario}: p50 {percentile(values, 0.5) * 1e3:.2f}"
              f" ms, p99 {percentile(values, 0.99) * 1e3:.2f} ms ({len(values)} calls)")


if __name__ == "__main__":
    asyncio.run(main())
