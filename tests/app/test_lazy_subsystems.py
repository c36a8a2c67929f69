"""A disabled subsystem costs nothing at start: its modules (and their libraries) are never imported.

The agent runs in a fresh interpreter with only the device plugin (and health, which always runs) on a simulated
node, until `/readyz` says the plugins are registered and the first health pass is done; then the interpreter
lists what it imported. Start time is measured by `bench/startup.py`; this guards what it depends on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="unix sockets")

RUN_UNTIL_READY = """
import asyncio, json, sys, threading, time, urllib.request

from agent.cli import _load_config, _parser
from agent.logs import setup_logging
from agent.app import run_agent

args = _parser().parse_args(["run", *sys.argv[1:]])
cfg = _load_config(args)
setup_logging("warning", "json")

async def main():
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def wait_ready(port):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.05)
        loop.call_soon_threadsafe(stop.set)

    code = await run_agent(cfg, stop, on_ready=lambda port: threading.Thread(target=wait_ready, args=(port,),
                                                                             daemon=True).start())
    return code

code = asyncio.run(main())
print(json.dumps({"code": code, "modules": sorted(sys.modules)}))
"""

NEVER_WITH_THE_DEVICE_PLUGIN_ALONE = (
    "agent.netacct", "agent.shaping", "agent.dra", "agent.remediation", "agent.ownership", "agent.kube.cluster",
    "agent.host.tc", "agent.host.tc_netlink", "agent.health.dcgm_watch",
    "agent.host.dcgm_exporter", "agent.health.kmsg_watch", "lightkube", "pyroute2", "httpx2",
)


def _imported(tmp_path: Path, *flags: str) -> set[str]:
    env = {**os.environ, "HOME": str(tmp_path / "home"), "PYTHONUNBUFFERED": "1"}
    env.pop("KUBECONFIG", None)
    result = subprocess.run([sys.executable, "-c", RUN_UNTIL_READY, *flags], capture_output=True, text=True,
                            timeout=120, env=env, check=False, cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr[-3000:]
    answer = json.loads(result.stdout.splitlines()[-1])
    assert answer["code"] == 0, result.stderr[-3000:]
    return set(answer["modules"])


def test_only_the_device_plugin_imports_no_other_subsystem(tmp_path: Path):
    kubeconfig = tmp_path / "kubeconfig"  # credentials named (never read): no in-memory cluster, no remediation demo
    imported = _imported(tmp_path, "--simulate", "dgx-h100", "--kubeconfig", str(kubeconfig), "--no-remediation",
                         "--no-netacct", "--no-shaping", "--no-dra", "--pod-resources-socket", "",
                         "--metrics-address", "127.0.0.1:0", "--state-dir", str(tmp_path / "state"))
    assert {"agent.deviceplugin.manager", "agent.health.service"} <= imported  # it did run
    loaded = sorted(name for name in imported for prefix in NEVER_WITH_THE_DEVICE_PLUGIN_ALONE
                    if name == prefix or name.startswith(prefix + "."))
    assert not loaded
