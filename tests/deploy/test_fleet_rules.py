"""The fleet recording rules and their alert (deploy/monitoring/prometheusrule.yaml, group gpu-node-agent.fleet),
run by `promtool test rules` over synthetic series: the GPU ratio is a fleet-wide sum over a sum (not an average of
node ratios) and ignores agents that do not export the healthy gauge yet, the unhealthy-node count is 0 rather than
absent, the incidents' 1-day increase sees through a counter reset (an agent restart), and the alert fires."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.manifests import PROMETHEUS_MISSING, binary, rule_groups

PROMTOOL = binary("promtool")
RULES = ("gpu_node_agent:gpus_healthy:ratio", "gpu_node_agent:nodes_unhealthy:count",
         "gpu_node_agent:node_incidents:increase1d")


def series(name: str, values: str, node: str, **labels: str) -> dict[str, str]:
    text = ",".join(f'{k}="{v}"' for k, v in {"job": "gpu-node-agent", "instance": f"{node}:10437", "node": node,
                                               **labels}.items())
    return {"series": f"{name}{{{text}}}", "values": values}


def sample(name: str, value: float, **labels: str) -> dict[str, Any]:
    text = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return {"labels": f"{name}{{{text}}}" if text else name, "value": value}


CASES: list[dict[str, Any]] = [
    {   # n1: 8 GPUs, two fail at 10 min; n2: 2 GPUs, none healthy; n3: an agent without the healthy gauge
        "interval": "1m",
        "input_series": [
            series("gpu_node_agent_gpus_expected", "8x40", "n1"),
            series("gpu_node_agent_gpus_healthy", "8x9 6x31", "n1"),
            series("gpu_node_agent_gpus_expected", "2x40", "n2"),
            series("gpu_node_agent_gpus_healthy", "0x40", "n2"),
            series("gpu_node_agent_gpus_expected", "8x40", "n3"),
            series("gpu_node_agent_node_verdict", "1x9 0x31", "n1", verdict="healthy"),
            series("gpu_node_agent_node_verdict", "0x9 1x31", "n1", verdict="drain"),
            series("gpu_node_agent_node_verdict", "1x40", "n2", verdict="healthy"),
            series("gpu_node_agent_remediation_latched", "0x4 1x36", "n2"),
            series("gpu_node_agent_node_verdict", "1x40", "n3", verdict="healthy"),
        ],
        "promql_expr_test": [
            # 8 / 10, where an average of node ratios would say 0.5 and counting n3's GPUs 8 / 18
            {"expr": RULES[0], "eval_time": "5m", "exp_samples": [sample(RULES[0], 0.8)]},
            {"expr": RULES[0], "eval_time": "15m", "exp_samples": [sample(RULES[0], 0.6)]},
            {"expr": RULES[1], "eval_time": "2m", "exp_samples": [sample(RULES[1], 0)]},
            {"expr": RULES[1], "eval_time": "6m", "exp_samples": [sample(RULES[1], 1)]},
            {"expr": RULES[1], "eval_time": "12m", "exp_samples": [sample(RULES[1], 2)]},
        ],
        "alert_rule_test": [
            {"eval_time": "14m", "alertname": "GpuFleetHealthyRatioLow", "exp_alerts": []},  # pending
            {"eval_time": "16m", "alertname": "GpuFleetHealthyRatioLow",
             "exp_alerts": [{"exp_labels": {"severity": "warning"}}]},
        ],
    },
    {   # hourly samples over a day: n1's agent restarts at 6 h (its counter resets to 0), n2 never has an incident
        "interval": "1h",
        "input_series": [
            series("gpu_node_agent_incidents_total", "0 0 0 1 2 3 0 1 2 2x16", "n1"),
            series("gpu_node_agent_incidents_total", "0x25", "n2"),
            series("gpu_node_agent_gpus_expected", "8x25", "n1"),
            series("gpu_node_agent_gpus_healthy", "8x25", "n1"),
        ],
        "promql_expr_test": [
            # 3 before the restart and 2 after it: 5, not 2 (which a plain difference would say)
            {"expr": RULES[2], "eval_time": "24h",
             "exp_samples": [sample(RULES[2], 5, node="n1"), sample(RULES[2], 0, node="n2")]},
            {"expr": RULES[0], "eval_time": "24h", "exp_samples": [sample(RULES[0], 1)]},
        ],
        "alert_rule_test": [{"eval_time": "24h", "alertname": "GpuFleetHealthyRatioLow", "exp_alerts": []}],
    },
]


def test_the_three_recording_rules_exist():
    recorded = {rule["record"] for group in rule_groups() for rule in group["rules"] if "record" in rule}
    assert set(RULES) <= recorded


@pytest.mark.skipif(PROMTOOL is None, reason=PROMETHEUS_MISSING)
def test_promtool_checks_and_tests_the_fleet_rules(tmp_path: Path):
    assert PROMTOOL is not None
    groups = [{**g, "rules": [{k: v for k, v in r.items() if k != "annotations"} for r in g["rules"]]}
              for g in rule_groups()]
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": groups}, sort_keys=False), encoding="utf-8")
    spec = {"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": CASES}
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    for args in (("check", "rules", str(tmp_path / "rules.yml")), ("test", "rules", str(tmp_path / "tests.yml"))):
        result = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120, check=False)
        assert result.returncode == 0, result.stdout + result.stderr
