"""CDI specs carry what the device plugin's Allocate gives a container for the same devices, so a workload sees
the same environment and device nodes whichever API placed it; and they are valid CDI."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from agent.config.model import DevicePluginConfig
from agent.deviceplugin.payload import AllocateOptions, build_container_payload
from agent.deviceplugin.pools import build_pools
from agent.dra.cdi import CdiError, CdiSpecs
from agent.dra.devices import node_devices
from tests.dra.conftest import DRIVER, RDMA_RESOURCE, profile_topology

UID = "0f6b7f1e-1111-4a5b-9c3d-000000000001"
_CDI_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")


@pytest.mark.parametrize("profile", ["dgx-h100", "pcie-pairs"])
def test_rdma_payload_matches_the_device_plugin(profile: str, tmp_path: Path,
                                                tmp_path_factory: pytest.TempPathFactory) -> None:
    topology = profile_topology(profile, tmp_path_factory)
    rdma = [d for d in node_devices(topology, RDMA_RESOURCE) if d.kind == "rdma"][:3]
    gpu = next(d for d in node_devices(topology, RDMA_RESOURCE) if d.kind == "gpu")
    specs = CdiSpecs(tmp_path, DRIVER, RDMA_RESOURCE)
    ids = specs.write(UID, [gpu, *rdma])
    spec = json.loads(specs.path(UID).read_text())
    env = dict(e.split("=", 1) for e in spec["containerEdits"]["env"])

    pools = build_pools(topology, DevicePluginConfig(serve_gpus=True)).by_name()
    nic_pool, gpu_pool = pools[RDMA_RESOURCE], pools["nvidia.com/gpu"]
    nic = build_container_payload(nic_pool, [nic_pool.device(d.bus_id) for d in rdma], AllocateOptions())
    gpus = build_container_payload(gpu_pool, [gpu_pool.device(gpu.gpu.uuid)], AllocateOptions())  # type: ignore
    assert env == {**nic.envs, **gpus.envs}
    nodes = {n["path"] for d in spec["devices"] for n in d["containerEdits"].get("deviceNodes", [])}
    assert nodes == set(nic.devices)

    assert ids == [f"{DRIVER}/claim={UID}-{d.name}" for d in (gpu, *rdma)]
    assert all(_CDI_NAME.match(d["name"]) and d["containerEdits"] for d in spec["devices"])
    assert spec["cdiVersion"] == "0.6.0" and spec["kind"] == f"{DRIVER}/claim"
    assert specs.remove(UID) and not specs.path(UID).exists() and not specs.remove(UID)
    assert list(tmp_path.iterdir()) == []  # no temporary file left behind


@pytest.mark.parametrize("uid", ["", "../x", "a/b", "x" * 80, "not a uid"])
def test_unsafe_uids_never_reach_a_path(uid: str, tmp_path: Path) -> None:
    with pytest.raises(CdiError):
        CdiSpecs(tmp_path, DRIVER, RDMA_RESOURCE).path(uid)


def test_mig_payload_matches_the_device_plugin(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A MIG device's claim gets what NVIDIA's plugin passes for it with passDeviceSpecs (one builder, both APIs):
    its MIG UUID, the parent's /dev/nvidia<minor> and its GI and CI capability nodes, host paths under dev_root."""
    from agent.deviceplugin.nvidia import GpuServing, gpu_payload

    topology = profile_topology("dgx-h100-mig", tmp_path_factory)
    migs = [d for d in node_devices(topology, RDMA_RESOURCE) if d.kind == "mig"]
    chosen = [migs[2], migs[9]]  # GPU 0's third and GPU 1's third MIG device
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "nvidia-uvm").touch()
    minors = tmp_path / "mig-minors"
    minors.write_text("config 1\nmonitor 2\ngpu0/gi3/access 30\ngpu0/gi3/ci0/access 31\n"
                      "gpu1/gi3/access 165\ngpu1/gi3/ci0/access 166\n")
    specs = CdiSpecs(tmp_path / "cdi", DRIVER, RDMA_RESOURCE, dev_root=str(tmp_path), mig_minors=str(minors))
    specs.write(UID, chosen)
    spec = json.loads(specs.path(UID).read_text())
    nodes = {(n["path"], n["hostPath"]) for d in spec["devices"] for n in d["containerEdits"]["deviceNodes"]}

    served = [(d.gpu, d.mig) for d in chosen if d.gpu is not None]
    plugin = gpu_payload(served, GpuServing(pass_device_specs=True, dev_root=str(tmp_path), mig_minors=str(minors)))
    env = dict(e.split("=", 1) for e in spec["containerEdits"]["env"])
    assert env == plugin.envs == {"NVIDIA_VISIBLE_DEVICES": ",".join(d.mig.uuid for d in chosen if d.mig)}
    assert nodes == set(plugin.devices)
    assert {path for path, _ in nodes} == {"/dev/nvidia-uvm", "/dev/nvidia0", "/dev/nvidia1",
                                           "/dev/nvidia-caps/nvidia-cap30", "/dev/nvidia-caps/nvidia-cap31",
                                           "/dev/nvidia-caps/nvidia-cap165", "/dev/nvidia-caps/nvidia-cap166"}
