"""The SR-IOV network device plugin's config.json, as published in its documentation, serves the same pools.

Samples are verbatim files from k8snetworkplumbingwg/sriov-network-device-plugin (see data/sriovdp/SOURCES.md).
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from agent.config.model import DevicePluginConfig, PoolConfig, SelectorConfig
from agent.deviceplugin.pools import build_pools
from agent.deviceplugin.sriovdp import SriovConfigError, apply, read_config
from agent.simulate.kubelet import LocalKubelet
from agent.topology.model import Location, Nic, PciInfo, RdmaCharDevices, RdmaPort, Topology, Vf
from tests.deviceplugin.conftest import dp_config, small_topology
from tests.fakes.cli import run_agent

DATA = Path(__file__).parent / "data" / "sriovdp"


def _config_json(configmap: str, tmp_path: Path) -> Path:
    """The `config.json` key of a published ConfigMap, written where `--sriov-dp-config` can read it."""
    data = yaml.safe_load((DATA / configmap).read_text())["data"]["config.json"]
    path = tmp_path / "config.json"
    path.write_text(data)
    return path


def _intel_pf() -> Nic:
    """An E810 PF (ice) with two iavf VFs (device 1889) that have RDMA devices (irdma)."""
    vfs = tuple(
        Vf(pci=PciInfo(bus_id=f"0000:3b:01.{i}", vendor="0x8086", device="0x1889", pci_class="0x020000",
                       driver="iavf"),
           pf_bus_id="0000:3b:00.0", vf_index=i, rdma=f"iavf_rdma{i}", netdevs=(f"ens1f0v{i}",),
           link_type="ether", chardevs=RdmaCharDevices(uverbs=f"uverbs{40 + i}"))
        for i in range(2))
    return Nic(pci=PciInfo(bus_id="0000:3b:00.0", vendor="0x8086", device="0x1592", pci_class="0x020000",
                           driver="ice"),
               location=Location(root="pci0000:3a", numa=0), rdma="irdma0", netdevs=("ens1f0",),
               link_type="ether", sriov_totalvfs=8, vfs=vfs,
               ports=(RdmaPort(number=1, state="ACTIVE", link_layer="Ethernet"),))


def cx5_topology() -> Topology:
    """The small test node with ConnectX-5 VFs (device 1018) and an Intel E810 PF with iavf VFs."""
    base = small_topology()
    nics = []
    for nic in base.nics:
        vfs = tuple(replace(vf, pci=replace(vf.pci, device="0x1018")) for vf in nic.vfs)
        nics.append(replace(nic, vfs=vfs))
    return replace(base, nics=(*nics, _intel_pf()))


def _served(config: DevicePluginConfig, topology: Topology) -> dict[str, tuple[str, ...]]:
    return {name: pool.ids for name, pool in build_pools(topology, config).by_name().items() if pool.kind == "nic"}


NATIVE_EQUIVALENT = [
    PoolConfig(resource_name="mlnx_rdma", resource_prefix="mellanox.com",
               selectors=SelectorConfig(vendors=["15b3"], devices=["1016", "1018"], drivers=["mlx5_core"],
                                        is_rdma=True)),
    PoolConfig(resource_name="intel_rdma", resource_prefix="intel.com",
               selectors=SelectorConfig(vendors=["8086"], devices=["1889"], drivers=["iavf"], is_rdma=True)),
]


def test_documented_rdma_config_serves_what_the_native_config_serves(tmp_path: Path) -> None:
    path = _config_json("docs-rdma-configMap.yaml", tmp_path)
    topology = cx5_topology()
    from_file = _served(apply(DevicePluginConfig(sriov_dp_config=str(path))), topology)
    native = _served(DevicePluginConfig(pools=NATIVE_EQUIVALENT), topology)
    assert from_file == native
    assert from_file == {
        "mellanox.com/mlnx_rdma": ("0000:1a:00.2", "0000:1a:00.3", "0000:1a:00.4",
                                   "0000:9a:00.2", "0000:9a:00.3", "0000:9a:00.4"),
        "intel.com/intel_rdma": ("0000:3b:01.0", "0000:3b:01.1"),  # object form, no prefix: intel.com
    }


async def test_documented_config_registers_the_same_resources_and_ids(tmp_path: Path, sockdir: str,
                                                                      make_manager: object) -> None:
    """Through the stand-in kubelet: the same resource names and device IDs as with the native config."""
    path = _config_json("docs-rdma-configMap.yaml", tmp_path)
    seen: list[dict[str, set[str]]] = []
    for n, config in enumerate((dp_config(sockdir, serve_gpus=False, sriov_dp_config=str(path)),
                                dp_config(sockdir, serve_gpus=False, pools=NATIVE_EQUIVALENT))):
        directory = Path(sockdir) / str(n)
        kubelet = LocalKubelet(directory)
        await kubelet.start()
        try:
            manager = await make_manager(replace(config, device_plugin_dir=str(directory)),  # type: ignore[operator]
                                         cx5_topology())
            await kubelet.wait_for(lambda k=kubelet: len(k.plugins) == 2 and all(  # type: ignore[misc]
                v.lists for v in k.plugins.values()))
            seen.append({name: set(view.devices) for name, view in kubelet.plugins.items()})
            await manager.stop()
        finally:
            await kubelet.stop()
    assert seen[0] == seen[1]
    assert sorted(seen[0]) == ["intel.com/intel_rdma", "mellanox.com/mlnx_rdma"]


def test_deployment_configmap_defaults_prefix_and_keeps_empty_pools(tmp_path: Path) -> None:
    path = _config_json("deployments-configMap.yaml", tmp_path)
    read = read_config(str(path))
    assert [f"{p.resource_prefix}/{p.resource_name}" for p in read.pools] == [
        "intel.com/intel_sriov_netdevice", "intel.com/intel_sriov_dpdk", "intel.com/mlnx_sriov_rdma",
        "intel.com/brcm_sriov_bnxt"]
    assert read.warnings == ()
    served = _served(apply(DevicePluginConfig(sriov_dp_config=str(path))), cx5_topology())
    assert served["intel.com/intel_sriov_netdevice"] == ("0000:3b:01.0", "0000:3b:01.1")
    assert served["intel.com/mlnx_sriov_rdma"] == ()  # drivers: mlx5_ib; our VFs are bound to mlx5_core


def test_readme_example_is_refused_with_the_reason(tmp_path: Path) -> None:
    text = (DATA / "README-config.json").read_text()
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(SriovConfigError, match=r"not valid JSON: .* at line \d+ column \d+"):
        read_config(str(path))
    path.write_text(text.replace('"drivers": ["bnxt_en"]\n            }],', '"drivers": ["bnxt_en"]\n            }]'))
    with pytest.raises(SriovConfigError, match=r"resourceList\[1\] \(intel_sriov_dpdk\)\.selectors\[0\]"
                                               r"\.needVhostNet: vhost-net devices are not served"):
        read_config(str(path))


@pytest.mark.parametrize(("resource", "message"), [
    ({"resourceName": "a", "deviceType": "accelerator", "selectors": [{"vendors": ["8086"]}]},
     r"deviceType 'accelerator' is not served"),
    ({"resourceName": "a", "selectors": [{"ddpProfiles": ["GTPv1-C/U IPv4/IPv6 payload"]}]},
     r"selector ddpProfiles is not supported"),
    ({"resourceName": "a", "selectors": [{"pKeys": ["0x1"]}]}, r"selector pKeys is not supported"),
    ({"resourceName": "a", "selectors": [{"vdpaType": "vhost"}]}, r"selector vdpaType is not supported"),
    ({"resourceName": "a", "selectors": {"vendors": "8086"}}, r"selectors\.vendors: expected a list of strings"),
    ({"resourceName": "a", "selectors": {"isRdma": "yes"}}, r"selectors\.isRdma: expected true or false"),
    ({"selectors": {"vendors": ["8086"]}}, r"resourceList\[0\]: resourceName is required"),
    ({"resourceName": "bad-name!", "selectors": {}}, r"resource name 'bad-name!'"),
    ({"resourceName": "a", "resourcePrefix": "kubernetes.io", "selectors": {}}, r"kubernetes.io names"),
])
def test_what_cannot_be_served_is_an_error_naming_the_key(tmp_path: Path, resource: dict[str, object],
                                                         message: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"resourceList": [resource]}))
    with pytest.raises(SriovConfigError, match=message):
        read_config(str(path))


def test_duplicate_and_missing_file_are_errors(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"resourceList": [{"resourceName": "a", "selectors": {}},
                                                 {"resourceName": "a", "selectors": [{}]}]}))
    with pytest.raises(SriovConfigError, match=r"intel\.com/a is configured twice"):
        read_config(str(path))
    with pytest.raises(SriovConfigError, match="cannot read"):
        read_config(str(tmp_path / "absent.json"))
    path.write_text("[]")
    with pytest.raises(SriovConfigError, match="top level"):
        read_config(str(path))


def test_per_node_example_keys_match_case_insensitively(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """docs/config-file/README.md's per-node config: `IsRdma`, `NeedVhostNet` and `SelectorObj` as written there."""
    per_node = ('{"resourceList":[{"resourceName":"sriovnics","selectors":{"pfNames":["ens785f0#0-4",'
                '"ens785f1#0-9"],"IsRdma":false,"NeedVhostNet":false},"SelectorObj":null}]}')
    path = tmp_path / "sriov-node-0"
    path.write_text(per_node)
    with caplog.at_level(logging.WARNING):
        config = apply(DevicePluginConfig(sriov_dp_config=str(path)))
    (pool,) = config.pools
    assert pool.resource_prefix == "intel.com"
    assert pool.selectors.pf_names == ["ens785f0#0-4", "ens785f1#0-9"]
    assert pool.selectors.is_rdma is None  # false is no filter
    assert "SelectorObj: unknown key" in caplog.text


