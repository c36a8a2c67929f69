"""GPU Allocate payloads match NVIDIA k8s-device-plugin's documented output for each option.

Expected values are transcribed from NVIDIA/k8s-device-plugin internal/plugin/server.go (`getAllocateResponse`,
`updateResponseForCDI`, `updateResponseForDeviceMounts`, `apiDeviceSpecs`) and dropin.md sections 1.3 and 1.4;
they are written out literally below, not computed with the agent's code.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path

import pytest

from agent.config.load import ConfigError, from_mapping
from agent.config.model import DevicePluginConfig
from agent.deviceplugin.manager import DevicePluginManager
from agent.deviceplugin.nvidia import GpuServing, GpuServingError, gpu_payload, parse_strategies
from agent.deviceplugin.v1beta1 import api_pb2
from agent.simulate.kubelet import LocalKubelet
from agent.topology.model import Topology
from tests.deviceplugin.conftest import GPU_UUIDS, dp_config, small_topology

GPU = "nvidia.com/gpu"
MakeManager = Callable[..., Awaitable[DevicePluginManager]]
ANNOTATION = re.compile(r"^cdi\.k8s\.io/nvidia-device-plugin_[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-"
                        r"[0-9a-f]{12}$")


def with_minors(topology: Topology, mig: tuple[int, ...] = ()) -> Topology:
    """GPU i has device minor i (the driver numbers them in probe order); GPUs in `mig` are in MIG mode."""
    return replace(topology, gpus=tuple(replace(g, minor=g.index, mig_enabled=g.index in mig)
                                        for g in topology.gpus))


def _reply(kubelet: LocalKubelet) -> api_pb2.ContainerAllocateResponse:
    return kubelet.responses[GPU]


async def _allocate(kubelet: LocalKubelet, make_manager: MakeManager, sockdir: str,
                    **settings: object) -> tuple[list[str], api_pb2.ContainerAllocateResponse]:
    await make_manager(dp_config(sockdir, **settings), with_minors(small_topology()))
    await kubelet.wait_for(lambda: GPU in kubelet.plugins and kubelet.plugins[GPU].lists > 0)
    ids = (await kubelet.admit({GPU: 2}))[GPU]
    return ids, _reply(kubelet)


def _index(uuid: str) -> str:
    return str(GPU_UUIDS.index(uuid))


async def test_envvar_uuid_is_the_default(sockdir: str, kubelet: LocalKubelet, make_manager: MakeManager) -> None:
    ids, reply = await _allocate(kubelet, make_manager, sockdir)
    assert dict(reply.envs) == {"NVIDIA_VISIBLE_DEVICES": ",".join(ids)}
    assert not reply.mounts and not reply.devices and not reply.annotations and not reply.cdi_devices


async def test_envvar_index(sockdir: str, kubelet: LocalKubelet, make_manager: MakeManager) -> None:
    ids, reply = await _allocate(kubelet, make_manager, sockdir, device_id_strategy="index")
    assert dict(reply.envs) == {"NVIDIA_VISIBLE_DEVICES": ",".join(_index(i) for i in ids)}
    assert all(i.startswith("GPU-") for i in ids)  # the kubelet's device IDs stay UUIDs


async def test_volume_mounts(sockdir: str, kubelet: LocalKubelet, make_manager: MakeManager) -> None:
    ids, reply = await _allocate(kubelet, make_manager, sockdir, device_list_strategy=["volume-mounts"])
    assert dict(reply.envs) == {"NVIDIA_VISIBLE_DEVICES": "/var/run/nvidia-container-devices"}
    assert [(m.container_path, m.host_path, m.read_only) for m in reply.mounts] == [
        (f"/var/run/nvidia-container-devices/{i}", "/dev/null", False) for i in ids]
    assert not reply.devices and not reply.annotations and not reply.cdi_devices


async def test_envvar_and_volume_mounts(sockdir: str, kubelet: LocalKubelet, make_manager: MakeManager) -> None:
    ids, reply = await _allocate(kubelet, make_manager, sockdir, device_list_strategy=["envvar", "volume-mounts"],
                                 device_id_strategy="index")
    assert dict(reply.envs) == {"NVIDIA_VISIBLE_DEVICES": "/var/run/nvidia-container-devices"}
    assert [m.container_path for m in reply.mounts] == [f"/var/run/nvidia-container-devices/{_index(i)}"
                                                        for i in ids]


async def test_cdi_annotations_only(sockdir: str, kubelet: LocalKubelet, make_manager: MakeManager) -> None:
    ids, reply = await _allocate(kubelet, make_manager, sockdir, device_list_strategy=["cdi-annotations"])
    ((key, value),) = reply.annotations.items()
    assert ANNOTATION.match(key), key  # one fresh UUID per Allocate: 57 characters after the prefix
    assert value == ",".join(f"nvidia.com/gpu={i}" for i in ids)
    assert not reply.envs and not reply.mounts and not reply.devices and not reply.cdi_devices
    await kubelet.admit({GPU: 1})
    assert next(iter(_reply(kubelet).annotations)) != key


async def test_cdi_cri_with_index_ids(sockdir: str, kubelet: LocalKubelet, make_manager: MakeManager) -> None:
    ids, reply = await _allocate(kubelet, make_manager, sockdir, device_list_strategy=["cdi-cri"],
                                 device_id_strategy="index")
    assert [d.name for d in reply.cdi_devices] == [f"nvidia.com/gpu={_index(i)}" for i in ids]
    assert not reply.envs and not reply.annotations and not reply.devices


async def test_custom_annotation_prefix_and_kind(sockdir: str, kubelet: LocalKubelet,
                                                 make_manager: MakeManager) -> None:
    """GPU Operator uses nvidia.cdi.k8s.io/ so that the NVIDIA runtime injects (containerd < 1.7)."""
    ids, reply = await _allocate(kubelet, make_manager, sockdir, device_list_strategy=["envvar", "cdi-annotations"],
                                 cdi_annotation_prefix="nvidia.cdi.k8s.io/",
                                 gpu_cdi_kind="k8s.device-plugin.nvidia.com/gpu")
    ((key, value),) = reply.annotations.items()
    assert key.startswith("nvidia.cdi.k8s.io/nvidia-device-plugin_")
    assert value == ",".join(f"k8s.device-plugin.nvidia.com/gpu={i}" for i in ids)
    assert dict(reply.envs) == {"NVIDIA_VISIBLE_DEVICES": ",".join(ids)}  # not every strategy is CDI


async def test_pass_device_specs(sockdir: str, kubelet: LocalKubelet, make_manager: MakeManager) -> None:
    ids, reply = await _allocate(kubelet, make_manager, sockdir, pass_device_specs=True)
    nodes = [(d.container_path, d.host_path, d.permissions) for d in reply.devices]
    control = [n for n in nodes if not re.match(r"/dev/nvidia\d+$", n[0])]
    assert all(Path(path).exists() for path, _, _ in control)  # only those present on this machine
    assert [n for n in nodes if n not in control] == [(f"/dev/nvidia{_index(i)}", f"/dev/nvidia{_index(i)}", "rw")
                                                     for i in ids]
    assert dict(reply.envs) == {"NVIDIA_VISIBLE_DEVICES": ",".join(ids)}


def test_device_specs_list_existing_control_nodes_under_the_dev_root(tmp_path: Path) -> None:
    """apiDeviceSpecs: nvidiactl, nvidia-uvm, nvidia-uvm-tools, nvidia-modeset when present, then one per GPU."""
    (tmp_path / "dev").mkdir()
    for name in ("nvidiactl", "nvidia-uvm", "nvidia-modeset"):  # no nvidia-uvm-tools on this node
        (tmp_path / "dev" / name).touch()
    gpus = with_minors(small_topology()).gpus
    payload = gpu_payload([gpus[3], gpus[1]], GpuServing(pass_device_specs=True, dev_root=str(tmp_path)))
    root = str(tmp_path)
    assert payload.devices == [("/dev/nvidiactl", f"{root}/dev/nvidiactl"),
                               ("/dev/nvidia-uvm", f"{root}/dev/nvidia-uvm"),
                               ("/dev/nvidia-modeset", f"{root}/dev/nvidia-modeset"),
                               ("/dev/nvidia3", f"{root}/dev/nvidia3"), ("/dev/nvidia1", f"{root}/dev/nvidia1")]
    cdi_only = gpu_payload(gpus[:1], GpuServing(device_list_strategy=("cdi-cri",), pass_device_specs=True,
                                                dev_root=root))
    assert cdi_only.devices == [] and cdi_only.envs == {}  # all-CDI: no device specs either


@pytest.mark.parametrize(("values", "message"), [
    (["envvar", "bogus"], "unknown bogus"), ([], "at least one"), (["", " "], "at least one")])
def test_strategies_are_checked(values: list[str], message: str) -> None:
    with pytest.raises(GpuServingError, match=message):
        parse_strategies(values)


@pytest.mark.parametrize(("section", "message"), [
    ({"deviceListStrategy": "envvar,bogus"}, "deviceListStrategy: bogus"),
    ({"deviceIdStrategy": "serial"}, "not one of uuid, index"),
    ({"cdiAnnotationPrefix": "cdi.k8s.io"}, "must end with '/'"),
])
def test_config_refuses_what_nvidia_refuses(section: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        from_mapping(DevicePluginConfig, section, "devicePlugin")


def test_comma_separated_strategies_from_config() -> None:
    config = from_mapping(DevicePluginConfig, {"deviceListStrategy": "envvar, cdi-annotations"})
    assert config.device_list_strategy == ["envvar", "cdi-annotations"]


async def test_mig_strategy_none_serves_mig_gpus_whole(sockdir: str, kubelet: LocalKubelet,
                                                       make_manager: MakeManager) -> None:
    """NVIDIA's default (migStrategy none): a GPU in MIG mode is still served as a whole GPU (device_map.go
    buildGPUDeviceMap skips MIG-enabled GPUs only under single and mixed)."""
    manager = await make_manager(dp_config(sockdir), with_minors(small_topology(), mig=(1,)))
    await kubelet.wait_for(lambda: GPU in kubelet.plugins and kubelet.plugins[GPU].lists > 0)
    assert set(kubelet.plugins[GPU].devices) == set(GPU_UUIDS)
    assert manager.metrics.registry.get_sample_value("gpu_node_agent_devices_not_served", {"reason": "mig"}) == 0


async def test_missing_gpu_cdi_spec_is_one_warning(sockdir: str, kubelet: LocalKubelet, make_manager: MakeManager,
                                                   caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    with caplog.at_level(logging.WARNING):
        await make_manager(dp_config(sockdir, device_list_strategy=["cdi-cri"]), cdi_spec_dir=str(tmp_path))
    assert caplog.text.count("no CDI spec of kind nvidia.com/gpu") == 1
    caplog.clear()
    # the head of a spec as `nvidia-ctk cdi generate` writes it (NVIDIA container toolkit docs, "CDI support")
    (tmp_path / "nvidia.yaml").write_text('cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n- name: "0"\n'
                                          '  containerEdits:\n    deviceNodes:\n    - path: /dev/nvidia0\n')
    with caplog.at_level(logging.WARNING):
        await make_manager(dp_config(sockdir + "/b", device_list_strategy=["cdi-cri"]), cdi_spec_dir=str(tmp_path))
    assert "no CDI spec" not in caplog.text


async def test_nvidias_environment_name_changes_the_payload_as_the_agents_flag_does(
        sockdir: str, kubelet: LocalKubelet, make_manager: MakeManager) -> None:
    """Issue 29: DEVICE_LIST_STRATEGY (NVIDIA's DaemonSet environment, carried over as it is) is read as
    GPU_NODE_AGENT_DEVICE_LIST_STRATEGY; the agent's own name wins when both are set."""
    from agent.config.load import load

    loaded = load(None, {"DEVICE_LIST_STRATEGY": "volume-mounts", "DEVICE_ID_STRATEGY": "index"}).device_plugin
    ids, reply = await _allocate(kubelet, make_manager, sockdir, device_list_strategy=loaded.device_list_strategy,
                                 device_id_strategy=loaded.device_id_strategy)
    assert dict(reply.envs) == {"NVIDIA_VISIBLE_DEVICES": "/var/run/nvidia-container-devices"}
    assert [m.container_path for m in reply.mounts] == [f"/var/run/nvidia-container-devices/{_index(i)}"
                                                        for i in ids]
    both = load(None, {"DEVICE_LIST_STRATEGY": "volume-mounts", "GPU_NODE_AGENT_DEVICE_LIST_STRATEGY": "envvar"})
    assert both.device_plugin.device_list_strategy == ["envvar"]


@pytest.mark.parametrize(("env", "check"), [
    ({"FAIL_ON_INIT_ERROR": "true"}, lambda c: c.health.require_nvml is True),
    ({"PASS_DEVICE_SPECS": "true"}, lambda c: c.device_plugin.pass_device_specs is True),
    ({"CDI_ANNOTATION_PREFIX": "nvidia.cdi.k8s.io/"},
     lambda c: c.device_plugin.cdi_annotation_prefix == "nvidia.cdi.k8s.io/"),
    ({"KUBELET_SOCKET": "/var/lib/k/dp/kubelet.sock"}, lambda c: c.device_plugin.device_plugin_dir == "/var/lib/k/dp"),
    ({"DP_DISABLE_HEALTHCHECKS": "109,63"}, lambda c: c.health.xid_actions == ["109=none", "63=none"]),
    ({"MIG_STRATEGY": "none", "NVIDIA_DRIVER_ROOT": "/run/nvidia/driver"}, lambda c: True),
    ({"MIG_STRATEGY": "mixed"}, lambda c: c.device_plugin.mig_strategy == "mixed"),
    ({"MIG_STRATEGY": "single", "GPU_NODE_AGENT_MIG_STRATEGY": "none"},
     lambda c: c.device_plugin.mig_strategy == "none"),
])
def test_nvidias_environment_names_are_aliases(env: dict[str, str], check: Callable[..., bool]) -> None:
    from agent.config.load import load

    assert check(load(None, env))


def test_an_unknown_mig_strategy_is_refused() -> None:
    from agent.config.load import load

    with pytest.raises(ConfigError, match="migStrategy: 'partial' is not one of none, single, mixed"):
        load(None, {"MIG_STRATEGY": "partial"})


@pytest.mark.parametrize("env", [{"GDS_ENABLED": "true"},
                                 {"IMEX_REQUIRED": "true"}, {"DP_DISABLE_HEALTHCHECKS": "109;rm"}])
def test_nvidia_settings_the_agent_cannot_serve_are_refused_by_name(env: dict[str, str]) -> None:
    from agent.config.load import load

    with pytest.raises(ConfigError, match=next(iter(env))):
        load(None, env)
