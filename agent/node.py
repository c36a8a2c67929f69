"""One node, opened once: what every command that looks at the node (`run`, `doctor`, `config --pools`,
`topology`) works from.

`open_node` opens the hardware (`agent.hardware.open_hardware` builds the real or the simulated sources from
`--simulate`: that choice is made there once) and resolves everything else on the node that follows from the
mode, read from `Hardware.simulated`: the settings whose default follows it (`serve_gpus`) and the node paths
(the host's kubelet directories, or a stand-in kubelet's in the scratch directory on a simulated node that has
no kubelet; the state directory; no host kernel log). Every command gets the same answers, so `config --pools`
lists what `run` registers and `doctor` looks where `run` writes. Beyond the node, only the API client
(`agent.kube.access`: in memory without credentials) and `run`'s scratch directory (`agent.app`) read the flag.

It sits beside `agent.hardware` and `agent.wiring` (the composition root takes a `Node`), above the consumers
whose pools it can compute.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from agent.clock import SYSTEM_CLOCK, Clock
from agent.config import AgentConfig, DevicePluginConfig
from agent.config.model import DraConfig
from agent.hardware import Hardware, open_hardware
from agent.host.links import SysfsLinkPort
from agent.host.nvml import RealNvml
from agent.topology.model import Topology

if TYPE_CHECKING:
    from agent.deviceplugin.pools import PoolScan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodePaths:
    """Where the agent finds and writes the node's files, as `run` uses them.

    With `stand_in` (a simulated node without a kubelet) the kubelet-facing paths are the stand-in kubelet's:
    its device-plugin directory (the configured one when it exists, else `dp` in the scratch directory), and
    device-info files, CDI specs and the PodResources socket in the scratch directory, never on the host.
    """

    stand_in: bool
    device_plugin_dir: Path
    plugin_registry_dir: Path  # the plugin watcher's directory, as the device plugin uses it
    cdi_spec_dir: Path  # as the device plugin writes RDMA specs
    device_info_dir: str  # "" when off
    pod_resources_socket: str  # "" when off
    dra_plugin_registry_dir: Path
    dra_plugin_dir: str  # "" for the default under /var/lib/kubelet/plugins/<driver>
    dra_cdi_spec_dir: Path
    state_dir: Path
    kmsg: str  # "" for none


def resolve_defaults(cfg: AgentConfig, *, simulated: bool) -> AgentConfig:
    """Settings whose default depends on the mode: GPUs are served by default only on a simulated node, where no
    other GPU plugin runs."""
    if cfg.device_plugin.serve_gpus is None:
        cfg = dataclasses.replace(cfg, device_plugin=dataclasses.replace(cfg.device_plugin, serve_gpus=simulated))
    return cfg


def device_plugin_beside_dra(cfg: AgentConfig) -> AgentConfig:
    """With --dra the device plugin serves only what DRA does not (two APIs for one device over-commit it)."""
    dp, dc = cfg.device_plugin, cfg.dra
    if not dc.enabled or not dp.enabled:
        return cfg
    serve_gpus = bool(dp.serve_gpus) and not dc.gpus
    pools = [] if dc.rdma else dp.pools
    if not serve_gpus and not pools:
        log.info("DRA serves GPUs and RDMA functions; the device plugin is off")
        return dataclasses.replace(cfg, device_plugin=dataclasses.replace(dp, enabled=False))
    log.info("DRA serves %s; the device plugin serves the rest", " and ".join(
        k for k, on in (("GPUs", dc.gpus), ("RDMA functions", dc.rdma)) if on))
    return dataclasses.replace(cfg, device_plugin=dataclasses.replace(dp, serve_gpus=serve_gpus, pools=pools))


def node_paths(cfg: AgentConfig, hardware: Hardware, scratch: Path) -> NodePaths:
    """The paths `run` uses on this node (see `NodePaths`); nothing is created."""
    simulated = hardware.simulated is not None
    dp, dc = cfg.device_plugin, cfg.dra
    directory = Path(dp.device_plugin_dir)
    stand_in = simulated and not (directory / "kubelet.sock").exists()
    registry_dir, cdi_dir = Path(dc.plugin_registry_dir), Path(dc.cdi_spec_dir)  # node paths shared with DRA
    device_info, pod_resources = dp.device_info_dir, cfg.pod_resources.socket
    if stand_in:  # the stand-in kubelet's world: no device-info files, plugin-watcher sockets or specs on the host
        if not directory.is_dir():
            directory = scratch / "dp"
        registry_dir, cdi_dir = directory / "plugins_registry", scratch / "cdi"
        device_info, pod_resources = str(scratch / "devinfo"), str(scratch / "pr.sock")
    dra_registry, dra_plugin, dra_cdi = Path(dc.plugin_registry_dir), dc.plugin_dir, Path(dc.cdi_spec_dir)
    if simulated and not dra_registry.is_dir():  # a simulated node without kubelet directories
        dra_registry, dra_plugin, dra_cdi = scratch / "plugins_registry", str(scratch / "dra"), scratch / "cdi"
    return NodePaths(stand_in=stand_in, device_plugin_dir=directory, plugin_registry_dir=registry_dir,
                     cdi_spec_dir=cdi_dir, device_info_dir=device_info, pod_resources_socket=pod_resources,
                     dra_plugin_registry_dir=dra_registry, dra_plugin_dir=dra_plugin, dra_cdi_spec_dir=dra_cdi,
                     state_dir=_state_dir(cfg, simulated, scratch), kmsg=_kmsg(cfg, simulated))


def _state_dir(cfg: AgentConfig, simulated: bool, scratch: Path) -> Path:
    """On a simulated node left at the default (a newcomer's laptop has no root-owned state directory), `state`
    in the scratch directory."""
    if simulated and cfg.state_dir == AgentConfig().state_dir:
        return scratch / "state"
    return Path(cfg.state_dir)


def _kmsg(cfg: AgentConfig, simulated: bool) -> str:
    """None on a simulated node left at /dev/kmsg: simulated GPUs must not be judged by the host's kernel log."""
    return "" if simulated and cfg.health.kmsg == "/dev/kmsg" else cfg.health.kmsg


@dataclass(frozen=True)
class Node:
    """One opened node: `cfg` with the mode's defaults resolved, the hardware read from its sources, the scratch
    directory (simulated sysfs tree, stand-in kubelet) and the paths `run` uses there. `serving` is `cfg` with
    the device plugin set beside the DRA driver: what `run` builds its subsystems from."""

    cfg: AgentConfig
    hardware: Hardware
    scratch: Path
    paths: NodePaths
    serving: AgentConfig

    @property
    def simulated(self) -> bool:
        """The hardware is a simulated profile."""
        return self.hardware.simulated is not None

    def device_plugin_config(self) -> DevicePluginConfig:
        """The device plugin's settings as `run` builds it: beside DRA, in this node's directories."""
        return dataclasses.replace(self.serving.device_plugin, device_plugin_dir=str(self.paths.device_plugin_dir),
                                   device_info_dir=self.paths.device_info_dir)

    def dra_config(self) -> DraConfig:
        """The DRA driver's settings as `run` builds it, in this node's directories."""
        return dataclasses.replace(self.serving.dra, plugin_registry_dir=str(self.paths.dra_plugin_registry_dir),
                                   plugin_dir=self.paths.dra_plugin_dir, cdi_spec_dir=str(self.paths.dra_cdi_spec_dir))

    def pools(self) -> PoolScan:
        """The device plugin's pools on the current topology, as `run` serves them (MIG strategy, time-slicing and
        the SR-IOV file applied; a pool without devices gets no server). Raises `PoolConfigError` (the SR-IOV
        file's `SriovConfigError` included) for pools that cannot be served; reading the file logs nothing: the
        caller reports its warnings."""
        from agent.deviceplugin.pools import PoolScan, build_pools
        from agent.deviceplugin.sriovdp import default_prefix, read_config

        dp = self.serving.device_plugin
        if not dp.enabled:
            return PoolScan(pools=())
        if dp.sriov_dp_config:
            dp = dataclasses.replace(dp, pools=list(read_config(dp.sriov_dp_config, default_prefix(dp)).pools))
        return build_pools(self.hardware.topology, dp)


def on_hardware(cfg: AgentConfig, hardware: Hardware, scratch: Path) -> Node:
    """The node on hardware already opened (`open_node` opens it)."""
    cfg = resolve_defaults(cfg, simulated=hardware.simulated is not None)
    return Node(cfg=cfg, hardware=hardware, scratch=scratch, paths=node_paths(cfg, hardware, scratch),
                serving=device_plugin_beside_dra(cfg))


def open_node(cfg: AgentConfig, scratch: Path, clock: Clock = SYSTEM_CLOCK, *, unreadable_ok: bool = False) -> Node:
    """Open this node's hardware (`--simulate`: write the profile's tree under `scratch`) and resolve the mode.

    Blocking. Raises what `open_hardware` raises: `UnknownProfileError`, `TopologyXmlError`, `OSError`. With
    `unreadable_ok` (`doctor`, whose sysfs check reports it) a host tree that cannot be read gives an empty
    topology on the configured sources instead of the `OSError`.
    """
    try:
        hardware = open_hardware(cfg.topology, scratch / "sys", clock)
    except OSError as exc:
        if not unreadable_ok:
            raise
        log.warning("cannot read the hardware: %s", exc)
        root = Path(cfg.topology.sysfs_root)
        hardware = Hardware(RealNvml(clock=clock), root, None, Topology(), SysfsLinkPort(root))
    return on_hardware(cfg, hardware, scratch)
