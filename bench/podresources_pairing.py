"""PIX fraction of 1 GPU + 1 NIC containers with and without the kubelet's PodResources facts, and the cost of
the lookup inside GetPreferredAllocation.

For each profile (pcie-pairs, dgx-h100) the stand-in kubelet (serving PodResources v1 over a unix socket) admits
pods through the agent's real `DevicePluginManager` over gRPC, resource by resource in a random order, with
churn (pods end at random, at most 6 live). Scenarios:

- `nic-only spread`: GPUs served by a stand-in for NVIDIA's plugin (UUID IDs, its own random picks), the agent
  serves only VFs and knows nothing of the container's GPUs (the policy before PodResources: spread over PFs).
- `nic-only facts`: the same, with the PodResources lookup (`--no-serve-gpus` as shipped).
- `nic-only no-api`: the same without pod specs (no API access): the kubelet's records alone.
- `joint guess`: the agent serves both (`--serve-gpus`), 20 % single-resource pods interleaved, the admission
  context's time-window guess only.
- `joint facts`: the same with the PodResources lookup.

PIX fraction = containers whose GPU and VF share a PCIe switch / all GPU+NIC containers, overall and split by
which resource the kubelet allocated first. The rate limits (client 50/s, kubelet 100/s) run on a clock that
advances 0.1 s per admission, so the policy is measured, not the bench's speed. Latency: the partner lookup
(one `List` over the socket + matching against pod specs) timed inside the preference calls of `joint facts`,
and the whole GetPreferredAllocation as the kubelet's stub sees it, with and without the lookup.

    python bench/podresources_pairing.py [--steps N] [--seed S] [--load N]

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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.fakes: the stand-in NVIDIA plugin

from prometheus_client import CollectorRegistry

from agent.deviceplugin.facts import OwnershipFacts
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
SCENARIOS = ("nic-only spread", "nic-only facts", "nic-only no-api", "joint guess", "joint facts")


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


async def churn(kubelet: LocalKubelet, specs: dict[tuple[str, str], PodView], topology: Topology, *, joint: bool,
                steps: int, seed: int, now: list[float]) -> dict[str, list[bool]]:
    """Admit and end pods; per first resource, whether each GPU+NIC container got a PIX pair."""
    rng = random.Random(seed)
    live: list[tuple[str, str]] = []
    pix: dict[str, list[bool]] = defaultdict(list)
    for step in range(steps):
        now[0] += 0.1
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
        specs[key] = PodView.from_dict({"metadata": {"namespace": key[0], "name": key[1]},
                                        "spec": {"containers": [container_spec("main", requests)]}})
        try:
            got = await kubelet.admit(requests, order=order, pod=key)
        except AdmissionError:
            continue
        live.append(key)
        if len(requests) == 2:
            first = "gpu-first" if order[0] == GPU else "nic-first"
            pix[first].append(achieved_levels(topology, got[GPU], got[NIC]) == [Level.PIX])
    return pix


async def run(profile: str, topology: Topology, scenario: str, steps: int, seed: int) -> dict:
    joint, facts = scenario.startswith("joint"), scenario.endswith(("facts", "no-api"))
    api = not scenario.endswith("no-api")
    directory = Path(tempfile.mkdtemp(prefix="gnabp"))
    now = [0.0]
    kubelet = LocalKubelet(directory / "dp", rng=random.Random(seed),
                           pod_resources_socket=directory / "pr" / "kubelet.sock")
    assert kubelet.pod_resources is not None
    kubelet.pod_resources.bucket = TokenBucket(100, 10, monotonic=lambda: now[0])
    specs: dict[tuple[str, str], PodView] = {}
    registry = CollectorRegistry()
    client = KubeletPodResources(kubelet.pod_resources.socket_path, bucket=TokenBucket(monotonic=lambda: now[0]))
    service = OwnershipService(client, pod_specs=(lambda: specs) if api else None, registry=registry)
    manager = DevicePluginManager(dp_config(str(directory / "dp"), serve_gpus=joint), topology, registry=registry,
                                  **FAST, plugin_registry_dir=str(directory / "reg"), cdi_spec_dir=str(directory / "c"))
    lookups: list[float] = []
    preference_rpc: list[float] = []
    if facts:
        ownership = OwnershipFacts(service, manager.pools, GPU)
        plain = ownership.partner

        async def timed(pool):  # the lookup as the servicer awaits it
            started = time.perf_counter()
            try:
                return await plain(pool)
            finally:
                lookups.append(time.perf_counter() - started)

        ownership.partner = timed  # type: ignore[method-assign]
        manager.use_ownership(ownership)
    nvidia = None
    await kubelet.start()
    if not joint:
        nvidia = StandInPlugin(directory / "dp", GPU, sorted(g.uuid for g in topology.gpus if g.uuid),
                               rng=random.Random(seed + 1))
        await nvidia.start()
    await manager.start()
    await kubelet.wait_for(lambda: all(r in kubelet.plugins and kubelet.plugins[r].lists for r in (GPU, NIC)), 30)
    await service.refresh()
    kubelet.plugins[NIC].stub = TimedStub(kubelet.plugins[NIC].stub, preference_rpc)  # type: ignore[assignment]
    try:
        pix = await churn(kubelet, specs, topology, joint=joint, steps=steps, seed=seed, now=now)
    finally:
        await manager.stop()
        await client.aclose()
        if nvidia is not None:
            await nvidia.stop()
        await kubelet.stop()
        shutil.rmtree(directory, ignore_errors=True)
    every = pix["gpu-first"] + pix["nic-first"]
    return {"profile": profile, "scenario": scenario, "n": len(every),
            "pix": sum(every) / max(1, len(every)),
            "gpu-first": sum(pix["gpu-first"]) / max(1, len(pix["gpu-first"])),
            "nic-first": sum(pix["nic-first"]) / max(1, len(pix["nic-first"])),
            "lookups": lookups, "rpc": preference_rpc,
            "exact": registry.get_sample_value("gpu_node_agent_pod_resources_lookups_total", {"result": "exact"}),
            "failed": registry.get_sample_value("gpu_node_agent_pod_resources_lookups_total", {"result": "failed"}),
            "fallbacks": ",".join(f"{s.labels['reason']}={int(s.value)}" for m in registry.collect()
                                  if m.name == "gpu_node_agent_preference_fallbacks" for s in m.samples
                                  if s.name.endswith("_total") and s.value) or "-"}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--load", type=int, default=0)
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
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
    print(f"{args.load} busy processes beside it; 1-min load average at the end {os.getloadavg()[0]:.1f}")


async def report(args: argparse.Namespace) -> None:
    print(f"{'profile':<11} {'scenario':<16} {'containers':>10} {'PIX':>6} {'GPU-first':>10} {'NIC-first':>10}"
          f" {'lookups exact/failed':>21} {'fallbacks':>9}")
    rpc: dict[str, list[float]] = {}
    lookups: list[float] = []
    for profile in PROFILES:
        topology = simulated_topology(profile, Path(tempfile.mkdtemp(prefix="gnabt")))
        for scenario in args.scenarios:
            r = await run(profile, topology, scenario, args.steps, args.seed)
            print(f"{profile:<11} {scenario:<16} {r['n']:>10} {r['pix']:>6.1%} {r['gpu-first']:>10.1%} "
                  f"{r['nic-first']:>10.1%} {int(r['exact'] or 0):>12}/{int(r['failed'] or 0):<8} {r['fallbacks']:>9}")
            if scenario.startswith("joint"):
                rpc.setdefault(scenario, []).extend(r["rpc"])
                lookups.extend(r["lookups"])
    print()
    print(f"partner lookup inside the preference call: p50 {percentile(lookups, 0.5) * 1e3:.2f} ms, "
          f"p99 {percentile(lookups, 0.99) * 1e3:.2f} ms ({len(lookups)} calls)")
    for scenario, values in rpc.items():
        print(f"NIC GetPreferredAllocation at the kubelet's stub, {scenario}: p50 {percentile(values, 0.5) * 1e3:.2f}"
              f" ms, p99 {percentile(values, 0.99) * 1e3:.2f} ms ({len(values)} calls)")


if __name__ == "__main__":
    asyncio.run(main())
