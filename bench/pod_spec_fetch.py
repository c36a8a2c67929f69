"""What fetching two pod specs adds to an ambiguous admission lookup, against the 50 ms default deadline.

Each round, a GPU-only pod and a GPU-first pod appear in the same PodResources `List` (the stand-in kubelet's
server over its unix socket, `--pods` other pods listed) with no pod watch, so the lookup
(`OwnershipService.lookup`) fetches both specs through the real lightkube port from the HTTP API double on
127.0.0.1 (one namespaced LIST each, in parallel) and decides with them. The same run times a lookup with one
new holder (no fetch) as the baseline. The API double is Python on the same 2 cores: a real API server is
another machine, so read the figure as the agent's own cost plus a local round trip.

    python bench/pod_spec_fetch.py [--rounds 500] [--pods 110]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's agent, not an installed one

from allocation_latency import percentile  # run as a script, bench/ is on sys.path
from prometheus_client import CollectorRegistry

from agent.host.podresources.client import KubeletPodResources
from agent.host.podresources.simulated import DeviceRecords
from agent.kube.cluster import connect
from agent.kube.metrics import ApiRequestCounter
from agent.ownership.service import OwnershipService
from agent.ownership.spec_fetch import PodSpecFetcher
from agent.simulate.podresources import PodResourcesServer
from tests.fakes.apiserver import ApiServerDouble, container_spec, write_kubeconfig
from tests.fakes.clock import FakeClock

GPU, NIC = "nvidia.com/gpu", "gpunodeagent.io/sriov_rdma"
NODE = "gpu-node-1"


def summary(name: str, times: list[float]) -> str:
    return (f"{name}: p50 {percentile(times, 0.5) * 1e3:.2f} ms, p99 {percentile(times, 0.99) * 1e3:.2f} ms, "
            f"max {max(times) * 1e3:.2f} ms")


async def measure(rounds: int, pods: int) -> tuple[list[float], list[float]]:
    directory = Path(tempfile.mkdtemp(prefix="gnafetch"))
    records = DeviceRecords()
    api = ApiServerDouble(FakeClock(), NODE)
    await api.start()
    for i in range(pods):
        records.add_pod("bench", f"p{i}", ["main"])
        api.add_pod("bench", f"p{i}", containers=[container_spec("main")])
    server = PodResourcesServer(records, directory / "kubelet.sock")
    server.bucket.take = lambda: True  # type: ignore[method-assign]  # the lookup's cost, not the rate limit
    await server.start()
    client = KubeletPodResources(server.socket_path)
    client.bucket.take = lambda: True  # type: ignore[method-assign]
    registry = CollectorRegistry()
    cluster = connect(NODE, ApiRequestCounter(registry), str(write_kubeconfig(directory / "kc", api.url)), 5.0)
    service = OwnershipService(client, lookup_timeout=5.0, registry=registry,
                               spec_fetcher=PodSpecFetcher(cluster, registry))
    fetched: list[float] = []
    alone: list[float] = []
    try:
        await service.lookup(NIC, [GPU])  # the baseline reading
        for i in range(rounds + 20):
            for name, wanted in ((f"solo-{i}", {GPU: 1}), (f"pair-{i}", {GPU: 1, NIC: 1})):
                records.add_pod("ml", name, ["main"])
                records.record("ml", name, "main", GPU, [f"GPU-{name}"])
                api.add_pod("ml", name, containers=[container_spec("main", wanted)])
            started = time.perf_counter()
            found = await service.lookup(NIC, [GPU])
            took = time.perf_counter() - started
            assert found.found is not None and found.found.pod == f"pair-{i}", found
            records.record("ml", f"pair-{i}", "main", NIC, [f"0000:18:00.{i % 8}"])  # its NIC, as the kubelet goes on
            records.add_pod("ml", f"one-{i}", ["main"])  # one new holder: the kubelet's records decide alone
            records.record("ml", f"one-{i}", "main", GPU, [f"GPU-one-{i}"])
            started = time.perf_counter()
            found = await service.lookup(NIC, [GPU])
            took_alone = time.perf_counter() - started
            assert found.found is not None and found.found.pod == f"one-{i}", found
            for name in (f"solo-{i}", f"pair-{i}", f"one-{i}"):
                records.remove_pod("ml", name)
            for name in (f"solo-{i}", f"pair-{i}"):
                api.delete_pod("ml", name)  # the double keeps `--pods` pods, as the node does
            if i >= 20:  # warm-up: channels, connections
                fetched.append(took)
                alone.append(took_alone)
        lists = registry.get_sample_value("gpu_node_agent_apiserver_requests_total", {"verb": "list", "code": "200"})
        assert lists == 2 * (rounds + 20), lists
    finally:
        await client.aclose()
        await cluster.aclose()
        await server.stop()
        await api.stop()
    return alone, fetched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=500)
    parser.add_argument("--pods", type=int, default=110)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    print(f"1-min load average before: {os.getloadavg()[0]:.2f}")
    alone, fetched = asyncio.run(measure(args.rounds, args.pods))
    print(f"{args.pods} pods listed, {args.rounds} rounds")
    print(summary("lookup, one new holder (no fetch)", alone))
    print(summary("lookup, two new holders, 2 specs fetched in parallel", fetched))
    print(f"1-min load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
