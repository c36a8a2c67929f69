"""`run --simulate dgx-h100 --nvsentinel-socket SOCK` as a real process, with a platform connector that holds every
call for 40 s: an Xid 79 still turns the node's verdict and the GPU's health within 5 s, /healthz stays up, and the
stuck calls are counted as failed at their deadline (issue 42 item 4)."""

from __future__ import annotations

import asyncio
import tempfile
import time
import urllib.request
from pathlib import Path

from agent.simulate.profiles import load_profile
from tests.app.agentproc import AgentProcess
from tests.fakes.kmsg import xid_record
from tests.fakes.nvsentinel import FakeConnector
from tests.fakes.polling import until


def healthz(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as response:
        return int(response.status)


async def test_a_hanging_connector_delays_neither_health_nor_healthz():
    directory = Path(tempfile.mkdtemp(prefix="gna"))
    kmsg = directory / "kmsg"
    kmsg.write_text("")
    fake = FakeConnector(directory / "nvs.sock", hold=40.0)
    await fake.start()
    bus_id, uuid = sorted(load_profile("dgx-h100").gpu_uuids.items())[0]
    agent = AgentProcess(directory, "--kmsg", str(kmsg), "--nvsentinel-socket", str(fake.socket_path),
                         "--node-name", "dgx-nvs-1")
    try:
        await until(lambda: agent.ready() or agent.process.poll() is not None, "the agent ready", timeout=60)
        assert agent.process.poll() is None, agent.log_tail()
        with kmsg.open("a") as handle:
            handle.write(xid_record(7001, bus_id, 79, "pid=4242, name=python3, GPU has fallen off the bus."))
        written = time.monotonic()

        async def verdict_is_drain() -> bool:
            text = await asyncio.to_thread(agent.metrics)
            unhealthy = any(line.startswith("gpu_node_agent_device_healthy{") and f'"{uuid}"' in line
                            and line.endswith(" 0.0") for line in text.splitlines())
            return 'gpu_node_agent_node_verdict{verdict="drain"} 1.0' in text and unhealthy

        while not await verdict_is_drain():
            if time.monotonic() - written >= 5.0:
                text = await asyncio.to_thread(agent.metrics)
                raise AssertionError("health did not act on the Xid within 5 s: " + "\n".join(
                    line for line in text.splitlines() if "verdict" in line or uuid in line) + agent.log_tail())
            await asyncio.sleep(0.1)
        assert await asyncio.to_thread(healthz, agent.port) == 200
        await until(lambda: fake.calls >= 1, "the call reaching the connector", timeout=30)
        assert await asyncio.to_thread(healthz, agent.port) == 200  # while the call hangs
        text = ""
        for _ in range(150):  # the call's 5 s deadline passes
            text = await asyncio.to_thread(agent.metrics)
            if 'gpu_node_agent_nvsentinel_events_total{outcome="failed"} 1.0' in text:
                break
            await asyncio.sleep(0.1)
        assert 'gpu_node_agent_nvsentinel_events_total{outcome="failed"} 1.0' in text, text[-2000:]
        assert await asyncio.to_thread(healthz, agent.port) == 200
    finally:
        code = agent.stop()
        await fake.stop()
    assert code == 0, agent.log_tail()
