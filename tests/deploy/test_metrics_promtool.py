"""`promtool check metrics` over the /metrics of real agents with every subsystem on, so a metric name promtool's
lint rejects fails here (as `gpu_node_agent_nic_port_counter_total` did, from an agent this test never ran).

Two `gpu-node-agent run --simulate dgx-h100` processes (`tests/app/agentproc.py`), because under `--dra` the
device plugin serves nothing and its families need an agent without it:

- acting: remediation against the HTTP API double (API request counters), the device plugin, ownership over the
  stand-in kubelet's PodResources, a simulated dcgm-exporter, the NIC counter pass, a kernel-log file;
- network + DRA: netacct and shaping (with a pod to count and shape) inside throw-away network namespaces
  (`tests/netacct/netns.py`: they change only that namespace's tables), the DRA driver, dcgm, ownership, NIC
  counters. Skipped, with the reason, where network namespaces cannot be made (not root, tools missing).

Together they must export every family of the deploy catalog (`AGENT_METRICS`), so a family that promtool never
got to see fails too.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.host.netns import entered
from agent.simulate.dcgm_exporter import DcgmExporterServer, SimulatedDcgmExporter
from agent.simulate.kubelet import LocalKubelet
from tests.app.agentproc import AgentProcess, start_on_api_double
from tests.deploy.manifests import AGENT_METRICS, PROMETHEUS_MISSING, binary
from tests.netacct import netns

PROMTOOL = binary("promtool")
pytestmark = pytest.mark.skipif(PROMTOOL is None, reason=PROMETHEUS_MISSING)

PROFILE = "dgx-h100"
# Findings that stay, each with why. Nothing else may be waived: a waiver is how the NIC counter name got through.
WAIVED = {
    # a name fixed by issue 19's interface ("keep these names; tests outside the repo use them"); limits are
    # given in bits per second (Kubernetes bandwidth annotations), promtool's lint wants bytes
    'gpu_node_agent_pod_internet_limit_bits_per_second use base unit "bytes" instead of "bits"',
}
OWNERSHIP = "gpu_node_agent_pod_resources_up 1.0"
DCGM = 'gpu_node_agent_dcgm_scrapes_total{result="ok"}'


def lint(text: str) -> list[str]:
    """promtool's findings on an exposition, less the waived ones."""
    assert PROMTOOL is not None
    result = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True,
                            timeout=60, check=False)
    return [line for line in (result.stdout + result.stderr).splitlines() if line.strip() and line not in WAIVED]


def families(text: str) -> set[str]:
    """The metric families an exposition declares (`# TYPE name type`)."""
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}


async def _scrape_once_showing(agent: AgentProcess, *samples: str, timeout: float = 60.0) -> str:
    """/metrics once every sample prefix appears in it (the subsystems have run once), read off the event loop."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    text = ""
    while loop.time() < deadline:
        assert agent.process.poll() is None, f"the agent exited:\n{agent.log_tail()}"
        try:
            text = await asyncio.to_thread(agent.metrics)
        except OSError:
            text = ""  # not listening yet
        if all(sample in text for sample in samples):
            return text
        await asyncio.sleep(0.25)
    missing = [sample for sample in samples if sample not in text]
    raise AssertionError(f"/metrics never showed {missing}:\n{agent.log_tail()}")


async def _acting(directory: Path) -> str:
    socket = directory / "pr" / "kubelet.sock"
    kubelet = LocalKubelet(directory, pod_resources_socket=socket)
    await kubelet.start()
    try:
        with DcgmExporterServer(SimulatedDcgmExporter.for_profile(PROFILE)) as dcgm:
            agent, api, _ = await start_on_api_double(directory, "lint-node", "--pod-resources-socket", str(socket),
                                                      "--dcgm-exporter-url", dcgm.url, "--dcgm-scrape-interval",
                                                      "0.5", "--nvsentinel-socket", str(directory / "nvs.sock"),
                                                      profile=PROFILE)  # no connector listens: failed, counted
            try:
                return await _scrape_once_showing(agent, OWNERSHIP, DCGM, "gpu_node_agent_apiserver_requests_total{",
                                                  'gpu_node_agent_subsystem_up{subsystem="device-plugin"} 1.0')
            finally:
                assert agent.stop() == 0, agent.log_tail()
                await api.stop()
    finally:
        await kubelet.stop()


async def _network_and_dra(directory: Path, topology: netns.Topology) -> str:
    socket = directory / "pr" / "kubelet.sock"
    kubelet = LocalKubelet(directory / "dp", pod_resources_socket=socket)
    await kubelet.start()
    pods = directory / "pods.json"
    pods.write_text(json.dumps({"pods": [{
        "namespace": "team", "name": "trainer-0", "uid": "0f6b7f1e-4444-4a5b-9c3d-000000000001",
        "ips": [netns.POD4, netns.POD6], "annotations": {"gpunodeagent.io/internet-egress-bandwidth": "50M"}}]}))
    (directory / "registry").mkdir()
    dcgm = DcgmExporterServer(SimulatedDcgmExporter.for_profile(PROFILE))
    with entered(topology.node):  # the exporter listens where the agent runs
        dcgm.start()
    try:
        agent = AgentProcess(directory / "dp", "--kmsg", "", "--state-dir", str(directory / "state"),
                             "--pod-resources-socket", str(socket), "--dcgm-exporter-url", dcgm.url,
                             "--dcgm-scrape-interval", "0.5", "--netacct", "--pods-file", str(pods), "--shaping",
                             "--dra", "--plugin-registry-dir", str(directory / "registry"),
                             "--dra-plugin-dir", str(directory / "plugin"), "--cdi-spec-dir", str(directory / "cdi"),
                             profile=PROFILE, netns=topology.node)
        try:
            return await _scrape_once_showing(
                agent, OWNERSHIP, DCGM, "gpu_node_agent_netacct_up 1.0", "gpu_node_agent_shaping_up 1.0",
                'gpu_node_agent_shaping_pods{state="shaped"} 1.0',
                'gpu_node_agent_dra_slice_publishes_total{result="changed"}')
        finally:
            assert agent.stop() == 0, agent.log_tail()
    finally:
        dcgm.stop()
        await kubelet.stop()


@pytest.fixture(scope="module")
def acting_metrics() -> Iterator[str]:
    directory = Path(tempfile.mkdtemp(prefix="gnl"))  # short: unix socket paths live under it
    try:
        yield asyncio.run(_acting(directory))
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def network_and_dra_metrics() -> Iterator[str]:
    topology = netns.build_or_skip()
    directory = Path(tempfile.mkdtemp(prefix="gnl"))
    try:
        yield asyncio.run(_network_and_dra(directory, topology))
    finally:
        netns.destroy(topology)
        shutil.rmtree(directory, ignore_errors=True)


def test_the_lint_reports_a_type_in_a_name():
    """The check below can fail: promtool's finding for the old NIC counter name comes through `lint`."""
    text = "# HELP x_port_counter_total c\n# TYPE x_port_counter_total counter\nx_port_counter_total 1\n"
    assert lint(text) == ["x_port_counter_total metric name should not include type 'counter'"]


