"""Issue 37, item 5: the pods file is re-read while the agent runs; a FIFO put in its place must not freeze it
(it was opened blocking on the event loop: /metrics, health and the device plugin all stopped)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from tests.app.agentproc import AgentProcess
from tests.netacct import netns
from tests.netacct.netns import POD4


def _write(path: Path, name: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pods": [{"namespace": "team", "name": name, "ips": [POD4]}]}))
    tmp.replace(path)


def _scrape(agent: AgentProcess) -> tuple[str, float]:
    started = time.monotonic()
    return agent.metrics(), time.monotonic() - started


def _wait_for(agent: AgentProcess, text: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if text in agent.metrics():
                return
        except OSError:
            pass
        assert time.monotonic() < deadline and agent.process.poll() is None, agent.log_tail()
        time.sleep(0.3)


def test_a_fifo_in_place_of_the_pods_file_does_not_freeze_the_agent(topology: netns.Topology) -> None:
    tmp_path = Path(tempfile.mkdtemp(prefix="gnf"))  # short: the device plugin's unix sockets live under it
    pods = tmp_path / "pods.json"
    _write(pods, "trainer-0")
    agent = AgentProcess(tmp_path, "--kmsg", "", "--state-dir", str(tmp_path / "state"), "--netacct",
                         "--pods-file", str(pods), netns=topology.node)
    try:
        _wait_for(agent, 'pod="trainer-0"')
        pods.unlink()
        os.mkfifo(pods)
        time.sleep(2.5)  # the file source polls once a second
        for _ in range(3):  # the loop still answers, promptly
            _, took = _scrape(agent)
            assert took < 2.0, took
        pods.unlink()
        _write(pods, "trainer-1")  # and the file is followed again once it is a file
        _wait_for(agent, 'pod="trainer-1"', timeout=20)
    finally:
        if pods.exists() and not pods.is_file():
            pods.unlink()  # a stuck open (the bug) is released by a writer... or by the kill in stop()
        assert agent.stop() == 0, agent.log_tail()
        shutil.rmtree(tmp_path, ignore_errors=True)
