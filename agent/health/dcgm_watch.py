"""The DCGM health source: scrape dcgm-exporter, interpret the change, feed the same assessor as NVML and kmsg.

The port is `agent.host.dcgm_exporter` (one GET of the exporter's /metrics, with a timeout and a size cap);
`DcgmWatcher` runs the scrape loop. What DCGM saw becomes the very observations the other sources make -
`on_xid(..., "dcgm")`, `on_ecc_growth`, `on_memory_flag(..., "dcgm")` - so the Xid counter pairs a DCGM Xid with
the kernel log's report of the same fault, and a finding keyed by GPU and kind is raised once whoever saw it.

A failed scrape (endpoint down, timeout, HTTP error, text the parser rejects, nothing that matches this node's
GPUs) changes no finding: it shows as the `dcgm` check's state, `gpu_node_agent_dcgm_scrapes_total{result}`
and one log line per change of state. The next good scrape is compared with the last good one.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

from agent import aio
from agent.config.health import HealthConfig
from agent.health.assess import HealthAssessor
from agent.health.checks import Checks, CheckState
from agent.health.dcgm import DcgmInterpreter, Reading
from agent.health.dcgm_scrape import XID_LAST, MalformedScrapeError, NodeLines, parse_scrape
from agent.health.findings import GpuRef
from agent.host.busid import bus_key
from agent.host.dcgm_exporter import DcgmExporterPort, DcgmScrapeError, HttpDcgmExporter
from agent.topology.model import Gpu, Topology

log = logging.getLogger(__name__)

CHECK = "dcgm"


UNKNOWN_NAMED = 3  # foreign GPUs named in the one log line a scrape may add


class DcgmWatcher:
    """Scrapes every `interval` seconds; each good scrape's changes go to the assessor."""

    def __init__(self, port: DcgmExporterPort, assessor: HealthAssessor, topology: Topology, interval: float, *,
                 nvlink_errors_per_minute: float = 0.0, pcie_replays_per_minute: float = 8.0,
                 checks: Checks | None = None, lines: NodeLines | None = None, filtered_by_port: bool = False
                 ) -> None:
        self.port = port
        self.lines = lines if lines is not None else NodeLines(topology)  # the port's `keep`, when it streams
        # the port applied `lines.keep` as the page streamed in: filtering its answer again would only cost
        # another label scan of every kept line
        self.filtered_by_port = filtered_by_port
        self.checks = checks if checks is not None else Checks()
        self.assessor = assessor
        self.interval = interval
        self.interpreter = DcgmInterpreter(topology, nvlink_errors_per_minute, pcie_replays_per_minute)
        self.first_pass = asyncio.Event()
        self.results: Counter[str] = Counter()  # scrape result -> count (the metric)
        self.unknown_gpus: set[str] = set()  # exporter GPUs in the last good scrape that are not this node's
        self._state = ""  # last logged state, so a lasting failure is one log line

    def update_topology(self, topology: Topology) -> None:
        """GPUs found by a rescan are matched from the next scrape on."""
        self.interpreter.update_topology(topology)
        self.lines.update_topology(topology)

    async def run(self, stop: asyncio.Event) -> None:
        """Scrape until `stop`."""
        try:
            while not stop.is_set():
                await self.scrape_once()
                self.first_pass.set()
                await aio.sleep_or_stop(stop, self.interval)
        finally:
            await self.port.aclose()

    async def scrape_once(self) -> bool:
        """One scrape; True when it was good and its changes were applied."""
        self.lines.start()
        try:
            text = await self.port.fetch()
            scrape = await asyncio.to_thread(parse_scrape, text, None if self.filtered_by_port else self.lines.keep)
        except DcgmScrapeError as exc:
            return self._failed(exc.result, str(exc))
        except MalformedScrapeError as exc:
            return self._failed("malformed", str(exc))
        # Only a scrape that covers some GPU of this node is a reading (checked before `read`, which would take a
        # baseline from it); matching nothing means the URL reaches another node's exporter, or one not yet
        # watching any GPU.
        if not any(self.interpreter.match(s) is not None for s in scrape.samples):
            others = sorted({s.identity for s in scrape.samples} | self.lines.foreign)[:3]
            why = f"none of the {len(scrape.samples) + self.lines.foreign_samples} GPU samples is about this " \
                f"node's GPUs" + (f" (the exporter shows {', '.join(others)})" if others else "")
            return self._failed("no_gpus", why)
        reading = self.interpreter.read(scrape, self.assessor.clock())
        self.results["ok"] += 1
        self._unknown(reading.unknown | self.lines.foreign)
        self._ok(reading)
        self._apply(reading)
        return True

    def _apply(self, reading: Reading) -> None:
        a = self.assessor
        for xid in reading.xids:
            a.on_xid(self._ref(xid.gpu), xid.code, "dcgm", xid.metric, gpu_instance=xid.gpu_instance,
                     count=xid.count)
        for growth in reading.growth:
            gpu = self._ref(growth.gpu)
            if growth.kind in ("sbe", "dbe"):
                log.info("%s: ECC errors growing per DCGM (%s)", gpu.name, growth.detail,
                         extra={"gpu_uuid": gpu.uuid})
                a.on_ecc_growth(gpu, growth.kind)
            else:
                a.on_gpu_link_errors(gpu, growth.kind, growth.detail)
        for flag in reading.flags:
            a.on_memory_flag(self._ref(flag.gpu), flag.name, flag.active, CHECK)

    def _ref(self, gpu: Gpu) -> GpuRef:
        # The kernel log's way of naming the GPU, so a DCGM Xid pairs with the kmsg line of the same fault.
        return self.assessor.names.by_kernel_device(bus_key(gpu.bus_id))

    def _unknown(self, unknown: set[str]) -> None:
        """New foreign GPUs are one log line per scrape, naming a few: a page of 60,000 is not 60,000 lines."""
        new = sorted(unknown - self.unknown_gpus)
        if new:
            shown = ", ".join(new[:UNKNOWN_NAMED])
            more = f" and {len(new) - UNKNOWN_NAMED} more" if len(new) > UNKNOWN_NAMED else ""
            log.warning("dcgm-exporter shows %d GPU(s) that are not on this node: %s%s; their samples are ignored",
                        len(new), shown, more)
        self.unknown_gpus = set(unknown)

    def _ok(self, reading: Reading) -> None:
        self.checks.set(CHECK, CheckState.OK)
        state = f"ok:{reading.xid_metric}"
        if state != self._state:
            log.info("dcgm-exporter %s: scrape ok, %d GPU(s) matched, Xids read from %s%s", self.port.url,
                     len(reading.matched), reading.xid_metric,
                     " (the last-Xid gauge: two Xids between scrapes look like one)"
                     if reading.xid_metric == XID_LAST else "")
            self._state = state

    def _failed(self, result: str, message: str) -> bool:
        self.results[result] += 1
        self.checks.set(CHECK, CheckState.FAILED, f"{result}: {message}")
        if result != self._state:
            log.warning("dcgm-exporter %s: scrape failed (%s: %s); findings stay as they are, retrying every %g s",
                        self.port.url, result, message, self.interval)
            self._state = result
        return False


def dcgm_watcher(config: HealthConfig, assessor: HealthAssessor, topology: Topology, *,
                 checks: Checks | None = None, port: DcgmExporterPort | None = None) -> DcgmWatcher:
    """The DCGM source as the agent builds it: an HTTP port to `dcgmExporterUrl` (unless `port` is given) that
    keeps, while the page streams in, only the lines of this node's GPUs the agent reads (`NodeLines`)."""
    lines = NodeLines(topology)
    filtered = port is None
    if port is None:
        port = HttpDcgmExporter(config.dcgm_exporter_url, config.dcgm_scrape_timeout_seconds, keep=lines.keep)
    return DcgmWatcher(port, assessor, topology, config.dcgm_scrape_interval_seconds,
                       nvlink_errors_per_minute=config.dcgm_nvlink_errors_per_minute,
                       pcie_replays_per_minute=config.dcgm_pcie_replays_per_minute, checks=checks, lines=lines,
                       filtered_by_port=filtered)