def test_the_acting_agent_passes_promtool(acting_metrics):
    problems = lint(acting_metrics)
    assert not problems, "promtool check metrics:\n" + "\n".join(problems)


def test_the_network_and_dra_agent_passes_promtool(network_and_dra_metrics):
    problems = lint(network_and_dra_metrics)
    assert not problems, "promtool check metrics:\n" + "\n".join(problems)


def test_the_two_agents_export_every_catalogued_family(acting_metrics, network_and_dra_metrics):
    unseen = set(AGENT_METRICS) - families(acting_metrics) - families(network_and_dra_metrics)
    assert not unseen, f"families promtool never saw: {sorted(unseen)}"


def _documented_rows() -> dict[str, set[str] | None]:
    """docs/metrics.md's table: family -> its labels (None where the row abbreviates them with `...`)."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text(encoding="utf-8")
    rows: dict[str, set[str] | None] = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`gpu_node_agent_"):
            continue
        names = [name.strip().strip("`") for name in cells[0].split(",")]
        labels = None if "..." in cells[1] else {label.strip() for label in cells[1].split(",") if label.strip()}
        for name in names:
            full = name if name.startswith("gpu_node_agent_") else "gpu_node_agent" + name
            rows[full] = labels
    return rows


def _exposed_labels(text: str) -> dict[str, set[str]]:
    """family -> the label names its samples carry (histogram/summary bookkeeping labels left out)."""
    kinds = {line.split()[2]: line.split()[3] for line in text.splitlines() if line.startswith("# TYPE ")}
    found: dict[str, set[str]] = {name: set() for name in kinds}
    for line in text.splitlines():
        if line.startswith("#") or "{" not in line:
            continue
        sample, labels = line.split("{", 1)
        family = next((f for f in (sample, sample.rsplit("_", 1)[0]) if f in kinds), None)
        if family is not None:
            found[family] |= {pair.split("=", 1)[0] for pair in labels.rsplit("}", 1)[0].split('",') if "=" in pair}
    return {name: labels - {"le", "quantile"} for name, labels in found.items()}


def test_the_docs_document_every_family_with_its_labels(acting_metrics, network_and_dra_metrics):
    """Issue 29: the metrics table (docs/metrics.md since issue 38) is checked against what agents with every
    subsystem on expose."""
    exposed: dict[str, set[str]] = {}
    for text in (acting_metrics, network_and_dra_metrics):
        for name, labels in _exposed_labels(text).items():
            exposed.setdefault(name, set()).update(labels)
    ours = {name: labels for name, labels in exposed.items() if name.startswith("gpu_node_agent_")}
    rows = _documented_rows()
    undocumented = sorted(set(ours) - set(rows))
    assert not undocumented, f"families missing from docs/metrics.md's table: {undocumented}"
    wrong = {name: (sorted(rows[name] or ()), sorted(labels)) for name, labels in ours.items()
             if rows.get(name) is not None and labels and rows[name] != labels}
    assert not wrong, f"docs/metrics.md labels (documented, exposed) differ: {wrong}"
