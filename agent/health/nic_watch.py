"""The NIC/PCIe/inventory producer: one polled pass reads port counters, link widths, AER and GPU presence.

Every `nic_counter_interval_seconds` one pass (in a worker thread: sysfs reads block) reads every port of every
RDMA PF, the PCIe link and AER files of every GPU and RDMA PF and of the bridges above them, and which GPUs are
still on the bus and in NVML. `CounterJudge` turns it into observations; this module names the devices each
one covers (a port -> its PF and that PF's VFs only; a GPU -> its UUID; a bridge -> everything below it), holds
each finding `nic_hold_seconds` after it was last seen, and hands the whole set to the assessor.

Fail safe: a port whose files cannot be read, or NVML failing on a node whose sysfs shows NVIDIA GPUs, sets
`health_check_up{check}` to 0 and, with `unknown_health_action: unhealthy` (the default), makes the devices that
check covers Unhealthy until it runs again. Counter values are saved with the boot id after each pass
(`nic-counters.json` in the state dir): a restart in the same boot judges what grew meanwhile once; after a
reboot the first pass is the baseline.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent import aio
from agent.clock import Clock
from agent.config.health import HealthConfig
from agent.health.assess import HealthAssessor
from agent.health.checks import Checks, CheckState
from agent.health.findings import Clears, Finding, GpuRef
from agent.health.nic_counters import CounterJudge, Observation, Thresholds
from agent.health.pci_kmsg import PciFault
from agent.host.nic_sysfs import CounterPass, NicSysfs
from agent.host.nvml import NvmlHealth
from agent.signals import Severity
from agent.topology.model import Topology

log = logging.getLogger(__name__)

SOURCE = "hw:"  # key prefix of every finding this producer owns
STATE_FILE = "nic-counters.json"
CHECKS = ("nic_counters", "pcie", "inventory")
GPUDIRECT_MODULES = ("nvidia_peermem", "gdrdrv")
_KERNEL_CODES = {"nic_driver_fatal": "NicDriverFatal", "nic_driver_warning": "NicDriverWarning",
                 "pcie_aer_fatal": "PcieAerFatal", "pcie_aer_nonfatal": "PcieAerNonFatal",
                 "nvswitch_fatal": "NvswitchFatal"}


@dataclass(frozen=True)
class Inventory:
    """GPUs expected, present, and the ones missing with where they are missing from."""

    expected: int
    present: int
    missing: dict[str, str]  # bus id -> "the PCI bus" / "NVML"


class NicWatcher:
    """See the module docstring."""

    def __init__(self, sysfs: NicSysfs, assessor: HealthAssessor, config: HealthConfig, nvml: NvmlHealth, *,
                 clock: Clock, state_dir: str | os.PathLike[str], checks: Checks | None = None) -> None:
        self.sysfs = sysfs
        self.checks = checks if checks is not None else Checks()
        self.assessor = assessor
        self.config = config
        self.nvml = nvml
        self.clock = clock
        self.path = Path(state_dir) / STATE_FILE
        self.boot_id = ""
        self.judge = CounterJudge(Thresholds(config.nic_symbol_errors_per_hour, config.nic_flaps_per_minute,
                                             config.nic_rcv_errors_per_second, config.nic_outage_seconds))
        self.actions = {k: Severity.parse(v) for k, v in config.check_action_map().items()}
        self.first_pass = asyncio.Event()
        self.known_gpus: dict[str, GpuRef] = {}  # bus id -> GPU, from the first scan on (rescans add)
        self.inventory = Inventory(0, 0, {})
        self._held: dict[str, tuple[Finding, float]] = {}  # key -> (finding, held until)
        self._save_failed = False
        self.kernel_faults_foreign = 0  # kernel-log faults naming a function that is not on this node
        # told when an RDMA port's state changed between passes (sysfs sends no event; the link check reads again)
        self.port_state_changed: Callable[[], None] | None = None
        self._port_states: dict[tuple[str, int], str] = {}

    async def run(self, stop: asyncio.Event) -> None:
        """Pass after pass until `stop`; an unexpected error goes to the supervisor (which retries)."""
        if self.config.nic_counter_interval_seconds <= 0:
            for check in CHECKS:
                self.checks.set(check, CheckState.OFF)
            self.first_pass.set()
            return
        await asyncio.to_thread(self.load)
        try:
            while not stop.is_set():
                await self.check_once()
                self.first_pass.set()
                await aio.sleep_or_stop(stop, self.config.nic_counter_interval_seconds)
        finally:
            self.sysfs.close()  # the files kept open between passes (a restart opens them again)

    async def check_once(self) -> None:
        """One pass: read, judge, publish findings, save the counters."""
        topology = self.assessor.topology
        for gpu in topology.gpus:
            self.known_gpus.setdefault(gpu.bus_id, GpuRef(str(gpu.index), gpu.uuid or "", gpu.bus_id))
        reading, nvml_up, nvml_gpus, modules = await asyncio.to_thread(self._read, topology)
        now = self.clock.monotonic()
        states = {(p.device, p.port): p.state for p in reading.ports}
        if self._port_states and states != self._port_states and self.port_state_changed is not None:
            self.port_state_changed()
        self._port_states = states
        observations = self.judge.judge(reading, now)
        for flap in self.judge.last_flaps:
            log.warning("%s link came back after %.1f s down", flap.subject, flap.downtime,
                        extra={"rdma_port": flap.subject, "downtime_s": round(flap.downtime, 1)})
        findings = [self._finding(o, topology) for o in observations]
        findings += self._inventory(reading, nvml_up, nvml_gpus)
        findings += self._unknown(reading, topology, nvml_up)
        findings += self._gpudirect(topology, modules)
        self.assessor.on_findings(SOURCE, self._hold(findings, now))
        await asyncio.to_thread(self.save, now)

    def _read(self, topology: Topology) -> tuple[CounterPass, bool, dict[str, str], tuple[str, ...]]:
        rdma = [n.rdma for n in topology.rdma_nics if n.rdma]
        functions = [*self.known_gpus, *(n.bus_id for n in topology.rdma_nics)]
        reading = self.sysfs.read_pass(rdma, functions)
        up = self.nvml.available
        return reading, up, self.nvml.gpu_uuids() if up else {}, self.sysfs.modules_loaded(*GPUDIRECT_MODULES)

    # devices -------------------------------------------------------------------------------------------------
    def devices_of(self, subject: str, topology: Topology) -> tuple[str, ...]:
        """Device IDs a finding about a port ("mlx5_0/1", "mlx5_0") or a PCI function (bus id) covers."""
        device = subject.split("/", 1)[0]
        for nic in topology.rdma_nics:
            if device in (nic.rdma, nic.bus_id):
                return (nic.bus_id, *(vf.bus_id for vf in nic.vfs))
        gpu = self.known_gpus.get(subject)
        if gpu is not None:
            return (gpu.uuid,) if gpu.uuid else ()
        below: list[str] = []  # a bridge: every GPU and NIC under it
        for bus_id in [*self.known_gpus, *(n.bus_id for n in topology.rdma_nics)]:
            if subject in self.sysfs.upstream_ports(bus_id):
                below += [d for d in self.devices_of(bus_id, topology) if d not in below]
        return tuple(below)

    def _finding(self, o: Observation, topology: Topology) -> Finding:
        return Finding(f"{SOURCE}{o.check}:{o.subject}", self.actions[o.check], o.reason, Clears.STATE,
                       self.devices_of(o.subject, topology), code=o.code, hardware=o.hardware)

    def _hold(self, findings: list[Finding], now: float) -> list[Finding]:
        """This pass's findings, and earlier ones still within their hold time."""
        for finding in findings:
            self._held[finding.key] = (finding, now + self.config.nic_hold_seconds)
        current = {f.key for f in findings}
        for key in [k for k, (_, until) in self._held.items() if k not in current and until <= now]:
            log.info("cleared: %s", self._held.pop(key)[0].reason)
        return [finding for finding, _ in self._held.values()]

    def on_kernel_fault(self, fault: PciFault) -> None:
        """An mlx5/AER/SXid kernel-log line: held on the devices under its bus id; not ours: counted, ignored."""
        topology = self.assessor.topology
        devices = self.devices_of(fault.bus_id, topology)
        ours = bool(devices) or fault.bus_id in self.known_gpus or any(n.bus_id == fault.bus_id for n in topology.nics)
        if not ours and fault.kind == "nvswitch_fatal":  # NVSwitches serve no device; on the bus means ours
            ours = os.path.isdir(f"{self.sysfs.root}/bus/pci/devices/{fault.bus_id}")
        if not ours:
            self.kernel_faults_foreign += 1
            log.info("kernel log names %s, which is not on this node; skipped: %s", fault.bus_id, fault.text)
            return
        now = self.clock.monotonic()
        finding = Finding(f"{SOURCE}{fault.kind}:{fault.bus_id}", self.actions[fault.kind],
                          f"kernel log on {fault.bus_id}: {fault.text}", Clears.STATE, devices,
                          code=_KERNEL_CODES[fault.kind], hardware=True)
        if finding.key not in self._held:
            log.warning("%s", finding.reason, extra={"pci_bus_id": fault.bus_id, "check": fault.kind})
        self._held[finding.key] = (finding, now + self.config.nic_hold_seconds)
        self.assessor.on_findings(SOURCE, [f for f, _ in self._held.values()])

    # inventory and fail safe ---------------------------------------------------------------------------------
    def _inventory(self, reading: CounterPass, nvml_up: bool, nvml_gpus: dict[str, str]) -> list[Finding]:
        missing: dict[str, str] = {}
        for bus_id in self.known_gpus:
            if bus_id not in reading.present:
                missing[bus_id] = "the PCI bus"
            elif nvml_up and bus_id not in nvml_gpus:
                missing[bus_id] = "NVML"
        expected = self.config.expected_gpus or len(self.known_gpus)
        present = len(self.known_gpus) - len(missing)
        self.inventory = Inventory(expected, present, missing)
        self.checks.set("inventory", CheckState.OK)
        action = self.actions["gpu_missing"]
        findings = [Finding(f"{SOURCE}gpu_missing:{bus_id}", action,
                            f"{self.known_gpus[bus_id].name} missing from {where}", Clears.STATE,
                            (self.known_gpus[bus_id].uuid,) if self.known_gpus[bus_id].uuid else (),
                            code="GpuMissing", hardware=True) for bus_id, where in sorted(missing.items())]
        if present < expected and not missing:
            findings.append(Finding(f"{SOURCE}gpu_missing:count", action, f"{present} GPUs present, {expected} "
                                    "expected", Clears.STATE, code="GpuMissing", hardware=True))
        return findings

    def _unknown(self, reading: CounterPass, topology: Topology, nvml_up: bool) -> list[Finding]:
        """Findings for checks that could not look; check states for all of them."""
        unhealthy = self.config.unknown_health_action == "unhealthy"
        action = self.actions["unknown"]
        found: list[Finding] = []
        if reading.missing:
            why = "; ".join(f"{k}: {v}" for k, v in sorted(reading.missing.items()))
            self.checks.set("nic_counters", CheckState.UNAVAILABLE, why)
            if unhealthy:
                found += [Finding(f"{SOURCE}unknown:{subject}", action, f"NIC health unknown: {text}", Clears.STATE,
                                  self.devices_of(subject, topology), code="NicHealthUnknown")
                          for subject, text in sorted(reading.missing.items())]
        else:
            self.checks.set("nic_counters", CheckState.OK)
        self.checks.set("pcie", CheckState.OK)
        if self.known_gpus and not nvml_up:
            self.checks.set("nvml", CheckState.UNAVAILABLE, self.nvml.unavailable_reason)
            if unhealthy:
                uuids = tuple(g.uuid for g in self.known_gpus.values() if g.uuid)
                found.append(Finding(f"{SOURCE}unknown:nvml", action, f"GPU health unknown: NVML unavailable on a "
                                     f"node with {len(self.known_gpus)} NVIDIA GPUs in sysfs "
                                     f"({self.nvml.unavailable_reason})", Clears.STATE, uuids,
                                     code="GpuHealthUnknown"))
        elif self.known_gpus:
            self.checks.set("nvml", CheckState.OK)
        return found

    def _gpudirect(self, topology: Topology, loaded: tuple[str, ...]) -> list[Finding]:
        """GPUDirect RDMA needs nvidia_peermem (or GDRCopy's gdrdrv) when GPUs and RDMA VFs are both served."""
        if loaded or not self.known_gpus or not any(n.vfs for n in topology.rdma_nics):
            return []
        return [Finding(f"{SOURCE}gpudirect_missing:node", self.actions["gpudirect_missing"],
                        "GPUDirect RDMA unavailable: neither nvidia_peermem nor gdrdrv is loaded (NCCL falls back to "
                        "staging through host memory)", Clears.STATE, code="GpuDirectRdmaMissing", hardware=False)]

    # persistence ---------------------------------------------------------------------------------------------
    def load(self) -> None:
        """Counter values saved earlier in this boot become the baseline (a new boot starts fresh)."""
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            if data.get("version") != 1 or data.get("boot_id") != self.boot_id or not self.boot_id:
                return
            ports = {str(s): {str(k): int(v) for k, v in c.items()} for s, c in data["ports"].items()}
            aer = {str(b): {str(k): int(v) for k, v in c.items()} for b, c in data["aer"].items()}
            self.judge.restore(ports, aer, float(data["at"]))
            log.info("NIC counters: judging increases since the last agent run in this boot (%d ports)", len(ports))
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            log.warning("ignoring unreadable NIC counter state %s (%s); the first pass is the baseline",
                        self.path, exc)

    def save(self, now: float) -> None:
        """Write the last values with the boot id (atomically); a failure is logged once per streak."""
        ports, aer = self.judge.saved()
        data = {"version": 1, "boot_id": self.boot_id, "at": now, "ports": ports, "aer": aer}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".nic-counters.", dir=self.path.parent)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as out:
                    json.dump(data, out)
                os.replace(tmp, self.path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as exc:
            if not self._save_failed:
                log.error("cannot save NIC counters to %s (%s); after a restart increases meanwhile are missed",
                          self.path, exc)
            self._save_failed = True
            return
        self._save_failed = False
