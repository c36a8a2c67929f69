"""Every command opens the node the same way (issue 38, item 1): `config --pools` says what `run` registers, and
`topology` shows the MIG devices `run` serves.

`run` is a real agent process registering with the test's stand-in kubelet; what it registers (resources and the
devices each lists) is compared with `config --pools` for the same flags. Before `agent.node`, `config --pools`
read the topology without NVML's MIG facts: on dgx-h100-mig it listed 8 whole GPUs where `run` served 4 GPUs and
28 MIG devices.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from agent import cli
from agent.simulate.kubelet import LocalKubelet
from tests.app.agentproc import AgentProcess
from tests.fakes.polling import until

NVIDIA_DATA = Path(__file__).resolve().parents[1] / "deviceplugin" / "data" / "nvidia"
SRIOV_FILE = {"resourceList": [
    {"resourceName": "cx5_dpdk", "selectors": [{"vendors": ["15b3"], "devices": ["1018"], "drivers": ["vfio-pci"]}]},
    {"resourceName": "cx5_rdma", "selectors": {"isRdma": True}}]}


def _config_pools(capsys: pytest.CaptureFixture[str], profile: str, flags: list[str]) -> dict[str, list[str]]:
    assert cli.main(["config", "--pools", "--simulate", profile, *flags]) == 0
    shown: dict[str, list[str]] = yaml.safe_load(capsys.readouterr().out)["pools"]
    return shown


def _readyz(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as response:
            return str(response.read().decode())
    except urllib.error.HTTPError as exc:
        return str(exc.read().decode())
    except OSError:
        return "not listening"


async def _registered(directory: Path, profile: str, flags: list[str]) -> dict[str, set[str]]:
    """What `run --simulate PROFILE FLAGS` registers with the stand-in kubelet: resource -> the IDs it lists."""
    kubelet = LocalKubelet(directory)
    await kubelet.start()
    agent = AgentProcess(directory, *flags, profile=profile)
    try:
        # the device plugin says it is registered once every resource it serves is
        def registered() -> bool:
            text = _readyz(agent.port)
            return agent.process.poll() is not None or (text != "not listening" and "device-plugin" not in text)

        await until(registered, "the device plugin registered", timeout=60, interval=0.1)
        assert agent.process.poll() is None, agent.log_tail()
        await kubelet.wait_for(lambda: all(view.lists > 0 for view in kubelet.plugins.values()), timeout=30)
        return {name: set(view.devices) for name, view in kubelet.plugins.items()}
    finally:
        code = agent.stop()
        await kubelet.stop()
        assert code == 0, agent.log_tail()


CASES = {
    "dgx-h100": ("dgx-h100", []),
    "mig-none": ("dgx-h100-mig", ["--mig-strategy", "none"]),
    "mig-single": ("dgx-h100-mig", ["--mig-strategy", "single"]),
    "mig-mixed": ("dgx-h100-mig", ["--mig-strategy", "mixed"]),
    "time-sliced": ("dgx-h100", ["--nvidia-dp-config", str(NVIDIA_DATA / "readme-time-slicing.yaml")]),
    "sriov-file": ("pcie-pairs-dpdk", ["--sriov-dp-config", "{sriov}"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
async def test_config_pools_says_what_run_registers(case: str, capsys: pytest.CaptureFixture[str]) -> None:
    directory = Path(tempfile.mkdtemp(prefix="gna"))
    sriov = directory / "sriov.json"
    sriov.write_text(json.dumps(SRIOV_FILE))
    profile, flags = CASES[case]
    flags = [flag.format(sriov=sriov) for flag in flags]
    shown = await asyncio.to_thread(_config_pools, capsys, profile, flags)
    registered = await _registered(directory, profile, flags)
    # a pool without devices gets no server (as SR-IOV DP); every other pool is registered with these devices
    assert registered == {name: set(ids) for name, ids in shown.items() if ids}
    assert all(len(ids) == len(set(ids)) for ids in shown.values())


def test_config_pools_on_the_mig_node_shows_the_mig_devices(capsys: pytest.CaptureFixture[str]) -> None:
    """The observed bug, without a process: mixed serves 4 whole GPUs and 28 1g.10gb devices."""
    shown = _config_pools(capsys, "dgx-h100-mig", ["--mig-strategy", "mixed"])
    assert len(shown["nvidia.com/gpu"]) == 4
    assert len(shown["nvidia.com/mig-1g.10gb"]) == 28
    assert all(i.startswith("MIG-") for i in shown["nvidia.com/mig-1g.10gb"])


def test_topology_json_lists_each_mig_device_under_its_parent(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["topology", "--simulate", "dgx-h100-mig", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    migs = [(gpu, mig) for gpu in doc["gpus"] for mig in gpu["mig_devices"]]
    assert len(migs) == 28 and len({mig["uuid"] for _, mig in migs}) == 28
    for gpu, mig in migs:
        assert set(mig) == {"uuid", "profile", "gpu_instance", "compute_instance", "parent_uuid"}
        assert mig["parent_uuid"] == gpu["uuid"] and mig["uuid"].startswith("MIG-")
        assert mig["profile"] == "1g.10gb"
        assert isinstance(mig["gpu_instance"], int) and isinstance(mig["compute_instance"], int)
    parents = {gpu["index"] for gpu, _ in migs}
    assert parents == {0, 1, 2, 3}
    assert all(gpu["mig_devices"] == [] for gpu in doc["gpus"] if gpu["index"] not in parents)


def test_topology_table_names_each_mig_device_under_its_parent(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["topology", "--simulate", "dgx-h100-mig", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert cli.main(["topology", "--simulate", "dgx-h100-mig"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for gpu in doc["gpus"]:
        row = next(i for i, line in enumerate(lines) if line.strip().startswith(f"GPU{gpu['index']}:"))
        below = lines[row + 1: row + 1 + len(gpu["mig_devices"])]
        assert [m["uuid"] in line and m["profile"] in line for m, line in zip(gpu["mig_devices"], below,
                                                                             strict=True)] == \
            [True] * len(gpu["mig_devices"])


def test_topology_of_a_node_without_mig_keeps_its_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["topology", "--simulate", "dgx-h100", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == {"source", "gpus", "nics", "links"}
    assert set(doc["gpus"][0]) == {"index", "pci", "numa", "uuid", "pcie_root", "mig_devices", "gpu_direct_path",
                                   "gpu_direct_group"}  # the foundation's keys, MIG devices, GPUDirect locality
    assert all(gpu["mig_devices"] == [] for gpu in doc["gpus"])
