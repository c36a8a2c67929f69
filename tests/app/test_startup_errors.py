"""A config that cannot run ends `gpu-node-agent run` at once: one log line that names the problem, exit 2.

Before the supervisor owned exit codes these hung (the metrics server was shut down before it ever served, and
nothing listened for SIGTERM any more). Each case is a real process; the timeout guards against that hang.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.fakes.apiserver import write_kubeconfig

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="unix sockets and signals")


def run_agent(tmp_path: Path, *args: str) -> tuple[int, list[dict[str, str]]]:
    """Run the agent until it exits by itself (SIGKILL after 30 s: the hang this guards against)."""
    env = {**os.environ, "HOME": str(tmp_path / "home"), "PYTHONUNBUFFERED": "1"}
    env.pop("KUBECONFIG", None)
    result = subprocess.run([sys.executable, "-m", "agent", "run", "--log-format", "json", *args],
                            capture_output=True, text=True, timeout=30, env=env, check=False)
    lines = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    return result.returncode, lines


def the_error(lines: list[dict[str, str]]) -> str:
    """The one line at error level or above."""
    errors = [m["msg"] for m in lines if m["level"] in ("error", "critical")]
    assert len(errors) == 1, errors
    assert "Traceback" not in errors[0]
    return errors[0]


def test_an_unknown_profile(tmp_path: Path):
    code, lines = run_agent(tmp_path, "--simulate", "no-such-node", "--metrics-address", "127.0.0.1:0")
    assert code == 2
    assert "unknown simulated profile 'no-such-node'" in the_error(lines)


@pytest.mark.parametrize("kind", ["missing", "a directory", "not XML"])
def test_a_missing_or_refused_topology_file(tmp_path: Path, kind: str):
    path = tmp_path / "topo.xml"
    if kind == "a directory":
        path.mkdir()
    elif kind == "not XML":
        path.write_text("<system version='1'><cpu")
    code, lines = run_agent(tmp_path, "--simulate", "pcie-pairs", "--topology-file", str(path),
                            "--metrics-address", "127.0.0.1:0")
    assert code == 2
    assert str(path) in the_error(lines)


def test_remediation_without_a_node_name(tmp_path: Path):
    kubeconfig = write_kubeconfig(tmp_path / "kc", "http://127.0.0.1:9")
    code, lines = run_agent(tmp_path, "--simulate", "pcie-pairs", "--remediation", "--kubeconfig", str(kubeconfig),
                            "--metrics-address", "127.0.0.1:0")
    assert code == 2
    assert "no node name" in the_error(lines)
    # the start-up self-check (doctor's machine checks) ran before the wiring refused the config, as one line
    checks = [m["msg"] for m in lines if m["msg"].startswith("self-check: ")]
    assert len(checks) == 1 and "0 fail" in checks[0], checks


def test_remediation_without_credentials(tmp_path: Path):
    code, lines = run_agent(tmp_path, "--simulate", "pcie-pairs", "--remediation", "--node-name", "gpu-1",
                            "--kubeconfig", str(tmp_path / "missing"), "--metrics-address", "127.0.0.1:0")
    assert code == 2
    assert "kubeconfig" in the_error(lines)


def test_a_device_plugin_directory_over_the_unix_socket_limit(tmp_path: Path):
    directory = tmp_path / ("d" * 110)
    directory.mkdir()
    code, lines = run_agent(tmp_path, "--simulate", "pcie-pairs", "--device-plugin-dir", str(directory),
                            "--metrics-address", "127.0.0.1:0")
    assert code == 2
    assert "the limit is 107" in the_error(lines)


def test_a_served_resource_socket_over_the_limit_is_refused_at_start_not_crash_looped(tmp_path: Path):
    # kubelet.sock fits, a resource's socket (gna-sriov_rdma-<hash>.sock) does not: refused before anything runs.
    # The 90-character directory is built on a short base of its own: pytest's tmp_path grows with its session
    # counter (pytest-9 -> pytest-124) and alone may leave no room for it.
    base = Path(tempfile.mkdtemp(prefix="gna-", dir="/tmp"))
    try:
        directory = base / ("d" * (90 - len(str(base)) - 1))
        directory.mkdir()
        assert len(str(directory)) == 90 and len(f"{directory}/kubelet.sock") <= 107
        code, lines = run_agent(tmp_path, "--simulate", "dgx-h100", "--kmsg", "", "--device-plugin-dir",
                                str(directory), "--metrics-address", "127.0.0.1:0")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert code == 2
    error = the_error(lines)
    assert "gna-" in error and "the limit is 107" in error


def test_a_busy_metrics_port_names_the_address(tmp_path: Path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        address = f"127.0.0.1:{busy.getsockname()[1]}"
        code, lines = run_agent(tmp_path, "--simulate", "pcie-pairs", "--metrics-address", address)
    assert code == 2
    assert address in the_error(lines)
