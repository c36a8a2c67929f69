"""Stopping is prompt: `run --simulate` with the default NVML event timeout (5 s) ends within 1.5 s of SIGTERM.

The NVML event watch waits in a thread for up to the event timeout per call; the stop used to wait for that call to
time out (4.0-4.1 s with nothing happening), and a DaemonSet rollout over thousands of nodes paid it on each.
SIGTERM is sent right after readiness, when the watch has just begun a wait (the worst moment before the fix).
"""

from __future__ import annotations

import asyncio
import signal
import tempfile
import time
from pathlib import Path

from tests.app.agentproc import AgentProcess
from tests.fakes.polling import until

BOUND_S = 1.5


async def test_sigterm_ends_an_idle_agent_within_1_5_s_with_the_default_event_timeout() -> None:
    directory = Path(tempfile.mkdtemp(prefix="gna"))
    agent = AgentProcess(directory)  # no --nvml-event-timeout: the default 5 s
    try:
        await until(lambda: agent.process.poll() is not None or agent.ready(), "readiness", timeout=60)
        assert agent.process.poll() is None, agent.log_tail()
        metrics = await asyncio.to_thread(agent.metrics)
        assert 'gpu_node_agent_health_check_up{check="nvml_events"} 1.0' in metrics  # the watch is waiting
        agent.process.send_signal(signal.SIGTERM)
        started = time.monotonic()
        while agent.process.poll() is None and time.monotonic() - started < 10:
            await asyncio.sleep(0.01)
        took = time.monotonic() - started
        assert agent.process.poll() == 0, agent.log_tail()
        assert took < BOUND_S, f"{took:.2f} s from SIGTERM to exit\n{agent.log_tail()}"
    finally:
        agent.stop()
