"""GetPreferredAllocation latency through gRPC over a unix socket, next to the same requests in-process.

For each profile (dgx-h100, pcie-pairs: the simulated sysfs tree written to a temporary directory and read
back, as `run --simulate` does) this starts the agent's `DevicePluginManager` serving GPUs and RDMA VFs and the
stand-in kubelet, then admits random containers with the kubelet's call sequence (GetPreferredAllocation,
keep, fill, Allocate, per resource in random order): random GPU counts (1, 2, 4, 8), NIC counts mostly equal,
some NIC-only containers, pods ending at random to keep the node partly used. Each GetPreferredAllocation is
timed at the kubelet's stub: protobuf, the unix socket, the grpc.aio servicer, the admission context and the
policy. The policy requests the servicer built are captured and replayed in-process (`preferred_allocation`
alone) for the left-hand columns. Client and server share one event loop and thread, as in the tests.

    python bench/allocation_grpc.py [--containers N] [--seed S] [--profile NAME ...]

`--profile` picks other simulated nodes (e.g. gb300-cx8, gb200-cx7, hgx-b300-cx8); a container never asks for
more GPUs or VFs than the node has.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from allocation_latency import percentile  # run as a script, bench/ is on sys.path
from prometheus_client import CollectorRegistry

import agent.placement.joint as preference_module
from agent.config.model import DevicePluginConfig
from agent.deviceplugin.manager import DevicePluginManager
from agent.deviceplugin.v1beta1 import api_pb2
from agent.placement.policy import AllocationRequest, preferred_allocation
from agent.simulate.kubelet import LocalKubelet
from agent.simulate.node import simulated_topology

PROFILES = ("dgx-h100", "pcie-pairs")
GPU = "nvidia.com/gpu"
RDMA = "gpunodeagent.io/sriov_rdma"
WARM_UP = 50  # containers not timed: first calls build the PCIe tree and warm gRPC


@dataclass
class Timings:
    """Per resource: gRPC round trips (us) and the policy requests the servicer built."""

    grpc_us: dict[str, list[float]] = field(default_factory=dict)
    requests: dict[str, list[AllocationRequest]] = field(default_factory=dict)
    recording: bool = False
    levels: dict[str, float] = field(default_factory=dict)  # GPU allocations by level, warm-up included


class TimedStub:
    """The kubelet's stub for one resource, timing GetPreferredAllocation."""

    def __init__(self, stub: object, resource: str, timings: Timings) -> None:
        self._stub = stub
        self._resource = resource
        self._timings = timings

    async def GetPreferredAllocation(self, request: api_pb2.PreferredAllocationRequest,
                                     **kwargs: object) -> api_pb2.PreferredAllocationResponse:
        start = time.perf_counter_ns()
        reply = await self._stub.GetPreferredAllocation(request, **kwargs)
        elapsed = (time.perf_counter_ns() - start) / 1000
        if self._timings.recording:
            self._timings.grpc_us.setdefault(self._resource, []).append(elapsed)
        return reply

    def __getattr__(self, name: str) -> object:
        return getattr(self._stub, name)


def capture(timings: Timings, resource_of: dict[str, str]) -> None:
    """Record every request the servicer hands the policy (by kind -> resource name)."""
    def recorded(request: AllocationRequest) -> list[str]:
        if timings.recording:
            timings.requests.setdefault(resource_of[request.kind.value], []).append(request)
        return preferred_allocation(request)

    preference_module.preferred_allocation = recorded


def random_container(rng: random.Random, single_share: float, sizes: dict[str, int] | None = None) -> dict[str, int]:
    gpus = rng.choice([1, 1, 1, 2, 2, 4, 8])
    if rng.random() < single_share:  # one resource only: NIC-only or GPU-only
        request = {RDMA: rng.randint(1, 4)} if rng.random() < 0.5 else {GPU: gpus}
    else:
        request = {GPU: gpus, RDMA: gpus if rng.random() < 0.8 else rng.randint(1, 2 * gpus)}
    return {name: min(count, (sizes or {}).get(name, count)) for name, count in request.items()}


