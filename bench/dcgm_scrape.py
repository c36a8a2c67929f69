"""Bench: what one dcgm-exporter scrape costs the agent - HTTP GET, parse, interpret, apply - and its size.

Goal: <= 10 ms of agent time per scrape for an 8-GPU node with every health field enabled (the agent scrapes
every 15 s by default, so that is well under 0.1 % of a core), and still small with MIG (7 instances per GPU,
so each device-level field appears 56 times). A simulated exporter serves real exporter text over loopback HTTP;
each round also changes some counters so the interpreter has work to do.

    python bench/dcgm_scrape.py [--rounds 200]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.config.health import HealthConfig
from agent.health.assess import HealthAssessor
from agent.health.dcgm_scrape import parse_scrape
from agent.health.dcgm_watch import dcgm_watcher
from agent.host.dcgm_exporter import HttpDcgmExporter
from agent.signals import DeviceHealth
from agent.simulate.dcgm_exporter import DcgmExporterServer, ExporterGpu, SimulatedDcgmExporter
from agent.simulate.node import simulated_topology
from agent.topology.model import Topology


def _exporter(topology: Topology, mig: bool) -> SimulatedDcgmExporter:
    instances = tuple(("1g.10gb", i) for i in range(1, 8)) if mig else ()
    gpus = [ExporterGpu(g.index, g.uuid or "", g.bus_id, mig=instances) for g in topology.gpus]
    return SimulatedDcgmExporter(gpus, xid_metrics=("gauge", "count", "total"), extra_fields=True)


async def _measure(topology: Topology, mig: bool, rounds: int) -> None:
    exporter = _exporter(topology, mig)
    with DcgmExporterServer(exporter) as server:
        config = HealthConfig(kmsg="", dcgm_exporter_url=server.url, dcgm_nvlink_errors_per_minute=1e9,
                              dcgm_pcie_replays_per_minute=1e9)
        assessor = HealthAssessor(config, topology, DeviceHealth(), time.monotonic)
        port = HttpDcgmExporter(server.url, 5.0)  # the GET and parse rows: the whole page, unfiltered
        watcher = dcgm_watcher(config, assessor, topology)  # the scrape row: as the agent builds it
        text = await port.fetch()
        await watcher.scrape_once()
        fetch, parse, whole = [], [], []
        for i in range(rounds):
            uuid = exporter.gpus[i % 8].uuid
            exporter.add_to_field(uuid, "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", 1)
            exporter.add_to_field(uuid, "DCGM_FI_DEV_PCIE_REPLAY_COUNTER", 1)
            start = time.perf_counter()
            text = await port.fetch()
            fetch.append(time.perf_counter() - start)
            start = time.perf_counter()
            parse_scrape(text)
            parse.append(time.perf_counter() - start)
            start = time.perf_counter()
            assert await watcher.scrape_once()
            whole.append(time.perf_counter() - start)
        await port.aclose()
        await watcher.port.aclose()
    lines = sum(1 for line in text.splitlines() if line and not line.startswith("#"))
    label = "8 GPUs x 7 MIG instances" if mig else "8 GPUs"
    print(f"{label}: {len(text) / 1024:.0f} KiB, {lines} samples")
    for name, samples in (("GET", fetch), ("parse", parse), ("scrape (GET+parse+interpret+apply)", whole)):
        ms = sorted(s * 1e3 for s in samples)
        print(f"  {name:36s} p50 {statistics.median(ms):6.2f} ms  p99 {ms[int(len(ms) * 0.99) - 1]:6.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gna-bench-") as tmp:
        topology = simulated_topology("dgx-h100", Path(tmp))
    for mig in (False, True):
        asyncio.run(_measure(topology, mig, args.rounds))


if __name__ == "__main__":
    main()
