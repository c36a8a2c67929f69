"""Bench: peak memory of one dcgm-exporter scrape of a hostile 15 MB page (issue 27, item 8).

A 15 MB page of valid samples for this node's GPUs (Xid totals with ever new codes), the same just under the
port's 2 MiB cap on kept lines (the largest page that is parsed), or 15 MB of 60,000 foreign GPUs, served by a
child process over loopback HTTP to the port and watcher the agent builds (`agent.health.dcgm_watch.dcgm_watcher`).
Each case runs in a fresh process; it prints the Python heap peak (tracemalloc) over two scrapes and the RSS
growth (ru_maxrss), against the same two scrapes of a real 8-GPU page.

    python bench/dcgm_memory.py
"""

from __future__ import annotations

import asyncio
import resource
import subprocess
import sys
import tempfile
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import contextlib

from agent.config.health import HealthConfig
from agent.health.assess import HealthAssessor
from agent.health.dcgm_watch import dcgm_watcher
from agent.signals import DeviceHealth
from agent.simulate.dcgm_exporter import ExporterGpu, SimulatedDcgmExporter, nvml_bus_id
from agent.simulate.node import simulated_topology
from agent.topology.model import Topology

PAGE_BYTES = 15_000_000
AT_CAP_BYTES = 1_900_000  # just under the port's 2 MiB cap on kept lines: the largest page that is parsed
CASES = ("real", "ours", "at-cap", "foreign")


def _line(index: int, uuid: str, bus_id: str, code: int) -> str:
    return (f'DCGM_EXP_XID_ERRORS_TOTAL{{gpu="{index}",UUID="{uuid}",pci_bus_id="{nvml_bus_id(bus_id)}",'
            f'device="nvidia{index}",modelName="NVIDIA H100 80GB HBM3",Hostname="node-1",'
            f'DCGM_FI_DRIVER_VERSION="550.54.15",xid="{code}"}} 0\n')


def page(case: str, topology: Topology) -> bytes:
    """The page of `case`: `real` (the simulated exporter's 8 GPUs), `ours` (15 MB of this node's samples),
    `at-cap` (1.9 MB of them), `foreign` (15 MB: 60,000 GPUs that are not this node's, then the real page)."""
    real = SimulatedDcgmExporter([ExporterGpu(g.index, g.uuid or "", g.bus_id) for g in topology.gpus],
                                 xid_metrics=("gauge", "total"), extra_fields=True).render()
    if case == "real":
        return real.encode()
    lines = ["# HELP DCGM_EXP_XID_ERRORS_TOTAL Total number of XID errors since exporter start.\n",
             "# TYPE DCGM_EXP_XID_ERRORS_TOTAL counter\n"]
    size, n = 0, 0
    gpus = topology.gpus
    while size < (AT_CAP_BYTES if case == "at-cap" else PAGE_BYTES):
        if case in ("ours", "at-cap"):
            gpu = gpus[n % len(gpus)]
            line = _line(gpu.index, gpu.uuid or "", gpu.bus_id, 1 + n // len(gpus))
        else:
            g = n % 60_000
            line = _line(8 + g, f"GPU-{g:08x}-0000-1111-2222-333333333333",
                         f"00{g // 256 % 256:02x}:{g % 256:02x}:00.0", 1 + n // 60_000)
        lines.append(line)
        size += len(line)
        n += 1
    body = "".join(lines)
    return (body + real.split("# HELP DCGM_EXP_XID_ERRORS_TOTAL")[0]).encode() if case == "foreign" \
        else body.encode()


def serve(case: str) -> None:
    """In this (child) process: serve `case`'s page on a free port, printed first, until stdin closes."""
    import http.server
    import threading
    with tempfile.TemporaryDirectory(prefix="gna-bench-") as tmp:
        topology = simulated_topology("dgx-h100", Path(tmp))
    body = page(case, topology)

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            with contextlib.suppress(OSError):
                self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(server.server_address[1], len(body), flush=True)
    sys.stdin.read()
    server.shutdown()


async def scrape_twice(url: str, topology: Topology) -> tuple[bool, ...]:
    """Scrape `url` twice through the agent's dcgm source (the port and watcher `HealthService` builds)."""
    config = HealthConfig(kmsg="", dcgm_exporter_url=url, dcgm_scrape_timeout_seconds=60.0)
    assessor = HealthAssessor(config, topology, DeviceHealth(), lambda: 1000.0)
    watcher = dcgm_watcher(config, assessor, topology)
    try:
        return (await watcher.scrape_once(), await watcher.scrape_once())
    finally:
        await watcher.port.aclose()


def measure(case: str) -> None:
    """In this process (the page served by a child): heap peak and RSS growth of two scrapes of `case`."""
    with tempfile.TemporaryDirectory(prefix="gna-bench-") as tmp:
        topology = simulated_topology("dgx-h100", Path(tmp))
    child = subprocess.Popen([sys.executable, __file__, "--serve", case], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        port, size = (int(x) for x in child.stdout.readline().split())
        url = f"http://127.0.0.1:{port}/metrics"
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        results = asyncio.run(scrape_twice(url, topology))  # RSS first: tracemalloc's own records inflate it
        rss_growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
        tracemalloc.start()
        asyncio.run(scrape_twice(url, topology))
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    finally:
        child.communicate("")
    print(f"{case:8s} page {size / 1e6:5.1f} MB  scrapes ok {results}  heap peak {peak / 2**20:6.1f} MiB  "
          f"RSS growth {rss_growth / 1024:6.1f} MiB", flush=True)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--serve":
        serve(sys.argv[2])
        return
    if len(sys.argv) > 1:
        measure(sys.argv[1])
        return
    for case in CASES:
        subprocess.run([sys.executable, __file__, case], check=True)


if __name__ == "__main__":
    main()
