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


def build_simulated_node(name: str, root: Path) -> SimulatedNode:
    """Write profile `name` as a sysfs tree under `root`. Raises profiles.UnknownProfileError."""
    profile = profiles.load_profile(name)
    root.mkdir(parents=True, exist_ok=True)
    sysfs_writer.write_sysfs(profile, root)
    return SimulatedNode(profile=profile, sysfs_root=root, nvml=SimulatedNvml(profile.gpu_uuids))


def simulated_topology(name: str, root: Path) -> Topology:
    """The Topology of profile `name`, written under `root` and read back."""
    return build_simulated_node(name, root).topology()
