"""The PrometheusRule's alerts: they parse (promtool check rules), use only the agent's metrics and `up`, and
fire when they should (promtool test rules over synthetic series, including a counter's first sample)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.manifests import (
    AGENT_METRICS,
    PROMETHEUS_MISSING,
    alert_rules,
    binary,
    metric_names,
    rule_groups,
)

PROMTOOL = binary("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason=PROMETHEUS_MISSING)

REQUIRED_ALERTS = {"GpuXidNeedsAction", "GpuDeviceUnhealthy", "GpuNodeCordonedByAgent", "GpuNodeVerdictCordonOrDrain",
                   "GpuNodeNeedsHumanAttention", "GpuNodeAgentDown", "GpuNodeAgentSubsystemDown",
                   "GpuNodeAgentAccountingDown", "GpuNodeAgentDcgmUnreadable", "GpuMissing", "PcieLinkDowntrained",
                   "NicPortErrors", "NicLinkFlapping", "PodInternetBandwidthAtLimit", "NvlinkInactive",
                   "GpuFabricUnhealthy", "GpuRecoveryActionRequested", "GpuResetFailed", "GpuNicPixAlignmentLow",
                   "GpuFleetHealthyRatioLow"}
#: series the rules record themselves (`level:metric:operation`), which alerts may read
RECORDED = {rule["record"] for group in rule_groups() for rule in group["rules"] if "record" in rule}


def _write_rules(path: Path, *, annotations: bool = True) -> Path:
    groups = rule_groups()
    if not annotations:  # promtool test rules compares annotations; the unit tests are about the expressions
        groups = [{**g, "rules": [{k: v for k, v in r.items() if k != "annotations"} for r in g["rules"]]}
                  for g in groups]
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False), encoding="utf-8")
    return path


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120, check=False)


def test_required_alerts_exist():
    assert {rule["alert"] for rule in alert_rules()} == REQUIRED_ALERTS


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda rule: rule["alert"])
def test_alert_uses_only_agent_metrics_and_up(rule):
    names = metric_names(rule["expr"])
    assert names, f"no metric found in {rule['expr']!r}"
    unknown = {n for n in names if n != "up" and not n.startswith("gpu_node_agent_") and n not in RECORDED}
    assert not unknown, f"{rule['alert']} uses metrics outside the agent: {unknown}"
    undocumented = {n for n in names if n.startswith("gpu_node_agent_")} - set(AGENT_METRICS)
    assert not undocumented, f"{rule['alert']} uses metrics the agent does not document: {undocumented}"


def test_up_alert_selects_the_agent_job():
    (rule,) = [r for r in alert_rules() if r["alert"] == "GpuNodeAgentDown"]
    assert 'job="gpu-node-agent"' in rule["expr"]


def test_xid_alert_covers_exactly_the_codes_the_agent_acts_on():
    xid = pytest.importorskip("agent.health.xid", reason="the Xid catalog lives in the health subsystem")
    findings = pytest.importorskip("agent.health.findings")
    policy = xid.XidPolicy()
    acted_on = {code for code in xid.CATALOG
                if policy.action(code) >= findings.Severity.ISOLATE}  # a GPU out of service needs a person too
    (rule,) = [r for r in alert_rules() if r["alert"] == "GpuXidNeedsAction"]
    matchers = re.findall(r'xid=~"([^"]*)"', rule["expr"])
    assert matchers, "the Xid alert must select codes"
    for matcher in matchers:
        assert {int(code) for code in matcher.split("|")} == acted_on


@needs_promtool
def test_rules_pass_promtool_check(tmp_path):
    result = _promtool("check", "rules", str(_write_rules(tmp_path / "rules.yml")))
    assert result.returncode == 0, result.stdout + result.stderr


# --- promtool test rules: each alert over synthetic series (1 sample a minute) ----------------------------

AGENT = {"job": "gpu-node-agent", "instance": "10.0.0.1:9400", "node": "n1"}


def _series(name: str, values: str, **labels: str) -> dict[str, str]:
    text = ",".join(f'{k}="{v}"' for k, v in {**AGENT, **labels}.items())
    return {"series": f"{name}{{{text}}}", "values": values}


def _alerts(alertname: str, *cases: tuple[str, list[dict[str, str]]]) -> list[dict[str, Any]]:
    return [{"eval_time": at, "alertname": alertname, "exp_alerts": [{"exp_labels": labels} for labels in expected]}
            for at, expected in cases]


XID = "gpu_node_agent_xid_errors_total"
GPU0 = {"gpu": "0", "uuid": "GPU-a", "pci_bus_id": "0000:18:00.0"}
GPU2 = {"gpu": "2", "uuid": "GPU-c", "pci_bus_id": "0000:3a:00.0"}
XID79 = {"node": "n1", **GPU0, "xid": "79", "severity": "critical"}
XID48 = {"node": "n1", **GPU2, "xid": "48", "severity": "critical"}

UNIT_TESTS: list[dict[str, Any]] = [
    {   # Xid 79 appears at 5 min with value 1 (first sample); Xid 13 (application) keeps rising; Xid 48 rises at 20.
        "input_series": [
            _series(XID, "_x5 1x30", **GPU0, xid="79"),
            _series(XID, "_x5 1+1x30", gpu="1", uuid="GPU-b", pci_bus_id="0000:2a:00.0", xid="13"),
            _series(XID, "1x19 2x15", **GPU2, xid="48"),
        ],
        "alert_rule_test": _alerts(
            "GpuXidNeedsAction",
            ("4m", [XID48]),  # present since the first sample of the test: new within 10 minutes
            ("6m", [XID79, XID48]),
            ("14m", [XID79]),
            ("16m", []),
            ("21m", [XID48]),
            ("29m", [XID48]),
            ("31m", []),
        ),
    },
    {
        "input_series": [
            _series("gpu_node_agent_device_healthy", "1x4 0x10 1x5", resource="nvidia.com/gpu", device="GPU-a"),
            _series("gpu_node_agent_device_healthy", "1x20", resource="nvidia.com/gpu", device="GPU-b"),
        ],
        "alert_rule_test": _alerts(
            "GpuDeviceUnhealthy",
            ("9m", []),  # pending: unhealthy for 4 minutes
            ("10m", [{**AGENT, "resource": "nvidia.com/gpu", "device": "GPU-a", "severity": "warning"}]),
            ("17m", []),
        ),
    },
    {
        "input_series": [
            _series("gpu_node_agent_remediation_actions_total", "_x5 1x40", action="cordon", result="ok"),
            _series("gpu_node_agent_remediation_actions_total", "_x5 1+1x40", action="cordon", result="dry_run"),
            _series("gpu_node_agent_node_verdict", "0x4 1x10 0x5", verdict="drain"),
            _series("gpu_node_agent_node_verdict", "1x4 0x10 1x5", verdict="healthy"),
            _series("gpu_node_agent_remediation_latched", "0x9 1x5 0x5"),
            _series("gpu_node_agent_remediation_actions_total", "_x10 1x80", action="gpu_reset", result="failed"),
            _series("gpu_node_agent_remediation_actions_total", "1+1x90", action="gpu_reset", result="ok"),
        ],
        "alert_rule_test": [
            *_alerts("GpuNodeNeedsHumanAttention",
                     ("9m", []), ("10m", [{"node": "n1", "severity": "critical"}]), ("16m", [])),
            *_alerts("GpuNodeCordonedByAgent",
                     ("4m", []), ("6m", [{"node": "n1", "severity": "warning"}]), ("25m", [])),
            *_alerts("GpuNodeVerdictCordonOrDrain",
                     ("6m", []), ("7m", [{"node": "n1", "verdict": "drain", "severity": "warning"}]), ("17m", [])),
            *_alerts("GpuResetFailed",  # the first failure, then no more: fires for an hour
                     ("9m", []), ("11m", [{"node": "n1", "severity": "warning"}]),
                     ("69m", [{"node": "n1", "severity": "warning"}]), ("72m", [])),
        ],
    },
    {
        "input_series": [
            _series("up", "1x4 0x10"),
            {"series": 'up{job="other",instance="10.0.0.9:9100"}', "values": "0x14"},
            _series("gpu_node_agent_subsystem_up", "0x14", subsystem="netacct"),
            _series("gpu_node_agent_subsystem_up", "1x2 0x12", subsystem="device-plugin"),
            _series("gpu_node_agent_subsystem_up", "1x14", subsystem="health"),
            _series("gpu_node_agent_netacct_up", "1x2 0x12", node="n2"),  # running, but its reads fail
        ],
        "alert_rule_test": [
            *_alerts("GpuNodeAgentDown", ("9m", []), ("10m", [{**AGENT, "severity": "warning"}])),
            *_alerts("GpuNodeAgentAccountingDown",
                     ("5m", [{**AGENT, "subsystem": "netacct", "severity": "warning"}]),
                     ("8m", [{**AGENT, "subsystem": "netacct", "severity": "warning"},
                             {**AGENT, "node": "n2", "severity": "warning"}])),
            *_alerts("GpuNodeAgentSubsystemDown",
                     ("5m", []), ("8m", [{**AGENT, "subsystem": "device-plugin", "severity": "warning"}])),
        ],
    },
    {   # 40 Mbit/s limit: pod a downloads at 39.6 Mbit/s (4.95 MB/s) from 5 min on; pod b at half its limit
        "input_series": [
            _series("gpu_node_agent_pod_internet_limit_bits_per_second", "40000000x40", namespace="team", pod="a",
                    direction="ingress"),
            _series("gpu_node_agent_pod_internet_shaped_bytes_total", "0x5 0+297000000x35", namespace="team",
                    pod="a", direction="ingress"),
            _series("gpu_node_agent_pod_internet_limit_bits_per_second", "40000000x40", namespace="team", pod="b",
                    direction="egress"),
            _series("gpu_node_agent_pod_internet_shaped_bytes_total", "0+150000000x40", namespace="team", pod="b",
                    direction="egress"),
        ],
        "alert_rule_test": _alerts(
            "PodInternetBandwidthAtLimit",
            ("15m", []),  # pending
            ("30m", [{"node": "n1", "namespace": "team", "pod": "a", "direction": "ingress", "severity": "info"}])),
    },
    {   # the DCGM check fails at 5 min and recovers at 25; the kernel-log check is off (0) throughout: no alert
        "input_series": [
            _series("gpu_node_agent_health_check_up", "1x4 0x20 1x5", check="dcgm"),
            _series("gpu_node_agent_health_check_up", "0x30", check="kmsg"),
        ],
        "alert_rule_test": _alerts("GpuNodeAgentDcgmUnreadable",
                                   ("19m", []), ("20m", [{**AGENT, "check": "dcgm", "severity": "warning"}]),
                                   ("26m", [])),
    },
    {   # GPU 5 vanishes at 5 min and is back at 15; a GPU link runs x8 from 5 min on
        "input_series": [
            _series("gpu_node_agent_gpus_expected", "8x30"),
            _series("gpu_node_agent_gpus_present", "8x4 7x10 8x15"),
            _series("gpu_node_agent_pcie_link_degraded", "0x4 1x25", device="0000:1b:00.0"),
            _series("gpu_node_agent_pcie_link_degraded", "0x30", device="0000:43:00.0"),
        ],
        "alert_rule_test": [
            *_alerts("GpuMissing", ("6m", []), ("7m", [{**AGENT, "severity": "critical"}]), ("16m", [])),
            *_alerts("PcieLinkDowntrained", ("14m", []),
                     ("15m", [{**AGENT, "device": "0000:1b:00.0", "severity": "warning"}])),
        ],
    },
    {   # GPU 0 loses an NVLink at 5 min for 10 min; GPU 2's fabric stays in progress, then fails; a reset request
        "input_series": [
            _series("gpu_node_agent_nvlink_links_down", "0x4 1x10 0x15", **GPU0),
            _series("gpu_node_agent_gpu_fabric_state", "1x20 0x10", **GPU2, state="in_progress"),
            _series("gpu_node_agent_gpu_fabric_state", "0x20 1x10", **GPU2, state="completed"),
            _series("gpu_node_agent_gpu_fabric_status", "_x20 999x10", **GPU2),
            _series("gpu_node_agent_gpu_recovery_action", "0x3 1x5 0x20", **GPU0, action="gpu_reset"),
            _series("gpu_node_agent_gpu_recovery_action", "1x3 0x5 1x20", **GPU0, action="none"),
        ],
        "alert_rule_test": [
            *_alerts("NvlinkInactive", ("9m", []), ("10m", [{**AGENT, **GPU0, "severity": "critical"}]),
                     ("20m", [])),
            *_alerts("GpuFabricUnhealthy", ("9m", []), ("10m", [{**AGENT, **GPU2, "state": "in_progress",
                                                                 "severity": "critical"}]),
                     ("30m", [{**AGENT, **GPU2, "severity": "critical"}])),
            *_alerts("GpuRecoveryActionRequested", ("4m", []),
                     ("5m", [{**AGENT, **GPU0, "action": "gpu_reset", "severity": "critical"}]), ("10m", [])),
        ],
    },
    {   # NICs: one PIX allocation a minute, and from 10 min on one missed PIX every 5 minutes (17 %); GPUs: PIX
        # only. Two misses within the first 10 minutes are not enough to say anything.
        "input_series": [
            _series("gpu_node_agent_allocations_total", "0+1x90", resource="nic", level="pix"),
            _series("gpu_node_agent_allocations_pix_missed_total", "0x9 0+0.2x80", resource="nic"),
            _series("gpu_node_agent_allocations_total", "0+1x90", resource="gpu", level="pix"),
            _series("gpu_node_agent_allocations_pix_missed_total", "0x90", resource="gpu"),
        ],
        "alert_rule_test": _alerts("GpuNicPixAlignmentLow", ("20m", []),
                                   ("50m", [{"node": "n1", "resource": "nic", "severity": "info"}])),
    },
    {   # link_downed grows at 5 min; mlx5_1/1 goes down and up three times within the hour
        "input_series": [
            _series("gpu_node_agent_nic_port_events_total", "0x4 1x30", device="mlx5_0", port="1",
                    counter="link_downed"),
            _series("gpu_node_agent_nic_port_events_total", "0+100x30", device="mlx5_0", port="1",
                    counter="symbol_error"),
            _series("gpu_node_agent_nic_link_flaps_total", "0x9 1x5 2x5 3x15", device="mlx5_1", port="1"),
        ],
        "alert_rule_test": [
            *_alerts("NicPortErrors", ("6m", [{"node": "n1", "device": "mlx5_0", "port": "1", "severity": "warning"}]),
                     ("21m", [])),
            *_alerts("NicLinkFlapping", ("20m", []),
                     ("25m", [{"node": "n1", "device": "mlx5_1", "port": "1", "severity": "warning"}])),
        ],
    },
]


@needs_promtool
def test_alerts_fire_when_they_should(tmp_path):
    _write_rules(tmp_path / "rules.yml", annotations=False)
    tests = [{"interval": "1m", **case} for case in UNIT_TESTS]
    spec = {"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": tests}
    path = tmp_path / "tests.yml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    result = _promtool("test", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(("expr", "names"), [
    ('up{job="x"} == 0', {"up"}),
    ('sum by (node, xid) (increase(a_total{xid=~"1|2"}[10m])) > 0 or (b unless b offset 10m)', {"a_total", "b"}),
    ('topk(5, rate(c_seconds_total{node=~"$node"}[$__rate_interval]))', {"c_seconds_total"}),
    ("-sum without (pod) (d) * 3600 / count(e{a='b'}) + 1e3", {"d", "e"}),
    ("label_values(f_info, node)", {"f_info"}),
    ("max(g) by (h) and on (i) group_left (j) k", {"g", "k"}),
])
def test_metric_name_extraction(expr, names):
    assert metric_names(expr) == names
