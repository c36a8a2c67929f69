"""Multus device-info files: written on Allocate with the spec's fields, replaced when stale, gone after stop."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from agent.deviceplugin.devinfo import device_info, file_name
from agent.deviceplugin.manager import DevicePluginManager
from agent.deviceplugin.pools import PoolDevice
from agent.simulate.kubelet import AdmissionError, LocalKubelet
from agent.topology.model import Location, Nic, PciInfo, Vf
from tests.deviceplugin.conftest import dp_config, small_topology, without_nic

RDMA = "gpunodeagent.io/sriov_rdma"
MakeManager = Callable[..., Awaitable[DevicePluginManager]]


def test_document_matches_the_spec_example() -> None:
    """Device Information Specification 1.1.0, section 4.3 (k8snetworkplumbingwg/device-info-spec:SPEC.md)."""
    pf = Nic(pci=PciInfo(bus_id="0000:01:02.0"), location=Location(root="pci0000:00"))
    vf = Vf(pci=PciInfo(bus_id="0000:01:02.2"), pf_bus_id="0000:01:02.0", vf_index=0)
    document = device_info(PoolDevice(id=vf.bus_id, bus_id=vf.bus_id, numa=None, function=vf, pf=pf))
    spec_example = ('{"type":"pci","version":"1.1.0",'
                    '"pci":{"pci-address":"0000:01:02.2","pf-pci-address":"0000:01:02.0"}}')
    assert document == json.loads(spec_example)


def test_file_name_follows_the_library() -> None:
    """The spec's own example name: `example.com-sriov_rdma-0000:3b:02.2-device.json`."""
    assert file_name("example.com/sriov_rdma", "0000:3b:02.2") == "example.com-sriov_rdma-0000:3b:02.2-device.json"


async def test_allocate_writes_files_and_stop_removes_them(sockdir: str, kubelet: LocalKubelet,
                                                           make_manager: MakeManager) -> None:
    config = dp_config(sockdir, serve_gpus=False)
    directory = Path(config.device_info_dir)
    manager = await make_manager(config)
    await kubelet.wait_for(lambda: RDMA in kubelet.plugins and kubelet.plugins[RDMA].lists > 0)
    ids = (await kubelet.admit({RDMA: 2}))[RDMA]
    files = sorted(os.listdir(directory))
    assert files == sorted(file_name(RDMA, i) for i in ids)
    for device_id in ids:
        path = directory / file_name(RDMA, device_id)
        document = json.loads(path.read_text())
        vf = small_topology().find(device_id)
        assert isinstance(vf, Vf)
        assert document == {"type": "pci", "version": "1.1.0",
                            "pci": {"pci-address": device_id, "rdma-device": vf.rdma, "pf-pci-address": vf.pf_bus_id}}
        assert stat.S_IMODE(path.stat().st_mode) == 0o444
    await manager.stop()
    assert os.listdir(directory) == []


async def test_stale_file_is_replaced(sockdir: str, kubelet: LocalKubelet, make_manager: MakeManager) -> None:
    config = dp_config(sockdir, serve_gpus=False)
    directory = Path(config.device_info_dir)
    directory.mkdir()
    for device_id in small_topology().nics[0].vfs:  # left by an earlier run, read-only as the library writes
        stale = directory / file_name(RDMA, device_id.bus_id)
        stale.write_text('{"type":"pci","version":"1.0.0","pci":{"pci-address":"stale"}}')
        stale.chmod(0o444)
    await make_manager(config)
    await kubelet.wait_for(lambda: RDMA in kubelet.plugins and kubelet.plugins[RDMA].lists > 0)
    ids = (await kubelet.admit({RDMA: 6}))[RDMA]
    for device_id in ids:
        assert json.loads((directory / file_name(RDMA, device_id)).read_text())["pci"]["pci-address"] == device_id


async def test_device_leaving_the_pool_loses_its_file(sockdir: str, kubelet: LocalKubelet,
                                                      make_manager: MakeManager) -> None:
    config = dp_config(sockdir, serve_gpus=False)
    directory = Path(config.device_info_dir)
    manager = await make_manager(config)
    await kubelet.wait_for(lambda: RDMA in kubelet.plugins and kubelet.plugins[RDMA].lists > 0)
    await kubelet.admit({RDMA: 6})
    assert len(os.listdir(directory)) == 6
    await manager.update_topology(without_nic(small_topology(), "0000:1a:00.0"))
    assert sorted(os.listdir(directory)) == sorted(file_name(RDMA, f"0000:9a:00.{i}") for i in (2, 3, 4))


async def test_unwritable_directory_fails_the_allocate(sockdir: str, kubelet: LocalKubelet,
                                                       make_manager: MakeManager) -> None:
    """As SR-IOV DP: without its device-info file the CNI would configure nothing; the kubelet retries."""
    blocker = Path(sockdir) / "not-a-dir"
    blocker.write_text("")
    await make_manager(dp_config(sockdir, serve_gpus=False, device_info_dir=str(blocker / "dp")))
    await kubelet.wait_for(lambda: RDMA in kubelet.plugins and kubelet.plugins[RDMA].lists > 0)
    with pytest.raises(AdmissionError, match=r"INTERNAL: .*cannot write device-info file"):
        await kubelet.admit({RDMA: 1})


async def test_gpus_get_no_file_and_empty_dir_disables(sockdir: str, kubelet: LocalKubelet,
                                                       make_manager: MakeManager) -> None:
    config = dp_config(sockdir, device_info_dir="")
    manager = await make_manager(config)
    assert manager.device_info is None
    await kubelet.wait_for(lambda: len(kubelet.plugins) == 2 and all(v.lists for v in kubelet.plugins.values()))
    await kubelet.admit({RDMA: 1, "nvidia.com/gpu": 1})
    assert not (Path(sockdir) / "devinfo").exists()
