"""Incidents on the Node (issue 42 item 2): `run --simulate dgx-h100` acting on the one-node API double; two Xid 79
on two GPUs are two incidents in `gpunodeagent.io/incidents`, each written in the nodes/status PATCH that changes
the condition (no request of its own), `gpu_node_agent_incidents_total` is 2, and `gpu_node_agent_gpus_healthy`
goes from 8 to 6 (item 3)."""

from __future__ import annotations

import asyncio
import json
import tempfile
from pathlib import Path

from agent.simulate.profiles import load_profile
from tests.app.agentproc import start_on_api_double
from tests.fakes.kmsg import xid_record
from tests.fakes.polling import until

NODE = "dgx-incidents-0"
KEY = "gpunodeagent.io/incidents"


def _status_writes(api, since: int = 0):
    return [r for r in api.requests[since:] if r.method == "PATCH" and r.path.endswith("/status")]


async def test_two_xid_79_on_two_gpus_are_two_incidents_in_the_conditions_own_writes():
    directory = Path(tempfile.mkdtemp(prefix="gna"))
    first, second = sorted(load_profile("dgx-h100").gpu_uuids)[:2]
    agent, api, kmsg = await start_on_api_double(directory, NODE, profile="dgx-h100")
    try:
        assert KEY not in api.annotations  # a healthy node has no incident
        text = await asyncio.to_thread(agent.metrics)
        assert "gpu_node_agent_gpus_healthy 8.0" in text and "gpu_node_agent_gpus_expected 8.0" in text
        counts = []
        for seq, bus_id in ((7001, first), (7002, second)):
            with kmsg.open("a") as handle:
                handle.write(xid_record(seq, bus_id, 79, "pid=4242, name=python3, GPU has fallen off the bus."))
            await until(lambda bus=bus_id: KEY in api.annotations and json.loads(api.annotations[KEY])["count"]
                        == len(counts) + 1, f"incident {len(counts) + 1} on the node", timeout=60)
            counts.append(json.loads(api.annotations[KEY])["count"])
        incidents = json.loads(api.annotations[KEY])
        assert counts == [1, 2]
        assert incidents["lastCause"] == "GpuXid79" == api.condition("GpuUnhealthy")["reason"]
        assert len(incidents["recent"]) == 2 and incidents["windowSeconds"] == 604800
        # every write of the annotation is a nodes/status PATCH that also carries the condition; never a PATCH of
        # the node of its own
        carrying = [r for r in api.requests if r.method == "PATCH" and KEY in
                    ((r.body or {}).get("metadata") or {}).get("annotations", {})]
        assert len(carrying) == 2, [(r.path, r.body) for r in carrying]
        for request in carrying:
            assert request.path == f"/api/v1/nodes/{NODE}/status"
            assert [c["type"] for c in request.body["status"]["conditions"]] == ["GpuUnhealthy"]
        messages = [r.body["status"]["conditions"][0]["message"] for r in carrying]
        assert messages[0] != messages[1]  # each rode the write that changed the condition
        text = await asyncio.to_thread(agent.metrics)
        assert "gpu_node_agent_incidents_total 2.0" in text
        assert "gpu_node_agent_gpus_healthy 6.0" in text  # the two GPUs that fell off the bus are not healthy
    finally:
        code = agent.stop()
        await api.stop()
    assert code == 0, agent.log_tail()
