"""--rdma-cdi: a CDI spec per NIC pool, devices named by annotation in Allocate, specs follow the pool and go away."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Awaitable, Callable
from pathlib import Path

from agent.deviceplugin.manager import DevicePluginManager
from agent.simulate.kubelet import LocalKubelet
from tests.deviceplugin.conftest import dp_config, small_topology, without_nic

RDMA = "gpunodeagent.io/sriov_rdma"
SPEC = "gpu-node-agent-gpunodeagent.io-sriov_rdma.json"
KEY = "cdi.k8s.io/gpu-node-agent_gpunodeagent.io_sriov_rdma"
MakeManager = Callable[..., Awaitable[DevicePluginManager]]
# cncf-tags/container-device-interface pkg/parser/parser.go: kind vendor/class, device names alnum plus _-.:
_KIND = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_DEVICE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*[A-Za-z0-9]$")


async def test_spec_annotation_and_cleanup(sockdir: str, kubelet: LocalKubelet, make_manager: MakeManager,
                                           tmp_path: Path) -> None:
    config = dp_config(sockdir, serve_gpus=False, rdma_cdi=True)
    manager = await make_manager(config, cdi_spec_dir=str(tmp_path))
    spec = json.loads((tmp_path / SPEC).read_text())
    assert spec["cdiVersion"] == "0.5.0" and spec["kind"] == RDMA and _KIND.match(spec["kind"])
    names = [d["name"] for d in spec["devices"]]
    assert names == ["0000:1a:00.2", "0000:1a:00.3", "0000:1a:00.4", "0000:9a:00.2", "0000:9a:00.3", "0000:9a:00.4"]
    assert all(_DEVICE.match(n) for n in names)
    first = spec["devices"][0]["containerEdits"]["deviceNodes"]
    assert first == [{"path": "/dev/infiniband/uverbs1", "hostPath": "/dev/infiniband/uverbs1", "permissions": "rw"},
                     {"path": "/dev/infiniband/rdma_cm", "hostPath": "/dev/infiniband/rdma_cm", "permissions": "rw"}]

    await kubelet.wait_for(lambda: RDMA in kubelet.plugins and kubelet.plugins[RDMA].lists > 0)
    ids = (await kubelet.admit({RDMA: 2}))[RDMA]
    reply = kubelet.responses[RDMA]
    assert not reply.devices  # the runtime takes the nodes from the spec
    assert dict(reply.annotations) == {KEY: ",".join(f"{RDMA}={i}" for i in ids)}
    assert reply.envs["PCIDEVICE_GPUNODEAGENT_IO_SRIOV_RDMA"] == ",".join(ids)  # env and device-info stay
    assert len(os.listdir(config.device_info_dir)) == 2
    assert len(KEY.split("/", 1)[1]) <= 63

    await manager.update_topology(without_nic(small_topology(), "0000:1a:00.0"))  # the spec follows the pool
    assert [d["name"] for d in json.loads((tmp_path / SPEC).read_text())["devices"]] == [
        "0000:9a:00.2", "0000:9a:00.3", "0000:9a:00.4"]
    await manager.stop()
    assert os.listdir(tmp_path) == []


async def test_off_by_default(sockdir: str, kubelet: LocalKubelet, make_manager: MakeManager,
                              tmp_path: Path) -> None:
    await make_manager(dp_config(sockdir, serve_gpus=False), cdi_spec_dir=str(tmp_path))
    await kubelet.wait_for(lambda: RDMA in kubelet.plugins and kubelet.plugins[RDMA].lists > 0)
    await kubelet.admit({RDMA: 1})
    reply = kubelet.responses[RDMA]
    assert [d.host_path for d in reply.devices] == [reply.devices[0].host_path, "/dev/infiniband/rdma_cm"]
    assert not reply.annotations
    assert os.listdir(tmp_path) == []


async def test_specs_left_by_a_crashed_run_are_replaced(sockdir: str, kubelet: LocalKubelet,
                                                        make_manager: MakeManager, tmp_path: Path) -> None:
    (tmp_path / "gpu-node-agent-example.com-gone.json").write_text('{"cdiVersion":"0.5.0","kind":"example.com/gone"}')
    (tmp_path / "nvidia.yaml").write_text("cdiVersion: 0.5.0\nkind: nvidia.com/gpu\n")  # not ours: stays
    (tmp_path / "gpunodeagent.io-claim_1234.json").write_text("{}")  # the DRA driver's: stays
    manager = await make_manager(dp_config(sockdir, serve_gpus=False, rdma_cdi=True), cdi_spec_dir=str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == [SPEC, "gpunodeagent.io-claim_1234.json", "nvidia.yaml"]
    await manager.stop()
    assert sorted(os.listdir(tmp_path)) == ["gpunodeagent.io-claim_1234.json", "nvidia.yaml"]
