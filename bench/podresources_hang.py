"""A PodResources socket that accepts and never answers (issue 37 item 4): how long each GetPreferredAllocation
takes at the kubelet's stub while it hangs, and how soon pairing is exact again once the kubelet answers.

The stand-in kubelet admits 1 GPU + 1 NIC containers through the agent's real `DevicePluginManager` (joint mode,
ownership facts, the ownership poll running as in the agent) over gRPC; the agent's PodResources client points at
a unix socket whose peer accepts and never writes a byte. After `--seconds`, the stand-in's PodResources server
comes back at that path. Used by `bench/hostile_tries.py` (one row) and on its own:

    python bench/podresources_hang.py [--seconds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.deviceplugin: the manager's test config

from prometheus_client import CollectorRegistry

from agent.deviceplugin.manager import DevicePluginManager
from agent.host.podresources.client import KubeletPodResources
from agent.ownership.service import OwnershipService
from agent.simulate.kubelet import LocalKubelet
from agent.simulate.node import simulated_topology
from tests.deviceplugin.conftest import FAST, dp_config
from tests.ownership.rig import TimedStub

GPU, NIC = "nvidia.com/gpu", "gpunodeagent.io/sriov_rdma"


@dataclass
class HangResult:
    first_s: float  # the first preference call (the documented first-reading wait)
    after: list[float]  # every call that began after that wait
    recovered_s: float | None  # from the kubelet's return to the first exact lookup; None: never in 10 s


async def _admit_while_hung(kubelet: LocalKubelet, calls: list[tuple[float, float]], seconds: float,
                            first_wait: float) -> tuple[float, list[float]]:
    """Admit containers for `seconds`: the first call's time, and every call's that began after `first_wait`."""
    started = time.monotonic()
    live: list[tuple[str, str]] = []
    step = 0
    while time.monotonic() - started < seconds:
        step += 1
        key = ("bench", f"h{step}")
        await kubelet.admit({GPU: 1, NIC: 1}, order=[GPU, NIC] if step % 2 else [NIC, GPU], pod=key)
        live.append(key)
        if len(live) >= 3:
            kubelet.end_pod(*live.pop(0))
    for pod in live:
        kubelet.end_pod(*pod)
    return calls[0][1], [took for at, took in calls if at >= started + first_wait + 0.1]


async def _until_exact(kubelet: LocalKubelet, registry: CollectorRegistry) -> float | None:
    """Seconds until a lookup is exact again (GPU-first containers, one after another); None: not within 10 s."""
    back = time.monotonic()
    step = 0
    while time.monotonic() - back < 10:
        step += 1
        key = ("bench", f"b{step}")
        await kubelet.admit({GPU: 1, NIC: 1}, order=[GPU, NIC], pod=key)
        kubelet.end_pod(*key)
        if registry.get_sample_value("gpu_node_agent_pod_resources_lookups_total", {"result": "exact"}):
            return time.monotonic() - back
        await asyncio.sleep(0.05)
    return None


async def measure(seconds: float = 5.0) -> HangResult:
    directory = Path(tempfile.mkdtemp(prefix="gnahang"))
    topology = simulated_topology("dgx-h100", directory / "topo")
    kubelet = LocalKubelet(directory / "dp", rng=random.Random(7), pod_resources_socket=directory / "pr" / "k.sock")
    server = kubelet.pod_resources
    assert server is not None
    await kubelet.start()
    await server.stop()
    held: list[asyncio.StreamWriter] = []

    async def silent(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # accepted, never answered

    hang = await asyncio.start_unix_server(silent, path=str(server.socket_path))
    registry = CollectorRegistry()
    client = KubeletPodResources(str(server.socket_path))
    service = OwnershipService(client, registry=registry)  # lookup and poll bounds as shipped
    manager = DevicePluginManager(dp_config(str(directory / "dp"), serve_gpus=True), topology, registry=registry,
                                  **FAST, plugin_registry_dir=str(directory / "reg"), cdi_spec_dir=str(directory / "c"),
                                  ownership=service)
    stop = asyncio.Event()
    poll = asyncio.create_task(service.run(stop))
    calls: list[tuple[float, float]] = []
    try:
        await manager.start()
        await kubelet.wait_for(lambda: all(r in kubelet.plugins and kubelet.plugins[r].lists for r in (GPU, NIC)), 30)
        for resource in (GPU, NIC):
            kubelet.plugins[resource].stub = TimedStub(kubelet.plugins[resource].stub, calls)  # type: ignore
        first, after = await _admit_while_hung(kubelet, calls, seconds, service.poll_timeout)
        for writer in held:
            writer.close()
        hang.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(server.socket_path)
        await server.start()
        recovered = await _until_exact(kubelet, registry)
        return HangResult(first, after, recovered)
    finally:
        stop.set()
        await manager.stop()
        await poll
        await kubelet.stop()
        shutil.rmtree(directory, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="how long the socket hangs")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    result = asyncio.run(measure(args.seconds))
    after = sorted(result.after)
    print(f"first preference call {result.first_s:.3f} s; {len(after)} calls after the first-reading wait: "
          f"p50 {after[len(after) // 2] * 1e3:.1f} ms, max {after[-1] * 1e3:.1f} ms; exact again "
          f"{'never' if result.recovered_s is None else f'{result.recovered_s:.2f} s'} after the kubelet came back")


if __name__ == "__main__":
    main()
