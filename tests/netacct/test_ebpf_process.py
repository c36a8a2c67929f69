"""The eBPF layout in the agent process: counting goes on while the agent is stopped and the totals continue after
it is back; a process without CAP_BPF makes `auto` fall back to nft, saying why in one log line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.config.netacct import NetacctConfig
from agent.host.netfilter import Host
from agent.netacct.command import cleanup_command
from tests.app.agentproc import AgentProcess
from tests.fakes.cli import run_agent
from tests.netacct import netns
from tests.netacct.netns import INET4, POD4

SERIES = 'gpu_node_agent_pod_network_transmit_bytes_total{namespace="team",pod="trainer-0",traffic="internet"}'


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="gne"))  # short: the device plugin's unix sockets live under it
    (path / "pods.json").write_text(json.dumps({"pods": [{"namespace": "team", "name": "trainer-0", "ips": [POD4]}]}))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _start(workdir: Path, topology: netns.Topology, bpffs: str, *, wrapper: tuple[str, ...] = ()) -> AgentProcess:
    return AgentProcess(workdir, "--kmsg", "", "--state-dir", str(workdir / "state"), "--netacct",
                        "--pods-file", str(workdir / "pods.json"), "--bpffs-dir", bpffs, netns=topology.node,
                        wrapper=wrapper)


def _value(agent: AgentProcess, series: str, timeout: float = 60) -> float:
    deadline = time.monotonic() + timeout
    while True:
        try:
            for line in agent.metrics().splitlines():
                if line.startswith(series + " "):
                    return float(line.rsplit(" ", 1)[1])
        except OSError:
            pass
        assert time.monotonic() < deadline and agent.process.poll() is None, agent.log_tail()
        time.sleep(0.3)


def test_packets_sent_while_the_agent_is_stopped_are_counted_after_it_is_back(
        topology: netns.Topology, bpffs: str, workdir: Path) -> None:
    agent = _start(workdir, topology, bpffs)
    try:
        assert _value(agent, 'gpu_node_agent_netacct_layout_info{layout="ebpf"}') == 1
        assert _value(agent, SERIES) == 0
        _, first = netns.flow(topology.pod, POD4, topology.inet, INET4, count=5, size=300)
        assert _value(agent, SERIES) == first
    finally:
        assert agent.stop() == 0, agent.log_tail()
    _, while_down = netns.flow(topology.pod, POD4, topology.inet, INET4, count=7, size=500)  # nobody reads
    again = _start(workdir, topology, bpffs)
    try:
        assert _value(again, SERIES) == first + while_down
    finally:
        assert again.stop() == 0, again.log_tail()
    assert cleanup_command(NetacctConfig(bpffs_dir=bpffs), host=Host(netns=topology.node)) == 0


def test_without_cap_bpf_auto_falls_back_to_nft_in_one_line(topology: netns.Topology, bpffs: str,
                                                           workdir: Path) -> None:
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    agent = _start(workdir, topology, bpffs,
                   wrapper=("setpriv", "--bounding-set=-bpf,-sys_admin", "--inh-caps=-bpf,-sys_admin"))
    try:
        assert _value(agent, 'gpu_node_agent_netacct_layout_info{layout="nft"}') == 1
        said = [m for m in agent.messages() if "ebpf" in m]
        assert len(said) == 1 and "does not work here" in said[0] and "Operation not permitted" in said[0], said
    finally:
        assert agent.stop() == 0, agent.log_tail()
    assert cleanup_command(NetacctConfig(bpffs_dir=bpffs), host=Host(netns=topology.node)) == 0


def test_the_doctor_names_the_fallback_and_why(bpffs: str) -> None:
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    args: tuple[str, ...] = ("doctor", "--simulate", "dgx-h100", "--netacct", "--bpffs-dir", bpffs)
    with_bpf = run_agent(*args)
    line = next(x for x in with_bpf.stdout.splitlines() if " netacct " in x)
    assert line.split()[0] == "OK" and "eBPF layout: bpf(2) answers" in line, with_bpf.stdout
    setpriv = shutil.which("setpriv") or "setpriv"
    without = subprocess.run([setpriv, "--bounding-set=-bpf,-sys_admin", "--inh-caps=-bpf,-sys_admin",
                              sys.executable, "-m", "agent", *args], capture_output=True, text=True, timeout=60,
                             check=False)
    line = next(x for x in without.stdout.splitlines() if " netacct " in x)
    assert line.split()[0] == "OK" and "native nftables layout (ebpf: bpf(2) refuses" in line, without.stdout
