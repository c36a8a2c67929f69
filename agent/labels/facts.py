"""One reading of everything node labels describe, group by group; a group whose source failed reads None.

Sources: NVML's label facts, the machine type and vGPU scan in sysfs (GFD's keys), the topology, the RDMA ports'
rates, the expected GPU count (config, else the GPUs found at the first start, kept in the state directory),
and whether GPU Feature Discovery publishes for this node (then no `nvidia.com/` key is the agent's: never two
writers for one key). Blocking reads run in a thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from agent.clock import SYSTEM_CLOCK, Clock
from agent.config.sharing import TimeSlicingConfig
from agent.host import pci_config
from agent.host.nic_sysfs import NicSysfs, PortReading
from agent.host.nvml import NvmlError, NvmlFactsSource
from agent.kube.errors import ApiError
from agent.kube.port import NodeApi, NodeFeatureApi
from agent.labels import own
from agent.labels.gfd import PREFIX, GfdError, GfdInputs, gfd_labels
from agent.topology.model import Topology

log = logging.getLogger(__name__)

GFD_TIMESTAMP = f"{PREFIX}gfd.timestamp"
STATE_FILE = "node-labels.json"


def gfd_feature_name(node: str) -> str:
    """GFD's NodeFeature for `node` (NVIDIA/k8s-device-plugin internal/lm/output.go)."""
    return f"nvidia-features-for-{node}"


@dataclass(frozen=True)
class Reading:
    """Labels per group (None: its source failed this time) and why a group is missing."""

    groups: dict[str, dict[str, str] | None]
    why: dict[str, str] = field(default_factory=dict)


class GfdLookupApi(NodeApi, NodeFeatureApi, Protocol):
    """What looking for GFD needs: the Node's labels and NodeFeatures by name."""


class GfdPresence:
    """Whether the agent writes GFD's keys: `on`, `off`, or `auto` (unless GFD publishes for this node: its
    NodeFeature in one of `namespaces`, or GFD's timestamp label on the Node, which the agent never writes).
    Looked up at most every `interval` seconds; None while it cannot tell (an API error before any answer)."""

    def __init__(self, mode: str, api: GfdLookupApi | None, namespaces: Sequence[str], *, interval: float = 300.0,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self.mode, self.api, self.namespaces = mode, api, list(dict.fromkeys(namespaces))
        self.interval, self.clock = interval, clock
        self.present: bool | None = None
        self.hidden: list[str] = []  # namespaces RBAC does not let the agent look into (doctor reports them)
        self._at = float("-inf")

    async def _look(self) -> bool:
        assert self.api is not None
        name = gfd_feature_name(self.api.node_name)
        hidden = []
        for namespace in self.namespaces:
            try:
                if await self.api.get_node_feature(namespace, name) is not None:
                    return True
            except ApiError as exc:
                if exc.code != 403:
                    raise
                hidden.append(namespace)  # the Node's timestamp label below still shows GFD published via NFD
        self.hidden = hidden
        return GFD_TIMESTAMP in (await self.api.get_node()).labels

    async def writes_gfd(self) -> bool | None:
        """True when the agent should write GFD's keys now."""
        if self.mode != "auto" or self.api is None:
            return self.mode != "off"
        if self.clock.monotonic() - self._at >= self.interval or self.present is None:
            try:
                present = await self._look()
            except ApiError as exc:
                log.warning("node labels: cannot tell whether GPU Feature Discovery publishes here (%s)", exc)
            else:
                if present != self.present:
                    log.info("node labels: GPU Feature Discovery %s for this node: the agent %s nvidia.com/ keys",
                             "publishes" if present else "does not publish", "leaves it the" if present else
                             "writes the")
                self.present, self._at = present, self.clock.monotonic()
        return None if self.present is None else not self.present


class ExpectedGpus:
    """`gpu.expected`: the configured count, else the GPUs found at the first start (kept in the state dir)."""

    def __init__(self, configured: int, state_dir: Path) -> None:
        self.configured, self.path = configured, state_dir / STATE_FILE
        self._known: int | None = configured or None

    def value(self, topology: Topology) -> int | None:
        """The count (None: no GPU seen yet and none configured or stored)."""
        if self._known is None:
            try:
                stored = json.loads(self.path.read_text(encoding="utf-8")).get("expectedGpus")
                self._known = int(stored) if isinstance(stored, int) and stored > 0 else None
            except (OSError, ValueError, AttributeError):
                self._known = None
        if self._known is None and topology.gpus:
            self._known = len(topology.gpus)
            self._store(self._known)
        return self._known

    def _store(self, count: int) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_name(f".{STATE_FILE}.tmp")
            partial.write_text(json.dumps({"expectedGpus": count}), encoding="utf-8")
            os.replace(partial, self.path)
        except OSError as exc:
            log.warning("node labels: cannot keep the expected GPU count in %s (%s)", self.path, exc)


@dataclass
class GfdSettings:
    """What GFD's keys depend on besides the hardware: the MIG strategy and time-slicing the agent serves."""

    mig_strategy: str = "none"
    time_slicing: TimeSlicingConfig | None = None


class FactReader:
    """Reads every group once per call."""

    def __init__(self, nvml: NvmlFactsSource, topology: Callable[[], Topology], nic: NicSysfs, sysfs_root: Path,
                 *, gfd: GfdSettings, presence: GfdPresence, expected: ExpectedGpus) -> None:
        self.nvml, self.topology, self.nic, self.sysfs_root = nvml, topology, nic, sysfs_root
        self.gfd, self.presence, self.expected = gfd, presence, expected

    def _gfd(self, topology: Topology) -> dict[str, str]:
        facts = self.nvml.facts()
        try:
            vgpu: pci_config.VgpuCapability | None = pci_config.scan_vgpu(self.sysfs_root)
        except pci_config.PciScanError as exc:
            log.debug("node labels: no vGPU scan: %s", exc)
            vgpu = None
        inputs = GfdInputs(self.gfd.mig_strategy, self.gfd.time_slicing,
                           pci_config.read_machine_type(self.sysfs_root),
                           tuple(g.pci.pci_class for g in topology.gpus), vgpu)
        return gfd_labels(facts, inputs)

    def _ports(self, topology: Topology) -> list[PortReading] | None:
        found: list[PortReading] = []
        for nic in topology.rdma_nics:
            numbers = self.nic.ports(nic.rdma or "")
            if not numbers:
                return None
            for number in numbers:
                reading, _ = self.nic.read_port(nic.rdma or "", number)
                if reading is None:
                    return None
                found.append(reading)
        return found

    async def read(self) -> Reading:
        """Every group now."""
        topology = self.topology()
        groups: dict[str, dict[str, str] | None] = {"topology": own.topology_labels(topology)}
        why: dict[str, str] = {}
        writes = await self.presence.writes_gfd()
        if writes is None:
            groups["gfd"], why["gfd"] = None, "cannot tell whether GPU Feature Discovery publishes here"
        elif not writes:
            groups["gfd"] = {}
        else:
            try:
                groups["gfd"] = await asyncio.to_thread(self._gfd, topology)
            except (NvmlError, GfdError) as exc:
                groups["gfd"], why["gfd"] = None, f"NVML: {exc}"
        ports = await asyncio.to_thread(self._ports, topology)
        groups["rate"] = own.rate_label(ports) if ports is not None else None
        expected = self.expected.value(topology)
        groups["expected"] = {own.GPU_EXPECTED: str(expected)} if expected is not None else {}
        return Reading(groups, why)
