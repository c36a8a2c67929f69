"""A real `gpu-node-agent run --simulate` process for end-to-end tests: start it, read it, stop it cleanly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

from agent.host.netns import entered
from tests.fakes.apiserver import ApiServerDouble, write_kubeconfig
from tests.fakes.clock import FakeClock
from tests.fakes.polling import until
from tests.fakes.ports import free_port

GPU_RESOURCE = "nvidia.com/gpu"


class AgentProcess:
    """`python -m agent run --simulate PROFILE` against the test's kubelet directory, logging JSON to a file;
    remediation in dry-run unless `dry_run=False` (then the test passes `--no-dry-run` or relies on the default).

    With `netns` (an `ip netns` name) the process runs inside that network namespace (netacct and shaping change
    only its tables) and `metrics()` reads it from there; unix sockets and files are shared as usual. `wrapper`
    runs before Python (e.g. setpriv, to take capabilities away).
    """

    def __init__(self, directory: Path, *args: str, profile: str = "dgx-h100", dry_run: bool = True,
                 netns: str | None = None, wrapper: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.netns = netns
        self.log_path = directory / "agent.log"
        self.process = subprocess.Popen(
            [*(["ip", "netns", "exec", netns] if netns else []), *wrapper, sys.executable, "-m", "agent", "run",
             "--simulate", profile, "--device-plugin-dir", str(directory),
             "--metrics-address", f"127.0.0.1:{self.port}", "--log-format", "json",
             *(["--dry-run"] if dry_run else []), *args],
            stdout=subprocess.DEVNULL, stderr=self.log_path.open("w"), env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def metrics(self) -> str:
        """The agent's /metrics text (blocking: call it through asyncio.to_thread from async code)."""
        with entered(self.netns), \
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as response:
            return response.read().decode()

    def ready(self) -> bool:
        """Whether /readyz answers 200 (blocking, like `metrics`); False while the endpoint is not up."""
        try:
            with entered(self.netns), \
                    urllib.request.urlopen(f"http://127.0.0.1:{self.port}/readyz", timeout=5) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def dry_run_decisions(self) -> list[str]:
        """What remediation decided in dry-run (against the simulated node), from the JSON log."""
        lines = [json.loads(line) for line in self.log_path.read_text().splitlines() if line.startswith("{")]
        return [m["msg"] for m in lines if "dry-run" in m["msg"]]

    def stop(self) -> int:
        """SIGTERM, wait (kill if it hangs); the exit code."""
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        finally:
            if self.process.poll() is None:
                self.process.kill()
        return self.process.returncode

    def messages(self) -> list[str]:
        """Every JSON log message so far."""
        lines = [json.loads(line) for line in self.log_path.read_text().splitlines() if line.startswith("{")]
        return [m["msg"] for m in lines]

    def log_tail(self) -> str:
        """The end of the log, for assertion messages."""
        return self.log_path.read_text()[-3000:]


async def start_on_api_double(directory: Path, node: str, *args: str,
                              profile: str = "pcie-pairs") -> tuple[AgentProcess, ApiServerDouble, Path]:
    """An acting agent on simulated hardware against the HTTP API double (kubeconfig, node name, remediation on,
    not dry-run), reading kernel-log records from a file; returned once its first verdict is on the API server,
    with the double and that kmsg file."""
    api = ApiServerDouble(FakeClock(), node)
    await api.start()
    kubeconfig = write_kubeconfig(directory / "kubeconfig", api.url)
    kmsg = directory / "kmsg"
    kmsg.write_text("")
    agent = AgentProcess(directory, "--kubeconfig", str(kubeconfig), "--node-name", node, "--remediation",
                         "--no-dry-run", "--kmsg", str(kmsg), "--preflight-taint", "", *args, profile=profile,
                         dry_run=False)
    try:
        await until(lambda: api.condition("GpuUnhealthy") is not None or agent.process.poll() is not None,
                    "the first verdict on the API server", timeout=60)
        assert agent.process.poll() is None, agent.log_tail()
    except BaseException:
        agent.stop()
        await api.stop()
        raise
    return agent, api, kmsg
