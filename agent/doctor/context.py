"""What `run` would use on this node, resolved the way the wiring resolves it (simulate mode included)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from agent.config import AgentConfig
from agent.hardware import Hardware


@dataclass
class Context:
    """The config, the opened hardware, and the node paths the checks look at.

    On a simulated node without a kubelet the paths are the stand-in kubelet's (in `scratch`), and the state
    directory and kernel log are what `run --simulate` uses there (scratch, none), as `agent.wiring` decides.
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
    """The paths as `run` would use them."""
    dp_dir = Path(cfg.device_plugin.device_plugin_dir)
    simulated = hardware.simulated is not None
    stand_in = simulated and not (dp_dir / "kubelet.sock").exists()
    state_dir, kmsg = hardware.state_dir(cfg, scratch), hardware.kmsg(cfg)
    if stand_in:
        dp_dir = scratch / "dp"
        return Context(cfg, hardware, dp_dir, dp_dir / "plugins_registry", str(scratch / "pr.sock"),
                       scratch / "cdi", state_dir, kmsg, stand_in=True)
    return Context(cfg, hardware, dp_dir, Path(cfg.dra.plugin_registry_dir), cfg.pod_resources.socket,
                   Path(cfg.dra.cdi_spec_dir), state_dir, kmsg)
