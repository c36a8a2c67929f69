"""Latency of the admission lookup (`OwnershipService.lookup`: one `List` over the unix socket + finding the
container) on a node with many pods, quiet and beside CPU-bound processes, to size
`podResources.lookupTimeoutSeconds`.

The stand-in kubelet's PodResources server lists `--pods` pods (8 GPU+VF pods, the rest with no devices, as
on a busy node where most pods hold none) plus the container under admission holding one GPU; each lookup
is timed from the call to the answer. `--load N` runs N busy-looping processes beside it (the 2-core
development VM: 2 is "both cores taken"). Rate limits are off, so the figure is the lookup's own cost.

    python bench/podresources_lookup.py [--lookups 2000] [--pods 110] [--load 0 2]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's agent, not an installed one

from agent.host.podresources.client import KubeletPodResources
from agent.host.podresources.ratelimit import TokenBucket
from agent.host.podresources.simulated import DeviceRecords
from agent.ownership.service import OwnershipService
from agent.simulate.podresources import PodResourcesServer

GPU, NIC = "nvidia.com/gpu", "gpunodeagent.io/sriov_rdma"


def spin(stop: multiprocessing.synchronize.Event) -> None:  # type: ignore[name-defined]
    while not stop.is_set():
        sum(range(10_000))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(lookups: int, pods: int) -> list[float]:
    directory = Path(tempfile.mkdtemp(prefix="gnabl"))
    records = DeviceRecords()
    for i in range(pods):
        records.add_pod("bench", f"p{i}", ["main", "side"])
        if i < 8:
            records.record("bench", f"p{i}", "main", GPU, [f"GPU-{i}"])
            records.record("bench", f"p{i}", "main", NIC, [f"0000:18:00.{i}"])
    server = PodResourcesServer(records, directory / "kubelet.sock")
    server.bucket = TokenBucket(100, 10)
    server.bucket.take = lambda: True  # type: ignore[method-assign]  # the lookup's cost, not the rate limit
    await server.start()
    client = KubeletPodResources(server.socket_path)
    client.bucket.take = lambda: True  # type: ignore[method-assign]
    service = OwnershipService(client, lookup_timeout=5.0)
    times: list[float] = []
    try:
        await service.lookup(NIC, [GPU])  # the first reading after a start is the baseline: nothing in it is new
        records.add_pod("bench", "admitting", ["main"])
        records.record("bench", "admitting", "main", GPU, ["GPU-new"])
        for i in range(lookups + 50):
            started = time.perf_counter()
            found = await service.lookup(NIC, [GPU])
            if i >= 50:  # warm-up: channel, caches
                times.append(time.perf_counter() - started)
            if i == 0:
                assert found.found is not None and found.found.pod == "admitting", found
    finally:
        await client.aclose()
        await server.stop()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lookups", type=int, default=2000)
    parser.add_argument("--pods", type=int, default=110)
    parser.add_argument("--load", type=int, nargs="+", default=[0, 2])
    args = parser.parse_args()
    for load in args.load:
        stop = multiprocessing.Event()
        spinners = [multiprocessing.Process(target=spin, args=(stop,)) for _ in range(load)]
        for process in spinners:
            process.start()
        try:
            times = asyncio.run(measure(args.lookups, args.pods))
        finally:
            stop.set()
            for process in spinners:
                process.join()
        print(f"load {load} ({os.getloadavg()[0]:.1f} 1-min load avg after): {args.pods} pods, {len(times)} lookups: "
              f"p50 {percentile(times, 0.5) * 1e3:.2f} ms, p99 {percentile(times, 0.99) * 1e3:.2f} ms, "
              f"p99.9 {percentile(times, 0.999) * 1e3:.2f} ms, max {max(times) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
