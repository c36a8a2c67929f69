"""`run --simulate dgx-h100 --kmsg FILE`: an appended Xid 79 line turns that GPU Unhealthy in ListAndWatch.

The agent runs as a real process; the test owns the kubelet (the stand-in, serving kubelet.sock), so what it
checks is exactly what a kubelet would receive over the device-plugin API.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from agent.simulate.kubelet import LocalKubelet
from agent.simulate.profiles import load_profile
from tests.app.agentproc import GPU_RESOURCE, AgentProcess


async def test_xid_79_in_the_kernel_log_withdraws_the_gpu_from_the_kubelet():
    directory = Path(tempfile.mkdtemp(prefix="gna"))
    kmsg = directory / "kmsg"
    kmsg.write_text("")
    profile = load_profile("dgx-h100")
    bus_id, uuid = sorted(profile.gpu_uuids.items())[0]
    kubelet = LocalKubelet(directory)
    await kubelet.start()
    agent = AgentProcess(directory, "--kmsg", str(kmsg))
    try:
        await kubelet.wait_for(lambda: GPU_RESOURCE in kubelet.plugins
                               and kubelet.plugins[GPU_RESOURCE].health().get(uuid) == "Healthy", timeout=60)
        # kmsg record: priority 3, sequence, timestamp, flags; then the driver's message for that GPU.
        domain, bus, rest = bus_id.split(":")
        line = (f"3,7001,12345678,-;NVRM: Xid (PCI:{domain}:{bus}:{rest.split('.')[0]}): 79, pid=4242, "
                "name=python3, GPU has fallen off the bus.\n")
        with kmsg.open("a") as handle:
            handle.write(line)
        await kubelet.wait_for(lambda: kubelet.plugins[GPU_RESOURCE].health().get(uuid) == "Unhealthy", timeout=30)
        others = {k: v for k, v in kubelet.plugins[GPU_RESOURCE].health().items() if k != uuid}
        assert set(others.values()) == {"Healthy"}  # only the faulty GPU is withdrawn
        text = await asyncio.to_thread(agent.metrics)
        assert f'uuid="{uuid}",xid="79"}} 1.0' in text
        assert 'gpu_node_agent_node_verdict{verdict="drain"} 1.0' in text
        # remediation (dry-run against the simulated node) decided to cordon and drain, and said so
        await kubelet.wait_for(lambda: any("would cordon" in m for m in agent.dry_run_decisions())
                               and any("Draining" in m for m in agent.dry_run_decisions()), timeout=30)
        assert any("GpuXid79" in m for m in agent.dry_run_decisions())
        text = await asyncio.to_thread(agent.metrics)  # the decision as a counter, not only a log line
        assert 'gpu_node_agent_remediation_actions_total{action="cordon",result="dry_run"} ' in text
        assert 'gpu_node_agent_remediation_actions_total{action="cordon",result="ok"}' not in text
    finally:
        code = agent.stop()
        await kubelet.stop()
    assert code == 0, agent.log_tail()
