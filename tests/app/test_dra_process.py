"""A real `gpu-node-agent run --simulate ... --dra` process: the contract flags, registration with a stand-in
kubelet over the unix sockets, slices published, a claim allocated by the `matchAttribute` stand-in from them and
prepared into a CDI spec, a bad claim answered, a clean stop; once in memory and once against the API double."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from tests.app.agentproc import AgentProcess
from tests.dra.conftest import claim_template, device_classes
from tests.fakes.apiserver import ApiServerDouble, write_kubeconfig
from tests.fakes.dra_allocator import allocate
from tests.fakes.kubelet_dra import DraKubelet


def _sample(metrics: str, name: str, labels: str) -> float:
    match = re.search(rf"^{re.escape(name)}{{{re.escape(labels)}}} (\S+)$", metrics, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


async def test_dra_flags_registration_and_a_refused_claim(short_root: Path) -> None:
    (short_root / "dp").mkdir()
    (short_root / "registry").mkdir()
    agent = AgentProcess(short_root / "dp", "--dra", "--dra-driver-name", "gpunodeagent.io",
                         "--plugin-registry-dir", str(short_root / "registry"),
                         "--dra-plugin-dir", str(short_root / "plugin"), "--cdi-spec-dir", str(short_root / "cdi"),
                         "--state-dir", str(short_root / "state"))
    kubelet = DraKubelet(short_root / "registry")
    try:
        plugin = await kubelet.register("gpunodeagent.io", timeout=60)
        assert plugin.info.endpoint == str(short_root / "plugin" / "dra.sock")

        for _ in range(600):  # a guard against hangs, not a timing assertion
            text = await asyncio.to_thread(agent.metrics)
            if _sample(text, "gpu_node_agent_dra_slice_publishes_total", 'result="changed"') >= 1:
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail(f"slices never published:\n{agent.log_tail()}")

        response = await plugin.prepare(("default", "0f6b7f1e-1111-4a5b-9c3d-000000000009", "no-such-claim"))
        assert "not found" in response.claims["0f6b7f1e-1111-4a5b-9c3d-000000000009"].error
        text = await asyncio.to_thread(agent.metrics)
        assert _sample(text, "gpu_node_agent_dra_claims_total", 'call="prepare",result="error"') == 1
        assert 'gpu_node_agent_subsystem_up{subsystem="dra"} 1.0' in text
    finally:
        await kubelet.close()
        code = agent.stop()
    assert code == 0, agent.log_tail()
    assert not (short_root / "registry" / "gpunodeagent.io-reg.sock").exists()


async def test_dra_against_the_api_server(short_root: Path, api: ApiServerDouble) -> None:
    """--simulate simulates the hardware only: with --kubeconfig the slices and claims are the API server's."""
    for name in ("dp", "registry"):
        (short_root / name).mkdir()
    kubeconfig = write_kubeconfig(short_root / "kc", api.url)
    agent = AgentProcess(short_root / "dp", "--dra", "--plugin-registry-dir", str(short_root / "registry"),
                         "--dra-plugin-dir", str(short_root / "plugin"), "--cdi-spec-dir", str(short_root / "cdi"),
                         "--state-dir", str(short_root / "state"), "--kubeconfig", str(kubeconfig),
                         "--node-name", api.node_name, "--simulate", "vm-flat")
    kubelet = DraKubelet(short_root / "registry")
    uid = "0f6b7f1e-3333-4a5b-9c3d-000000000001"
    try:
        plugin = await kubelet.register("gpunodeagent.io", timeout=60)
        for _ in range(600):  # a guard against hangs, not a timing assertion
            if api.resource_slices:
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail(f"no slices:\n{agent.log_tail()}")
        claim = claim_template("gpu-vf-one-switch")
        allocation = allocate(claim, device_classes(), api.resource_slices.values())
        assert allocation is not None
        claim["metadata"] = {"name": "pair", "namespace": "default", "uid": uid}
        claim["status"] = {"allocation": allocation}
        api.put_claim(claim)
        answer = (await plugin.prepare(("default", uid, "pair"))).claims[uid]
        assert answer.error == "" and len(answer.devices) == 2
        spec = (short_root / "cdi" / f"gpunodeagent.io-claim_{uid}.json").read_text()
        bus = {d["name"]: d["attributes"]["resource.kubernetes.io/pciBusID"]["string"]
               for s in api.resource_slices.values() for d in s["spec"]["devices"]}
        gpu, vf = (bus[r["device"]] for r in allocation["devices"]["results"])
        assert int(vf[:4], 16) == int(gpu[:4], 16) + 0x100, (gpu, vf)  # vm-flat's XML: GPU n beside NIC n
        assert f"PCIDEVICE_GPUNODEAGENT_IO_SRIOV_RDMA={vf}" in spec
        assert (await plugin.unprepare(("default", uid, "pair"))).claims[uid].error == ""
        assert not (short_root / "cdi" / f"gpunodeagent.io-claim_{uid}.json").exists()
    finally:
        await kubelet.close()
        code = agent.stop()
    assert code == 0, agent.log_tail()
