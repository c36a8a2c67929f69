"""The health subsystem as one object: every producer supervised, device health out, node verdicts out.

`HealthService.run(stop)` starts the producers (kernel log, NVML events, NVML polls, NVLink/fabric/recovery-action
reads, NIC links, the NIC/PCIe counter pass, and dcgm-exporter scrapes when a URL is configured) and a
housekeeping loop, under one `agent.supervisor.Supervisor`: a producer that raises is logged, shown as "failed" in
`checks` and the `gpu_node_agent_health_check_up` gauge, and restarted with backoff, while the others carry
on. Without NVML the NVML checks say "unavailable" and the rest runs, unless `require_nvml` asks for a hard
failure. Device health goes to its one owner (`agent.signals.DeviceHealth`, read by the device plugin); the
node verdict goes into the `verdicts` cell (read by remediation) once every producer has looked once, which is
also when `first_pass_done` is set.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from agent import aio
from agent.clock import SYSTEM_CLOCK, Clock
from agent.config.health import HealthConfig
from agent.health.assess import HealthAssessor
from agent.health.checks import Checks, CheckState
from agent.health.gpu_state_metrics import GpuStateCollector
from agent.health.gpu_state_watch import GpuStateWatcher
from agent.health.links import LinkWatcher
from agent.health.metrics import HealthCollector, ResourceOf
from agent.health.nic_metrics import NicCollector
from agent.health.nic_watch import NicWatcher
from agent.health.nvml_watch import NvmlEventWatcher, NvmlPoller
from agent.health.nvsentinel import NvsentinelReporter
from agent.health.state import SavedHealth, StateStore
from agent.host.kmsg import read_boot_id
from agent.host.links import LinkPort, NetlinkLinkPort
from agent.host.nic_sysfs import NicSysfs
from agent.host.nvml import NvmlHealth
from agent.signals import DeviceHealth, Latest, NodeVerdict
from agent.supervisor import FatalError, Supervisor
from agent.topology.model import Topology

if TYPE_CHECKING:  # the kernel-log and dcgm-exporter watchers are imported only when configured
    from agent.health.dcgm_watch import DcgmWatcher
    from agent.health.kmsg_watch import KmsgWatcher
    from agent.host.dcgm_exporter import DcgmExporterPort
    from agent.host.nvsentinel import NvsentinelPort

log = logging.getLogger(__name__)

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
Producer = Callable[[asyncio.Event], Awaitable[None]]


class NvmlRequiredError(FatalError):
    """NVML is unavailable and the config says it is required."""


class HealthService:
    """GPU and NIC health checks, supervised; see the module docstring."""

    def __init__(self, config: HealthConfig, state_dir: str | os.PathLike[str], topology: Topology,  # noqa: PLR0917
                 nvml: NvmlHealth, device_health: DeviceHealth, registry: CollectorRegistry,
                 link_port: LinkPort | None = None, *, verdicts: Latest[NodeVerdict] | None = None,
                 resource_of: ResourceOf | None = None,
                 dcgm_port: DcgmExporterPort | None = None, nic_sysfs: NicSysfs | None = None,
                 boot_id_path: str | os.PathLike[str] = BOOT_ID_PATH, clock: Clock = SYSTEM_CLOCK,
                 kmsg_file_poll_interval: float = 0.05, housekeeping_interval: float = 1.0,
                 restart_backoff: tuple[float, float] = (1.0, 30.0), nvsentinel: NvsentinelPort | None = None,
                 node_name: str = "") -> None:
        self.config = config
        self.nvml = nvml
        self.clock = clock
        self.verdicts: Latest[NodeVerdict] = verdicts if verdicts is not None else Latest()
        self.device_health = device_health
        # findings and recoveries to NVSentinel's connector, never waited on (agent.health.nvsentinel)
        self.nvsentinel = NvsentinelReporter(
            nvsentinel, node_name=node_name, processing_strategy=config.nvsentinel_processing_strategy,
            registry=registry, topology=lambda: self.assessor.topology) if nvsentinel is not None else None
        self.assessor = HealthAssessor(config, topology, device_health, clock.monotonic, verdicts=self.verdicts,
                                       findings_listener=self.nvsentinel.observe if self.nvsentinel else None)
        self._checks = Checks()
        self.store = StateStore(state_dir)
        self.first_pass_done = asyncio.Event()
        self._boot_id_path = Path(boot_id_path)
        self._housekeeping_interval = housekeeping_interval
        self._backoff = restart_backoff
        self.kmsg: KmsgWatcher | None = None
        if config.kmsg:
            from agent.health.kmsg_watch import KmsgWatcher

            self.kmsg = KmsgWatcher(config.kmsg, self.assessor, "", file_poll_interval=kmsg_file_poll_interval,
                                    checks=self._checks)
        self.nvml_events = NvmlEventWatcher(nvml, self.assessor, config.nvml_event_timeout_seconds,
                                            checks=self._checks)
        self.nvml_poll = NvmlPoller(nvml, self.assessor, config.nvml_poll_interval_seconds, checks=self._checks)
        self.gpu_state = GpuStateWatcher(nvml, self.assessor, config, clock=clock, checks=self._checks)
        self.assessor.recovery_action_changed = self.gpu_state.nudge
        self.links = LinkWatcher(link_port or NetlinkLinkPort("/sys"), self.assessor,
                                 config.link_check_interval_seconds, clock=clock, checks=self._checks)
        self.dcgm: DcgmWatcher | None = None
        if dcgm_port is not None or config.dcgm_exporter_url:  # imported only when configured (start time)
            from agent.health.dcgm_watch import dcgm_watcher

            self.dcgm = dcgm_watcher(config, self.assessor, topology, checks=self._checks, port=dcgm_port)
        if nic_sysfs is None:
            nic_sysfs = NicSysfs(getattr(self.links.port, "sysfs_root", "/sys"))
        self.nic = NicWatcher(nic_sysfs, self.assessor, config, nvml, clock=clock, state_dir=state_dir,
                              checks=self._checks)
        self.nic.port_state_changed = self.links.nudge
        if self.kmsg is not None:
            self.kmsg.pci_faults = self.nic.on_kernel_fault
        self._saved = SavedHealth()
        registry.register(HealthCollector(self.assessor, self._checks, resource_of,
                                          lambda: self.kmsg.lost_records if self.kmsg else 0, self.dcgm,
                                          kmsg_skipped=lambda: self.kmsg.skipped if self.kmsg else {},
                                          kmsg_resyncs=lambda: self.kmsg.resyncs if self.kmsg else 0,
                                          link_resyncs=lambda: self.links.resyncs))
        registry.register(NicCollector(self.nic, device_health))
        registry.register(GpuStateCollector(self.gpu_state))

    @property
    def verdict(self) -> NodeVerdict:
        """The current node verdict."""
        return self.assessor.verdict

    @property
    def checks(self) -> Checks:
        """Producer -> state (`checks["kmsg"]` as text: "ok", "off", "unavailable: why" or "failed: why")."""
        return self._checks

    def update_topology(self, topology: Topology) -> None:
        """After a rescan: new GPUs and NICs are watched (the NVML event set re-registers)."""
        self.assessor.update_topology(topology)
        if self.dcgm is not None:
            self.dcgm.update_topology(topology)

    def gpu_reset_done(self, uuid: str) -> None:
        """The remediation subsystem reset this GPU: faults waiting for a reset clear."""
        self.assessor.on_gpu_reset(uuid, "reset reported by remediation")

    def gpu_reset_starting(self, uuid: str) -> None:
        """The remediation subsystem starts an advised reset: the GPU is Unhealthy until it is done."""
        self.assessor.on_gpu_resetting(uuid)

    def gpu_reset_abandoned(self, uuid: str) -> None:
        """The advised reset did not start: the GPU is back in service."""
        self.assessor.on_gpu_reset_abandoned(uuid)

    async def run(self, stop: asyncio.Event) -> None:
        """Run every producer until `stop` is set. Raises NvmlRequiredError when required NVML is missing."""
        if self.config.require_nvml and not await asyncio.to_thread(lambda: self.nvml.available):
            raise NvmlRequiredError(
                f"NVML is required (requireNvml / --require-nvml) but unavailable: {self.nvml.unavailable_reason}."
                " Give the agent libnvidia-ml.so.1 and /dev/nvidia* (NVIDIA container toolkit, "
                "NVIDIA_VISIBLE_DEVICES=all) or run without --require-nvml")
        boot_id = await asyncio.to_thread(read_boot_id, self._boot_id_path)
        self._saved = await asyncio.to_thread(self.store.load, boot_id)
        self.assessor.restore(self._saved.awaiting_reset)
        if self.dcgm is not None and self._saved.dcgm_xid_totals is not None \
                and self._saved.dcgm_url == self.config.dcgm_exporter_url:
            self.dcgm.interpreter.restore_xid_totals(self._saved.dcgm_xid_totals)
        producers: dict[str, tuple[Producer, asyncio.Event]] = {
            "nvml_events": (self.nvml_events.run, self.nvml_events.first_pass),
            "nvml_poll": (self.nvml_poll.run, self.nvml_poll.first_pass),
            "gpu_state": (self.gpu_state.run, self.gpu_state.first_pass),
            "links": (self.links.run, self.links.first_pass),
            "nic_counters": (self.nic.run, self.nic.first_pass),
        }
        self.nic.boot_id = boot_id
        if self.kmsg is not None:
            self.kmsg.boot_id = boot_id
            self.kmsg.cursor = self._saved.cursor if self._saved.kmsg_path == self.config.kmsg else None
            producers["kmsg"] = (self.kmsg.run, self.kmsg.first_pass)
        else:
            self._checks.set("kmsg", CheckState.OFF)
        if self.dcgm is not None:  # no "off" entry without a URL: DCGM is an optional extra, not a missing check
            producers["dcgm"] = (self.dcgm.run, self.dcgm.first_pass)
        for name in producers:
            self._checks.start(name)
        last: dict[str, str] = {}

        def failed(name: str, exc: Exception, delay: float) -> None:
            problem = f"{type(exc).__name__}: {exc}"
            self._checks.set(name, CheckState.FAILED, problem)
            if problem != last.get(name):  # the same failure again is not news: the check's state already says it
                # An OSError is the host saying no (no such file, EPERM on /dev/kmsg in an unprivileged
                # container): the message says it all. Anything else is a bug and gets its traceback.
                log.error("health check %s failed (%s); retrying with backoff, the other checks go on", name,
                          problem, exc_info=exc if not isinstance(exc, OSError) else None)
            last[name] = problem
            producers[name][1].set()  # readiness must not hang on a broken producer; the gauge shows it

        initial, longest = self._backoff
        supervisor = Supervisor(stop, clock=self.clock, initial=initial, maximum=longest, on_failure=failed)
        for name, (run, _) in producers.items():
            supervisor.add(name, run)
        supervisor.add("housekeeping", lambda s: self._housekeeping(s, boot_id))
        if self.nvsentinel is not None:
            supervisor.add("nvsentinel", self.nvsentinel.run)
        supervisor.add("first-pass", lambda s: self._await_first_pass([r for _, r in producers.values()], s))
        try:
            await supervisor.run()
        finally:
            await asyncio.to_thread(self._save, boot_id)

    async def _await_first_pass(self, ready: list[asyncio.Event], stop: asyncio.Event) -> None:
        await aio.wait_any(stop, asyncio.gather(*(event.wait() for event in ready)))
        if not stop.is_set():
            self.assessor.publisher.open()  # no verdict before this: an early "healthy" could lift a real cordon
            self.first_pass_done.set()
            log.info("health checks: first pass done (%s)",
                     ", ".join(f"{k} {v}" for k, v in self._checks.items()))

    async def _housekeeping(self, stop: asyncio.Event, boot_id: str) -> None:
        """Expire held findings, end quiet Xid bursts, save state when it changed."""
        while not stop.is_set():
            await aio.sleep_or_stop(stop, self._housekeeping_interval)
            try:
                self.assessor.tick()
                if self._dirty():
                    await asyncio.to_thread(self._save, boot_id)
            except Exception:
                log.exception("health housekeeping failed; continuing")

    def _dirty(self) -> bool:
        cursor = self.kmsg.cursor if self.kmsg else None
        return self.assessor.awaiting_reset_changed or cursor != self._saved.cursor or \
            self._dcgm_totals() != self._saved.dcgm_xid_totals

    def _dcgm_totals(self) -> dict[str, float] | None:
        return self.dcgm.interpreter.xid_totals() if self.dcgm is not None else None

    def _save(self, boot_id: str) -> None:
        self.assessor.awaiting_reset_changed = False
        saved = SavedHealth(boot_id, self.config.kmsg, self.kmsg.cursor if self.kmsg else None,
                            self.assessor.book.awaiting_reset(), self.config.dcgm_exporter_url, self._dcgm_totals())
        if not self.store.save(saved):
            self.assessor.awaiting_reset_changed = True  # try again at the next housekeeping turn
        self._saved = saved