def test_is_rdma_false_is_no_filter_and_list_form_is_a_union(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"resourcePrefix": "x", "resourceList": [
        {"resourceName": "ib_first_two", "resourcePrefix": "nvidia.com",
         "selectors": [{"pfNames": ["ibp26s0#0-1"]}, {"rootDevices": ["0000:9a:00.0#2"]}]},
        {"resourceName": "everything_else", "resourcePrefix": "nvidia.com",
         "selectors": [{"isRdma": False}]},
        {"resourceName": "rdma_only", "resourcePrefix": "nvidia.com", "selectors": [{"isRdma": True}]},
    ]}))
    read = read_config(str(path))
    assert read.warnings == ("resourcePrefix: unknown key, ignored",)  # a prefix belongs to each resource
    served = _served(replace(DevicePluginConfig(), pools=list(read.pools)), cx5_topology())
    assert served["nvidia.com/ib_first_two"] == ("0000:1a:00.2", "0000:1a:00.3", "0000:9a:00.4")
    # isRdma false: every remaining function, RDMA or not (the VF-less Ethernet PF included)
    assert served["nvidia.com/everything_else"] == ("0000:1a:00.4", "0000:3b:01.0", "0000:3b:01.1",
                                                    "0000:9a:00.2", "0000:9a:00.3", "0000:c1:00.0")
    assert served["nvidia.com/rdma_only"] == ()  # first matching pool wins


