"""The GPU reset end to end, in a real agent process on simulated hardware against the HTTP API double.

`run --simulate pcie-pairs --kubeconfig K --node-name N --remediation --no-dry-run --gpu-reset-command-arg ...`:
an Xid 95 (NVIDIA's catalog: RESET_GPU) in the kernel log isolates the GPU, the agent runs the configured reset
command with the GPU's UUID and bus id (the placeholders filled by the agent), health hears of the reset, the
device comes back and the node was never cordoned; `/metrics` counts the reset.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path

from agent.simulate.profiles import load_profile
from tests.app.agentproc import start_on_api_double
from tests.fakes.allowed import assert_only_allowed
from tests.fakes.kmsg import xid_record
from tests.fakes.polling import until

NODE = "laptop-gpu-0"
P = "gpunodeagent.io"
# Xid 95's text as the driver logs it, from a public GPU server fault ticket (Inspur NF5468M6) quoted in GitHub code:
# "NVRM: Xid (PCI:0000:37:00): 95, pid=5171, Uncontained: FBHUB. RST: Yes, D-RST: No"
XID95_TEXT = "pid=5171, Uncontained: FBHUB. RST: Yes, D-RST: No"
# The reset command's stand-in: records its arguments (written aside, then renamed: the test sees all or nothing).
_SCRIPT = ("import json, os, pathlib, sys\nout = pathlib.Path(sys.argv[1])\n"
           "out.with_suffix('.tmp').write_text(json.dumps(sys.argv[2:]))\nos.replace(out.with_suffix('.tmp'), out)\n")


async def test_an_xid95_runs_the_reset_command_and_the_gpu_returns() -> None:
    directory = Path(tempfile.mkdtemp(prefix="gna"))
    script, ran = directory / "reset.py", directory / "reset-ran.json"
    script.write_text(_SCRIPT)
    command = [sys.executable, str(script), str(ran), "--gpu-reset", "-i", "{uuid}", "{busId}"]
    profile = load_profile("pcie-pairs")
    bus_id = sorted(profile.gpu_uuids)[1]
    reset_args = [f"--gpu-reset-command-arg={part}" for part in command]  # `=`: an argument may start with "-"
    agent, api, kmsg = await start_on_api_double(directory, NODE, *reset_args)
    try:
        with kmsg.open("a") as handle:
            handle.write(xid_record(7001, bus_id, 95, XID95_TEXT))
        await until(ran.exists, "the reset command ran", timeout=60)
        assert json.loads(ran.read_text()) == ["--gpu-reset", "-i", profile.gpu_uuids[bus_id], bus_id]
        await until(lambda: "GpuResetVerified" in [e["reason"] for e in api.events.values()],
                    "the reset verified", timeout=60)
        text = await asyncio.to_thread(agent.metrics)
        assert 'gpu_node_agent_remediation_actions_total{action="gpu_reset",result="ok"} 1.0' in text
        assert 'gpu_node_agent_remediation_actions_total{action="gpu_reset",result="verified"} 1.0' in text
        assert not api.node["spec"].get("unschedulable")
        assert f"{P}/gpu-reset" not in api.annotations and f"{P}/isolated-devices" not in api.annotations
        assert api.condition("GpuUnhealthy")["status"] == "False"
    finally:
        code = agent.stop()
        await api.stop()
    assert code == 0, agent.log_tail()
    assert_only_allowed(api.requests, NODE, "default")
