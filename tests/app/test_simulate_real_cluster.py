"""`--simulate` simulates the hardware only: with `--kubeconfig` the agent acts on that API server.

`run --simulate pcie-pairs --kubeconfig K --node-name N --remediation --no-dry-run`, a real process: an Xid 79
in its kernel-log file cordons node N on the API server behind K (the HTTP double), and `/metrics` counts the
cordon. Before, `--simulate` forced an in-memory node and dry-run and ignored both flags.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from agent.simulate.profiles import load_profile
from tests.app.agentproc import start_on_api_double
from tests.fakes.allowed import assert_only_allowed
from tests.fakes.kmsg import xid_record
from tests.fakes.polling import until

NODE = "laptop-gpu-0"
P = "gpunodeagent.io"


async def test_simulated_hardware_with_a_kubeconfig_acts_on_that_api_server():
    directory = Path(tempfile.mkdtemp(prefix="gna"))
    bus_id = sorted(load_profile("pcie-pairs").gpu_uuids)[0]
    agent, api, kmsg = await start_on_api_double(directory, NODE)
    kubeconfig = directory / "kubeconfig"
    try:
        assert api.condition("GpuUnhealthy")["status"] == "False"  # healthy simulated GPUs, said on the real node
        start = next(m for m in agent.messages() if m.startswith("gpu-node-agent "))
        assert f"kubeconfig {kubeconfig}" in start and "acting on the node" in start, start
        with kmsg.open("a") as handle:
            handle.write(xid_record(7001, bus_id, 79, "pid=4242, name=python3, GPU has fallen off the bus."))
        await until(lambda: api.node["spec"].get("unschedulable") is True, "the cordon on the API server",
                    timeout=60)
        assert api.annotations[f"{P}/cordon-reason"] == "GpuXid79"
        await until(lambda: api.condition("GpuUnhealthy")["status"] == "True", "the condition on the API server")
        text = await asyncio.to_thread(agent.metrics)
        assert 'gpu_node_agent_remediation_actions_total{action="cordon",result="ok"} 1.0' in text
        assert not any("dry-run" in m for m in agent.messages())
    finally:
        code = agent.stop()
        await api.stop()
    assert code == 0, agent.log_tail()
    assert_only_allowed(api.requests, NODE, "default")  # only what RBAC grants, on node N only