def test_resource_level_is_rdma_is_ignored_with_a_warning(tmp_path: Path) -> None:
    """The old README form put isRdma beside resourceName; today's plugin ignores it there."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"resourceList": [
        {"resourceName": "mlnx_sriov_rdma", "resourcePrefix": "mellanox.com", "isRdma": True,
         "selectors": {"vendors": ["15b3"]}, "additionalInfo": {"*": {"token": "x"}}}]}))
    read = read_config(str(path))
    assert read.pools[0].selectors.is_rdma is None
    assert any("isRdma belongs inside selectors" in w for w in read.warnings)
    assert any("additionalInfo: not supported" in w for w in read.warnings)


def test_config_command_shows_the_pools_and_names_problems(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from agent import cli

    path = _config_json("docs-rdma-configMap.yaml", tmp_path)
    assert cli.main(["config", "--sriov-dp-config", str(path)]) == 0
    dumped = yaml.safe_load(capsys.readouterr().out)
    assert [p["resourceName"] for p in dumped["devicePlugin"]["pools"]] == ["mlnx_rdma", "intel_rdma"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"resourceList": [{"resourceName": "a", "selectors": {"pKeys": ["0x1"]}}]}))
    assert cli.main(["config", "--sriov-dp-config", str(bad)]) == 2
    assert "selector pKeys is not supported" in capsys.readouterr().err


def _resource(**selectors: object) -> dict[str, object]:
    return {"resourceName": "a", "selectors": selectors}


def _file(resources: list[object]) -> bytes:
    return json.dumps({"resourceList": resources}).encode()


_DEEP_VALUE = json.dumps(_resource(vendors="X")).replace('"X"', "[" * 990 + "]" * 990).encode()


@pytest.mark.parametrize(("data", "message"), [
    # issue 27, item 5: each of these was a traceback (exit 1) or minutes and a gigabyte
    (b"[" * 100_000 + b"]" * 100_000, "nested more deeply"),
    (b'{"resourceList": [' + _DEEP_VALUE + b"]}", "nested more deeply"),
    (b'{"resourceList": [{"resourceName": "caf\xe9"}]}', "not UTF-8"),
    (b'{"resourceList": [], "x": ' + b"9" * 100_000 + b"}", "larger than any setting"),
    (b'{"resourceList": [], "x": NaN}', "not a finite number"),
    (b" " * ((1 << 20) + 1), "larger than 1048576 bytes"),
    (_file([{"resourceName": f"r{i}", "selectors": {}} for i in range(257)]), "more than one node serves"),
    (_file([{"resourceName": "a", "selectors": [{}] * 65}]), "more than any pool needs"),
    (_file([_resource(vendors=["15b3"] * 1025)]), "more than any selector needs"),
    # VF ranges that matched nothing were silently dropped
    (_file([_resource(pfNames=["ens1f0#5-2"])]), "'5-2' runs backwards"),
    (_file([_resource(rootDevices=["0000:18:00.0#0-x"])]), "'0-x' is not a VF index"),
    (_file([_resource(pfNames=["#3"])]), "names nothing before '#'"),
], ids=["deep-file", "deep-value", "latin1", "100k-digits", "nan", "over-1MiB", "257-resources", "65-selectors",
        "1025-vendors", "range-backwards", "range-junk", "range-no-name"])
@pytest.mark.parametrize("command", ["config", "run"])
def test_hostile_sriov_files_exit_2_with_one_line(tmp_path: Path, data: bytes, message: str, command: str) -> None:
    """A process of its own, so that a `run` that accepted the file (before issue 27) fails the test by its timeout
    instead of running the agent inside the test process."""
    path = tmp_path / "config.json"
    path.write_bytes(data)
    done = run_agent(command, "--sriov-dp-config", str(path))  # 200 MB took over 60 s: the timeout fails that
    assert done.returncode == 2, done.stderr[-2000:]
    err = done.stderr
    assert message in err and "Traceback" not in err and err.count("\n") == 1
    assert f"SR-IOV device plugin config {path}" in err


def test_every_refused_pool_is_named_in_one_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 29: the upstream README config took five runs to show its refused pools; one run names them all."""
    from agent import cli

    text = (DATA / "README-config.json").read_text()
    path = tmp_path / "config.json"
    path.write_text(text.replace('"drivers": ["bnxt_en"]\n            }],', '"drivers": ["bnxt_en"]\n            }]'))
    with pytest.raises(SriovConfigError) as refused:
        read_config(str(path))
    lines = str(refused.value).splitlines()
    assert len(lines) >= 2, lines  # several pools refused, each on its own line
    assert any("needVhostNet" in line for line in lines)
    assert all(line.startswith(f"SR-IOV device plugin config {path}: resourceList[") for line in lines)
    assert cli.main(["config", "--sriov-dp-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert all(line in err for line in lines[:-1])


def test_resource_prefix_is_the_default_prefix_of_sriov_pools(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 29: the SR-IOV plugin's `-resource-prefix` (the SR-IOV Network Operator sets it) carries over as
    `--resource-prefix`; a pool's own resourcePrefix wins; unset, intel.com as there."""
    from agent import cli

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"resourceList": [
        {"resourceName": "rdma_a", "selectors": {"vendors": ["15b3"], "isRdma": True}},
        {"resourceName": "rdma_b", "resourcePrefix": "nvidia.com", "selectors": {"vendors": ["15b3"]}}]}))
    assert cli.main(["config", "--sriov-dp-config", str(path), "--resource-prefix", "example.com"]) == 0
    pools = yaml.safe_load(capsys.readouterr().out)["devicePlugin"]["pools"]
    assert [(p["resourcePrefix"], p["resourceName"]) for p in pools] == [("example.com", "rdma_a"),
                                                                         ("nvidia.com", "rdma_b")]
    assert cli.main(["config", "--sriov-dp-config", str(path)]) == 0
    pools = yaml.safe_load(capsys.readouterr().out)["devicePlugin"]["pools"]
    assert [(p["resourcePrefix"], p["resourceName"]) for p in pools] == [("intel.com", "rdma_a"),
                                                                         ("nvidia.com", "rdma_b")]
    served = _served(apply(DevicePluginConfig(sriov_dp_config=str(path), resource_prefix="example.com")),
                     cx5_topology())
    assert "example.com/rdma_a" in served and "nvidia.com/rdma_b" in served
