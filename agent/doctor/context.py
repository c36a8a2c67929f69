"""What `run` would use on this node, resolved the way the wiring resolves it (simulate mode included)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from agent.config import AgentConfig
from agent.hardware import Hardware
from agent.node import node_paths


@dataclass
class Context:
    """The config, the opened hardware, and the node paths the checks look at.

    On a simulated node without a kubelet the paths are the stand-in kubelet's (in `scratch`), and the state
    directory and kernel log are what `run --simulate` uses there (scratch, none), as `agent.node` decides.
    """

    cfg: AgentConfig
    hardware: Hardware
    device_plugin_dir: Path
    plugin_registry_dir: Path
    pod_resources_socket: str
    cdi_dir: Path
    state_dir: Path
    kmsg: str
    stand_in: bool = False  # the kubelet paths are a stand-in kubelet's (simulated node)

    @property
    def simulated(self) -> bool:
        """The hardware is a simulated profile."""
        return self.hardware.simulated is not None


def resolve(cfg: AgentConfig, hardware: Hardware, scratch: Path) -> Context:
    """The paths as `run` would use them (`agent.node` decides them for both)."""
    paths = node_paths(cfg, hardware, scratch)
    return Context(cfg, hardware, paths.device_plugin_dir, paths.plugin_registry_dir, paths.pod_resources_socket,
                   paths.cdi_spec_dir, paths.state_dir, paths.kmsg, stand_in=paths.stand_in)
