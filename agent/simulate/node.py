"""A simulated node: a profile's sysfs tree written to disk, its NVML identities, and its NCCL XML if any.

The agent's real readers then run on it unchanged, which is the point: `--simulate` exercises the same code
paths as a real host, only the sources differ.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from agent.host.nvml import SimulatedNvml
from agent.simulate import profiles, sysfs_writer
from agent.topology.load import load_topology
from agent.topology.model import Topology


@dataclass(frozen=True)
class SimulatedNode:
    """Everything `run --simulate` and the tests need to treat a profile like a host."""

    profile: profiles.Profile
    sysfs_root: Path
    nvml: SimulatedNvml

    @property
    def topology_file(self) -> Path | None:
        """The profile's NCCL topology XML (cloud VM profiles), or None."""
        return self.profile.topology_xml

    def topology(self) -> Topology:
        """Read the written tree back with the real readers."""
        return load_topology(self.sysfs_root, self.nvml.gpu_uuids(), self.topology_file,
                             gpu_minors=self.nvml.gpu_minors(), mig_gpus=self.nvml.mig_gpus())


# NVLinks and NVSwitch fabric of the GPU models the profiles use, by PCI device id: H100 SXM5 has 18 NVLink4 links
# to the NVSwitches of an HGX board (fabric probe supported from Hopper on); V100 SXM2 has 6 NVLink2 links and no
# fabric probe. A GPU model not listed is a PCIe board without NVLink.
GPU_INTERCONNECT: dict[str, tuple[int, bool]] = {"0x2330": (18, True), "0x1db1": (6, False)}


def simulated_nvml(profile: profiles.Profile, overrides_dir: Path | None = None) -> SimulatedNvml:
    """The profile's NVML: its UUIDs, and the NVLinks and fabric of its GPU model."""
    models = {dev.model.device for _, _, dev in profile.walk() if dev.model.is_gpu}
    links, fabric = GPU_INTERCONNECT.get(min(models), (0, False)) if models else (0, False)
    return SimulatedNvml(profile.gpu_uuids, nvlinks=links, fabric=fabric, overrides_dir=overrides_dir)


def build_simulated_node(name: str, root: Path, nvml_overrides: Path | None = None) -> SimulatedNode:
    """Write profile `name` as a sysfs tree under `root` (and create `nvml_overrides`, where NVML override files
    are read, when given). Raises profiles.UnknownProfileError."""
    profile = profiles.load_profile(name)
    root.mkdir(parents=True, exist_ok=True)
    sysfs_writer.write_sysfs(profile, root)
    if nvml_overrides is not None:
        nvml_overrides.mkdir(parents=True, exist_ok=True)
    return SimulatedNode(profile=profile, sysfs_root=root, nvml=simulated_nvml(profile, nvml_overrides))


def simulated_topology(name: str, root: Path) -> Topology:
    """The Topology of profile `name`, written under `root` and read back."""
    return build_simulated_node(name, root).topology()
