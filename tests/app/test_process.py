"""The whole agent: in-process endpoints, and a real `gpu-node-agent run` process driven by signals."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from agent import config
from agent.app import run_agent
from tests.fakes.polling import until


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


async def test_simulated_agent_serves_health_readiness_and_metrics():
    cfg = config.load(None, {"GPU_NODE_AGENT_SIMULATE": "dgx-h100", "GPU_NODE_AGENT_METRICS_ADDRESS": "127.0.0.1:0"})
    stop = asyncio.Event()
    ports: list[int] = []
    agent = asyncio.create_task(run_agent(cfg, stop, on_ready=ports.append))
    await until(lambda: bool(ports) or agent.done())
    port = ports[0]
    assert (await asyncio.to_thread(_get, port, "/healthz"))[0] == 200
    await until(lambda: _get(port, "/readyz")[0] == 200)
    status, metrics = await asyncio.to_thread(_get, port, "/metrics")
    assert status == 200
    assert 'gpu_node_agent_subsystem_up{subsystem="device-plugin"} 1.0' in metrics
    assert "process_resident_memory_bytes" in metrics
    assert "gpu_node_agent_build_info" in metrics
    stop.set()
    assert await asyncio.wait_for(agent, 30) == 0


def _lines(stream) -> list[dict]:
    out = []
    for line in stream.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


@pytest.mark.skipif(sys.platform != "linux", reason="signals and unix sockets")
def test_agent_process_rescans_on_sighup_and_cleans_up_on_sigterm():
    directory = Path(tempfile.mkdtemp(prefix="gna"))
    log_path = directory / "agent.log"
    with log_path.open("w") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "agent", "run", "--simulate", "pcie-pairs", "--metrics-address", "127.0.0.1:0",
             "--device-plugin-dir", str(directory), "--log-format", "json"],
            stderr=log_file, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            messages = [m["msg"] for m in _lines(log_path.read_text())]
            if any("all 2 device-plugin resources are registered" in m for m in messages):
                break
            assert process.poll() is None, log_path.read_text()
            time.sleep(0.1)
        else:
            raise AssertionError(log_path.read_text())
        sockets = sorted(p.name for p in directory.iterdir() if p.is_socket())
        assert "kubelet.sock" in sockets and len(sockets) == 3  # stand-in kubelet + two plugins
        process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 15
        while not any("rescan" in m["msg"] for m in _lines(log_path.read_text())):
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        assert not [p for p in directory.iterdir() if p.is_socket()]  # every socket removed
        assert any(m["msg"] == "gpu-node-agent stopped" for m in _lines(log_path.read_text()))
    finally:
        if process.poll() is None:
            process.kill()
