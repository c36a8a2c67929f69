"""The node's hardware sources, real or simulated, behind one object that can rescan.

`Hardware` owns the ports to the machine that the subsystems share: NVML, NIC link state, the sysfs root the
topology is read from, and the active probes preflight runs on them. `--simulate PROFILE` writes the profile as
a sysfs tree into a scratch directory and pairs it with the simulated NVML and links read from that tree;
otherwise the host's sysfs, the real NVML and netlink are used. Either way the same readers build the
`Topology`, so a simulated run exercises the code that runs on a node.

`open_hardware` is where the real or the simulated sources are chosen, once; `agent.node.open_node` calls it and
resolves what else follows from the mode (defaults, node paths) from `Hardware.simulated`. Choosing is
composition: this module sits beside `agent.wiring` (the composition root), above the ports in `agent.host`, the
model in `agent.topology`, the simulator in `agent.simulate` and the preflight probes in `agent.health.probes`,
so no port imports what is built on it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from agent.clock import SYSTEM_CLOCK, Clock
from agent.config import TopologyConfig
from agent.health import probes
from agent.host.driver_files import PROC_ROOT, mig_minors_path
from agent.host.links import LinkPort, NetlinkLinkPort, SysfsLinkPort
from agent.host.nic_sysfs import NicSysfs
from agent.host.nvml import NvmlPort, RealNvml
from agent.simulate.node import SimulatedNode, build_simulated_node
from agent.topology.load import load_topology
from agent.topology.model import Topology

log = logging.getLogger(__name__)


@dataclass
class Hardware:
    """Where the topology comes from, and the latest topology read from there."""

    nvml: NvmlPort
    sysfs_root: Path
    topology_file: Path | None
    topology: Topology
    links: LinkPort
    simulated: SimulatedNode | None = None
    counters: NicSysfs | None = None  # IB port counters, PCIe widths, AER: read by health's NIC/PCIe pass
    proc_root: str = PROC_ROOT  # where the driver's /proc files are (a simulated node carries its own)
    data_direct_vfs: bool = True  # `topology.dataDirectVfs`

    def __post_init__(self) -> None:
        if self.counters is None:
            self.counters = NicSysfs(self.sysfs_root)

    def rescan(self) -> Topology:
        """Read the sources again (blocking: call from a thread); the new value replaces `topology`."""
        self.topology = load_topology(self.sysfs_root, self.nvml.gpu_uuids(), self.topology_file,
                                      gpu_minors=self.nvml.gpu_minors(), mig_gpus=self.nvml.mig_gpus(),
                                      mig_devices=self.nvml.mig_devices(), data_direct_vfs=self.data_direct_vfs)
        return self.topology

    @property
    def mig_minors(self) -> str:
        """The driver's MIG capability minors file on this node."""
        return mig_minors_path(self.proc_root)

    def preflight_probes(self) -> dict[str, probes.Probe]:
        """The active checks preflight runs (blocking), by check name, on the sources health watches."""
        def topology() -> Topology:
            return self.topology

        return {
            "NoPendingRowRemap": probes.no_pending_row_remap(self.nvml, topology),
            "NoUncorrectableEcc": probes.no_uncorrectable_ecc(self.nvml, topology),
            "NicLinksUp": probes.nic_links_up(self.links, topology),
        }

    def describe(self) -> str:
        """One line for logs: which sources are in use."""
        where = f"simulated profile {self.simulated.profile.name} (sysfs tree {self.sysfs_root}: write its files to " \
            f"inject faults; NVML faults: <GPU UUID>.json in {self.simulated.nvml.overrides_dir})" if self.simulated \
            else f"sysfs {self.sysfs_root}"
        xml = f", NCCL topology {self.topology_file}" if self.topology_file else ""
        return f"{where}{xml}, NVML {'available' if self.nvml.available else 'unavailable'}"


def open_hardware(cfg: TopologyConfig, scratch: Path, clock: Clock = SYSTEM_CLOCK) -> Hardware:
    """Open the configured sources and read the first topology. Raises for an unknown profile or bad XML."""
    if cfg.simulate:
        # the simulated node's root holds sys/ (plays /sys), proc/ (plays /proc) and the NVML override files
        node = build_simulated_node(cfg.simulate, scratch, scratch.parent / "nvml", scratch.parent / "proc")
        xml = Path(cfg.topology_file) if cfg.topology_file else node.topology_file
        hardware = Hardware(nvml=node.nvml, sysfs_root=node.sysfs_root, topology_file=xml,
                            topology=Topology(), links=SysfsLinkPort(node.sysfs_root), simulated=node,
                            proc_root=node.driver_proc_root)
    else:
        hardware = Hardware(nvml=RealNvml(clock=clock), sysfs_root=Path(cfg.sysfs_root),
                            topology_file=Path(cfg.topology_file) if cfg.topology_file else None,
                            topology=Topology(), links=NetlinkLinkPort(cfg.sysfs_root))
    hardware.data_direct_vfs = cfg.data_direct_vfs
    hardware.rescan()
    return hardware
