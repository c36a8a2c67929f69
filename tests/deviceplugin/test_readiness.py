"""Only ready VFs are advertised: unbound, RDMA-less or link-unknown functions wait for the next rescan.

The end-to-end case runs the real sysfs reader on a simulated tree (`pcie-pairs`: ConnectX-5 RoCE VFs) and
unbinds a VF the way the kernel does (its `driver` link and the driver's child devices go away).
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path

import pytest

from agent.config.model import DevicePluginConfig, PoolConfig
from agent.deviceplugin.manager import DevicePluginManager
from agent.deviceplugin.pools import build_pools, not_ready
from agent.simulate.kubelet import KubeletEvent, LocalKubelet
from agent.simulate.node import build_simulated_node
from agent.topology.model import PciInfo, RdmaCharDevices, RdmaPort, Topology
from agent.topology.sysfs import SysfsReader
from tests.deviceplugin.conftest import dp_config, small_topology

RDMA = "gpunodeagent.io/sriov_rdma"
MakeManager = Callable[..., Awaitable[DevicePluginManager]]


def _with_vf(topology: Topology, nic: int, vf: int, **changes: object) -> Topology:
    nics = list(topology.nics)
    vfs = list(nics[nic].vfs)
    vfs[vf] = replace(vfs[vf], **changes)  # type: ignore[arg-type]
    nics[nic] = replace(nics[nic], vfs=tuple(vfs))
    return replace(topology, nics=tuple(nics))


@pytest.mark.parametrize(("changes", "reason"), [
    ({"pci": PciInfo(bus_id="0000:1a:00.2", vendor="0x15b3", device="0x101e")}, "is bound to no driver"),
    ({"rdma": None, "chardevs": RdmaCharDevices()}, "has no RDMA device yet"),
    ({"chardevs": RdmaCharDevices()}, "has no uverbs device"),
])
def test_unready_vf_is_left_out_with_its_reason(changes: dict[str, object], reason: str) -> None:
    topology = _with_vf(small_topology(), 0, 0, **changes)
    scan = build_pools(topology, DevicePluginConfig(pools=[PoolConfig(resource_name="all")]))
    (pool,) = scan.pools
    assert "0000:1a:00.2" not in pool.ids and len(pool.ids) == 6  # 5 VFs and the Ethernet PF
    assert any(reason in line and "0000:1a:00.2" in line for line in scan.skipped)


def test_unknown_pf_link_state_holds_its_vfs_back() -> None:
    topology = small_topology()
    pf = replace(topology.nics[0], ports=(RdmaPort(number=1, state=""),))
    assert "link state of 0000:1a:00.0 is unknown" in not_ready(pf.vfs[0], pf)
    ethernet = topology.nics[2]
    assert not_ready(ethernet, ethernet) == ""  # a non-RDMA PF with a netdev
    assert "is unknown" in not_ready(ethernet, replace(ethernet, netdevs=()))


def _unbind(sysfs: Path, bdf: str, stash: Path) -> None:
    """What `echo <bdf> > driver/unbind` leaves: no driver link, no net/RDMA children, no back-link."""
    device = (sysfs / "bus" / "pci" / "devices" / bdf).resolve()
    shutil.copytree(device, stash / bdf, symlinks=True)
    driver = Path(os.path.realpath(device / "driver"))
    os.unlink(device / "driver")
    os.unlink(driver / bdf)
    for child in ("net", "infiniband", "infiniband_verbs", "infiniband_mad"):
        shutil.rmtree(device / child, ignore_errors=True)


def _bind(sysfs: Path, bdf: str, stash: Path) -> None:
    device = (sysfs / "bus" / "pci" / "devices" / bdf).resolve()
    shutil.rmtree(device)
    shutil.copytree(stash / bdf, device, symlinks=True)
    driver = Path(os.path.realpath(device / "driver"))
    os.symlink(os.path.relpath(device, driver), driver / bdf)


async def test_vf_without_driver_joins_once_bound(sockdir: str, kubelet: LocalKubelet, make_manager: MakeManager,
                                                  tmp_path: Path) -> None:
    sysfs = tmp_path / "sys"
    build_simulated_node("pcie-pairs", sysfs)
    reader = SysfsReader(sysfs)
    start = reader.read()
    vf = start.nics[0].vfs[1].bus_id
    _unbind(sysfs, vf, tmp_path / "stash")
    manager = await make_manager(dp_config(sockdir, serve_gpus=False), reader.read())
    await kubelet.wait_for(lambda: RDMA in kubelet.plugins and kubelet.plugins[RDMA].lists > 0)
    assert vf not in kubelet.plugins[RDMA].devices
    assert len(kubelet.plugins[RDMA].devices) == 15

    _bind(sysfs, vf, tmp_path / "stash")  # the driver loads late; the next rescan sees it
    await manager.update_topology(reader.read())
    await kubelet.wait_for(lambda: vf in kubelet.plugins[RDMA].devices)
    assert kubelet.plugins[RDMA].health()[vf] == "Healthy"

    _unbind(sysfs, vf, tmp_path / "stash2")  # losing the driver withdraws it, without a restart
    await manager.update_topology(reader.read())
    await kubelet.wait_for(lambda: vf not in kubelet.plugins[RDMA].devices)
    assert len(kubelet.registrations) == 1


async def test_never_an_empty_list_while_every_vf_is_down(sockdir: str, kubelet: LocalKubelet,
                                                          make_manager: MakeManager, tmp_path: Path) -> None:
    """A driver restart unbinds every VF: the kubelet keeps the devices (Unhealthy), never gets an empty list."""
    sysfs = tmp_path / "sys"
    build_simulated_node("pcie-pairs", sysfs)
    reader = SysfsReader(sysfs)
    full = reader.read()
    manager = await make_manager(dp_config(sockdir, serve_gpus=False), full)
    await kubelet.wait_for(lambda: RDMA in kubelet.plugins and len(kubelet.plugins[RDMA].devices) == 16)
    vfs = [vf.bus_id for nic in full.nics for vf in nic.vfs]
    for i, vf in enumerate(vfs):
        _unbind(sysfs, vf, tmp_path / f"stash{i}")
    await manager.update_topology(reader.read())
    await kubelet.wait_for(lambda: not kubelet.plugins[RDMA].connected)
    assert set(kubelet.plugins[RDMA].health().values()) == {"Unhealthy"}
    assert len(kubelet.plugins[RDMA].health()) == 16
    for i, vf in enumerate(vfs):
        _bind(sysfs, vf, tmp_path / f"stash{i}")
    await manager.update_topology(reader.read())
    await kubelet.wait_for(lambda: RDMA in kubelet.plugins and len(kubelet.plugins[RDMA].healthy()) == 16)
    await asyncio.wait_for(manager.registered.wait(), 10)
    empty: list[KubeletEvent] = [e for e in kubelet.events if e.kind == "devices" and not e.devices]
    assert empty == []
