"""`run --simulate dgx-h100 --pod-resources-socket SOCK`: the agent process reads who holds which device from the
test's stand-in kubelet over the PodResources v1 socket and publishes it on /metrics; the kubelet going away and
coming back is `gpu_node_agent_pod_resources_up` 0 then 1, never a crash.
"""

from __future__ import annotations

import asyncio
import re
import tempfile
from pathlib import Path

from agent.simulate.kubelet import LocalKubelet
from tests.app.agentproc import GPU_RESOURCE, AgentProcess

NIC_RESOURCE = "gpunodeagent.io/sriov_rdma"


async def _metrics_until(agent: AgentProcess, pattern: str, timeout: float = 30.0, *, absent: str = "") -> str:
    """/metrics once it matches `pattern` (and no longer matches `absent`)."""
    deadline = asyncio.get_running_loop().time() + timeout
    text = ""
    while asyncio.get_running_loop().time() < deadline:
        text = await asyncio.to_thread(agent.metrics)
        if re.search(pattern, text, re.MULTILINE) and not (absent and re.search(absent, text, re.MULTILINE)):
            return text
        await asyncio.sleep(0.2)
    raise AssertionError(f"/metrics never matched {pattern!r}; last:\n{text[-2000:]}\nlog:\n{agent.log_tail()}")


async def test_device_pod_info_and_pod_resources_up_follow_the_kubelet():
    directory = Path(tempfile.mkdtemp(prefix="gna"))
    socket = directory / "pr" / "kubelet.sock"
    config = directory / "config.yaml"
    config.write_text("podResources:\n  pollIntervalSeconds: 0.2\n")
    kubelet = LocalKubelet(directory, pod_resources_socket=socket)
    await kubelet.start()
    agent = AgentProcess(directory, "--config", str(config), "--pod-resources-socket", str(socket), "--kmsg", "")
    try:
        await kubelet.wait_for(lambda: {GPU_RESOURCE, NIC_RESOURCE} <= set(kubelet.plugins)
                               and all(v.lists for v in kubelet.plugins.values()), timeout=60)
        got = await kubelet.admit({GPU_RESOURCE: 1, NIC_RESOURCE: 1}, pod=("ml", "trainer-0"))
        gpu, vf = got[GPU_RESOURCE][0], got[NIC_RESOURCE][0]
        # both rows: one can show first, from the second resource's preference call's own List
        await _metrics_until(agent, rf'gpu_node_agent_device_pod_info\{{.*device="{vf}".*\}} 1\.0')
        text = await _metrics_until(agent, rf'gpu_node_agent_device_pod_info\{{.*device="{gpu}".*\}} 1\.0')
        for resource, device in ((GPU_RESOURCE, gpu), (NIC_RESOURCE, vf)):
            assert (f'gpu_node_agent_device_pod_info{{container="main",device="{device}",namespace="ml",'
                    f'pod="trainer-0",resource="{resource}"}} 1.0') in text
        assert "gpu_node_agent_pod_resources_up 1.0" in text
        # the device plugin was built with the ownership facts: the second resource's preference call found the
        # container (and its partner device) in the kubelet's records
        assert re.search(r'^gpu_node_agent_pod_resources_lookups_total\{result="exact"\} [1-9]', text, re.MULTILINE), \
            "\n".join(line for line in text.splitlines() if "lookups" in line)

        assert kubelet.pod_resources is not None
        await kubelet.pod_resources.stop()  # the kubelet goes away (socket removed)
        await _metrics_until(agent, r"^gpu_node_agent_pod_resources_up 0\.0")
        assert agent.process.poll() is None, "an unreachable PodResources API is a state, not a crash"
        kubelet.end_pod("ml", "trainer-0")
        await kubelet.pod_resources.start()  # ... and comes back, without the ended pod
        await _metrics_until(agent, r"^gpu_node_agent_pod_resources_up 1\.0",
                             absent=r"^gpu_node_agent_device_pod_info\{")
    finally:
        code = agent.stop()
        await kubelet.stop()
    assert code == 0, agent.log_tail()