async def drive(profile: str, containers: int, seed: int, single_share: float) -> Timings:
    """Admit `containers` random containers on `profile`; returns the timings after the warm-up."""
    directory = tempfile.mkdtemp(prefix="gna")
    timings = Timings()
    try:
        topology = simulated_topology(profile, Path(directory) / "sys")
        kubelet = LocalKubelet(directory, rng=random.Random(seed))
        await kubelet.start()
        registry = CollectorRegistry()
        manager = DevicePluginManager(DevicePluginConfig(device_plugin_dir=directory, serve_gpus=True,
                                                         device_info_dir=""), topology,
                                      registry=registry, poll_interval=0.05, backoff_initial=0.05)
        await manager.start()
        try:
            sizes = {name: len(manager.plugin(name).pool.ids) for name in (GPU, RDMA)}
            await kubelet.wait_for(lambda: all(
                name in kubelet.plugins and len(kubelet.plugins[name].healthy()) == size
                for name, size in sizes.items()), 10)
            for name in sizes:
                view = kubelet.plugins[name]
                view.stub = TimedStub(view.stub, name, timings)  # type: ignore[assignment]
            capture(timings, {"gpu": GPU, "nic": RDMA})
            rng = random.Random(seed)
            running: list[dict[str, list[str]]] = []
            for index in range(containers + WARM_UP):
                timings.recording = index >= WARM_UP
                request = random_container(rng, single_share, sizes)
                while any(len(kubelet.plugins[n].healthy() - kubelet.allocated.get(n, set())) < size
                          for n, size in request.items()) or (running and rng.random() < 0.3):
                    kubelet.release(running.pop(rng.randrange(len(running))))
                running.append(await kubelet.admit(request))
            timings.levels = {sample.labels["level"]: sample.value for metric in registry.collect()
                              for sample in metric.samples if sample.name == "gpu_node_agent_allocations_total"
                              and sample.labels["resource"] == GPU and sample.value}
        finally:
            preference_module.preferred_allocation = preferred_allocation
            await manager.stop()
            await kubelet.stop()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return timings


def in_process_us(requests: list[AllocationRequest]) -> list[float]:
    """The policy alone on the captured requests, one timed call each (as bench/allocation_latency.py)."""
    for request in requests[:50]:
        preferred_allocation(request)
    timings = []
    for request in requests:
        start = time.perf_counter_ns()
        preferred_allocation(request)
        timings.append((time.perf_counter_ns() - start) / 1000)
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--containers", type=int, default=1500, help="timed containers per profile")
    parser.add_argument("--seed", type=int, default=4)
    parser.add_argument("--profile", action="append", dest="profiles", metavar="NAME",
                        help=f"simulated node (repeatable; default: {', '.join(PROFILES)})")
    parser.add_argument("--single-share", type=float, default=0.1,
                        help="share of containers asking for one resource only (GPU-only or NIC-only)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    header = (f"{'node':<11} {'resource':<9} {'calls':>6} | {'in-process p50':>14} {'p99 us':>7} | "
              f"{'gRPC p50 us':>11} {'p99 us':>7} {'max us':>7}")
    print(header)
    print("-" * len(header))
    for profile in args.profiles or PROFILES:
        timings = asyncio.run(drive(profile, args.containers, args.seed, args.single_share))
        everything_local: list[float] = []
        everything_grpc: list[float] = []
        for resource, label in ((GPU, "gpu"), (RDMA, "nic")):
            local = in_process_us(timings.requests.get(resource, []))
            remote = timings.grpc_us.get(resource, [])
            everything_local += local
            everything_grpc += remote
            print(f"{profile:<11} {label:<9} {len(remote):>6} | {percentile(local, 0.5):>14.0f} "
                  f"{percentile(local, 0.99):>7.0f} | {percentile(remote, 0.5):>11.0f} "
                  f"{percentile(remote, 0.99):>7.0f} {max(remote):>7.0f}")
        print(f"{profile:<11} {'all':<9} {len(everything_grpc):>6} | {percentile(everything_local, 0.5):>14.0f} "
              f"{percentile(everything_local, 0.99):>7.0f} | {percentile(everything_grpc, 0.5):>11.0f} "
              f"{percentile(everything_grpc, 0.99):>7.0f} {max(everything_grpc):>7.0f}")
        total = sum(timings.levels.values())
        shares = ", ".join(f"{level} {count / total:.1%}" for level, count in timings.levels.items())
        print(f"{'':<11} GPU allocations by container level (gpu_node_agent_allocations_total): {shares}")


if __name__ == "__main__":
    main()
