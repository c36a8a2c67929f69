"""Issue 27, item 8: a hostile dcgm-exporter page cannot push the agent past its memory limit.

A 15 MB page of valid samples for this node took the heap from 61 to 261 MB (the DaemonSet's limit is 256 Mi); a
page of 60,000 foreign GPUs kept 197 MB. The page is served by a thread (the body allocated before measuring) to
the port and watcher `HealthService` builds; the Python heap's peak over the scrape is measured with tracemalloc
against the page's own size (bench/dcgm_memory.py has the RSS figures)."""

from __future__ import annotations

import contextlib
import http.server
import logging
import threading
import tracemalloc
from collections.abc import Iterator

import pytest

from agent.config.health import HealthConfig
from agent.health.assess import HealthAssessor
from agent.health.dcgm import MAX_FOREIGN, MAX_SERIES, DcgmInterpreter, Sample, Scrape
from agent.health.dcgm_watch import DcgmWatcher, dcgm_watcher
from agent.signals import DeviceHealth
from agent.simulate.dcgm_exporter import ExporterGpu, SimulatedDcgmExporter, nvml_bus_id
from agent.simulate.node import SimulatedNode
from agent.topology.model import Topology

PAGE = 15_000_000
HEAD = ("# HELP DCGM_EXP_XID_ERRORS_TOTAL Total number of XID errors since exporter start.\n"
        "# TYPE DCGM_EXP_XID_ERRORS_TOTAL counter\n")


@pytest.fixture
def topology(node: SimulatedNode) -> Topology:
    return node.topology()


def _line(index: int, uuid: str, bus_id: str, code: int) -> str:
    return (f'DCGM_EXP_XID_ERRORS_TOTAL{{gpu="{index}",UUID="{uuid}",pci_bus_id="{bus_id}",device="nvidia{index}",'
            f'modelName="NVIDIA H100 80GB HBM3",Hostname="node-1",DCGM_FI_DRIVER_VERSION="550.54.15",'
            f'xid="{code}"}} 0\n')


def _page(lines: Iterator[str], tail: str = "") -> bytes:
    parts, size = [HEAD], 0
    for line in lines:
        parts.append(line)
        size += len(line)
        if size >= PAGE:
            break
    return ("".join(parts) + tail).encode()


class _Served:
    """`body` on a loopback HTTP server run by a thread (its writes copy nothing the test measures)."""

    def __init__(self, body: bytes) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                with contextlib.suppress(OSError):  # the agent stopped reading (too large)
                    self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="exporter", daemon=True)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"

    def __enter__(self) -> _Served:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


async def _scrape_measured(topology: Topology, body: bytes) -> tuple[bool, int, DcgmWatcher]:
    with _Served(body) as served:
        config = HealthConfig(kmsg="", dcgm_exporter_url=served.url, dcgm_scrape_timeout_seconds=30.0)
        assessor = HealthAssessor(config, topology, DeviceHealth(), lambda: 1000.0)
        watcher = dcgm_watcher(config, assessor, topology)
        tracemalloc.start()
        try:
            ok = await watcher.scrape_once()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
            await watcher.port.aclose()
    return ok, peak, watcher


async def test_a_15_mb_page_of_this_nodes_samples_is_refused_within_bounded_memory(topology: Topology) -> None:
    gpus = topology.gpus
    body = _page(_line(g.index, g.uuid or "", nvml_bus_id(g.bus_id), 1 + n // len(gpus))
                 for n in range(10**9) for g in (gpus[n % len(gpus)],))
    ok, peak, watcher = await _scrape_measured(topology, body)
    assert not ok and watcher.results["too_large"] == 1
    assert peak < len(body) // 2, f"peak {peak / 2**20:.1f} MiB for a {len(body) / 1e6:.0f} MB page"  # was 15x


async def test_a_page_of_60000_foreign_gpus_keeps_none_of_them(topology: Topology,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    ours = SimulatedDcgmExporter([ExporterGpu(g.index, g.uuid or "", g.bus_id) for g in topology.gpus],
                                 xid_metrics=("total",)).render()
    foreign = (_line(8 + i % 60_000, f"GPU-{i % 60_000:08x}-0000-1111-2222-333333333333",
                     f"00000000:{i % 60_000 // 256 % 256:02X}:{i % 256:02X}.0", 1) for i in range(10**9))
    body = _page(foreign, tail=ours)
    with caplog.at_level(logging.WARNING):
        ok, peak, watcher = await _scrape_measured(topology, body)
    assert ok and watcher.results["ok"] == 1
    assert peak < len(body) // 2, f"peak {peak / 2**20:.1f} MiB for a {len(body) / 1e6:.0f} MB page"
    assert len(watcher.unknown_gpus) == MAX_FOREIGN  # named up to the cap
    assert sum("not on this node" in r.getMessage() for r in caplog.records) == 1


def test_ever_new_series_are_not_kept_for_ever(topology: Topology) -> None:
    """A page may be small and still name new series each time (new Xid codes): what is remembered is capped."""
    gpu = topology.gpus[0]
    interpreter = DcgmInterpreter(topology)
    for scrape in range(6):
        samples = tuple(Sample("DCGM_EXP_XID_ERRORS_TOTAL", gpu.uuid or "", gpu.bus_id, "",
                               (("xid", str(scrape * 20_000 + code)),), 0.0) for code in range(1, 20_001))
        interpreter.read(Scrape(frozenset({"DCGM_EXP_XID_ERRORS_TOTAL"}), samples), 1000.0 + scrape * 15)
        totals = interpreter.xid_totals()
        assert totals is not None and len(totals) <= MAX_SERIES
