"""Xid -> cordon with device ownership, in a real agent process: what the composition root hands each subsystem.

`run --simulate pcie-pairs --kubeconfig K --pod-resources-socket SOCK --remediation --no-dry-run` beside the
test's stand-in kubelet: a pod holds a GPU, an Xid 79 on that GPU cordons the node, the node condition names the
pod holding it (remediation given ownership's `pods_of`) and the pod gets a `GpuDeviceUnhealthy` Event naming the
GPU's bus id (ownership's pod Events given the hardware's `gpu_of`).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from agent.simulate.kubelet import LocalKubelet
from agent.simulate.profiles import load_profile
from tests.app.agentproc import GPU_RESOURCE, start_on_api_double
from tests.fakes.kmsg import xid_record
from tests.fakes.polling import until

NODE = "laptop-gpu-0"


async def test_an_xid_on_a_held_gpu_names_its_pod_in_the_condition_and_tells_the_pod() -> None:
    directory = Path(tempfile.mkdtemp(prefix="gna"))
    socket = directory / "pr" / "kubelet.sock"
    kubelet = LocalKubelet(directory, pod_resources_socket=socket)
    await kubelet.start()
    try:
        agent, api, kmsg = await start_on_api_double(directory, NODE, "--pod-resources-socket", str(socket))
        try:
            await kubelet.wait_for(lambda: GPU_RESOURCE in kubelet.plugins and kubelet.plugins[GPU_RESOURCE].lists > 0,
                                   timeout=60)
            api.add_pod("ml", "trainer-0")
            gpu = (await kubelet.admit({GPU_RESOURCE: 1}, pod=("ml", "trainer-0")))[GPU_RESOURCE][0]
            bus_id = next(b for b, uuid in load_profile("pcie-pairs").gpu_uuids.items() if uuid == gpu)
            with kmsg.open("a") as handle:
                handle.write(xid_record(7001, bus_id, 79, "GPU has fallen off the bus."))

            def named() -> bool:
                condition = api.condition("GpuUnhealthy") or {}
                return condition.get("status") == "True" and "(pods: ml/trainer-0)" in condition.get("message", "")
            await until(named, "the condition naming the pod", timeout=60)
            await until(lambda: any(e["reason"] == "GpuDeviceUnhealthy" for e in api.events.values()),
                        "the pod's Event", timeout=30)
            told = [e for e in api.events.values() if e["reason"] == "GpuDeviceUnhealthy"]
            assert told[0]["involvedObject"]["name"] == "trainer-0"
            assert f"{gpu} (at {bus_id})" in told[0]["message"], told[0]["message"]
        finally:
            code = agent.stop()
            await api.stop()
        assert code == 0, agent.log_tail()
    finally:
        await kubelet.stop()
