"""A real Prometheus scrapes a real agent: `python -m agent run --simulate dgx-h100` in a subprocess, Debian's
`prometheus` binary scraping it every second with the deploy/ alert rules loaded, queried over its HTTP API.
Also every dashboard query run by that Prometheus (`promtool check metrics` over agents with every subsystem on
is `test_metrics_promtool.py`).

Skipped (with the reason) where the prometheus/promtool binaries are missing: `apt-get install -y prometheus`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from agent import __version__
from tests.deploy.manifests import (
    CORE_METRICS,
    JOB,
    PROMETHEUS_MISSING,
    binary,
    dashboard_queries,
    rule_groups,
    substitute_grafana_variables,
)
from tests.fakes.ports import free_port

PROMETHEUS = binary("prometheus")
pytestmark = [
    pytest.mark.skipif(PROMETHEUS is None, reason=PROMETHEUS_MISSING),
    pytest.mark.skipif(sys.platform != "linux", reason="the agent's simulate mode uses unix sockets"),
]

START_TIMEOUT = 60.0  # generous: a busy 2-core CI machine; these bound waiting, they assert nothing about speed
T = TypeVar("T")


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - loopback http only
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
    except (urllib.error.URLError, OSError) as error:
        return 0, str(error)


def _wait_for(what: str, probe: Callable[[], T | None], processes: list[subprocess.Popen],
              logs: list[Path], timeout: float = START_TIMEOUT) -> T:
    """Poll `probe` until it returns something truthy; fail with the logs if a process dies or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        result = probe()
        if result:
            return result
        dead = [p for p in processes if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            tails = "\n".join(f"--- {log.name}:\n{log.read_text(errors='replace')[-4000:]}" for log in logs)
            why = f"{dead[0].args[0]} exited with {dead[0].returncode}" if dead else "timed out"
            pytest.fail(f"waiting for {what}: {why}\n{tails}")
        time.sleep(0.25)


def _ok(url: str) -> tuple[int, str] | None:
    """The response when it is 200, else None (for waiting)."""
    response = _get(url)
    return response if response[0] == 200 else None


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@dataclass
class Stack:
    agent_port: int
    prometheus_url: str
    processes: list[subprocess.Popen]
    logs: list[Path]

    def query(self, expr: str) -> tuple[int, dict[str, Any]]:
        url = f"{self.prometheus_url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
        status, body = _get(url)
        try:
            return status, json.loads(body)
        except json.JSONDecodeError:
            return status, {"status": "error", "error": body}

    def vector(self, expr: str) -> list[dict[str, Any]]:
        status, body = self.query(expr)
        if status != 200 or body.get("status") != "success":
            return []
        return body["data"]["result"]

    def wait(self, what: str, probe: Callable[[], T | None]) -> T:
        return _wait_for(what, probe, self.processes, self.logs)


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    assert PROMETHEUS is not None
    workdir = Path(tempfile.mkdtemp(prefix="gnap"))  # short: the agent's unix socket paths live under it
    processes: list[subprocess.Popen] = []
    try:
        plugin_dir = workdir / "dp"
        plugin_dir.mkdir()
        agent_port, prometheus_port = free_port(), free_port()
        agent_log, prometheus_log = workdir / "agent.log", workdir / "prometheus.log"
        with agent_log.open("w") as log:
            processes.append(subprocess.Popen(
                [sys.executable, "-m", "agent", "run", "--simulate", "dgx-h100",
                 "--metrics-address", f"127.0.0.1:{agent_port}", "--device-plugin-dir", str(plugin_dir),
                 "--state-dir", str(workdir / "state"), "--log-format", "json"],
                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}))
        rules = workdir / "rules.yml"
        rules.write_text(yaml.safe_dump({"groups": rule_groups()}, sort_keys=False), encoding="utf-8")
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules)],
            "scrape_configs": [{
                "job_name": JOB,
                "static_configs": [{"targets": [f"127.0.0.1:{agent_port}"], "labels": {"node": "sim-node"}}],
            }],
        }
        config_path = workdir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config), encoding="utf-8")
        with prometheus_log.open("w") as log:
            processes.append(subprocess.Popen(
                [PROMETHEUS, f"--config.file={config_path}", f"--storage.tsdb.path={workdir / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{prometheus_port}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, cwd=workdir))
        stack = Stack(agent_port, f"http://127.0.0.1:{prometheus_port}", processes, [agent_log, prometheus_log])
        stack.wait("Prometheus to be ready", lambda: _get(f"{stack.prometheus_url}/-/ready")[0] == 200)
        yield stack
    finally:
        for process in reversed(processes):
            _stop(process)
        shutil.rmtree(workdir, ignore_errors=True)


def test_prometheus_scrapes_the_agent_with_up_1_and_agent_series(stack):
    up = stack.wait("up{job=gpu-node-agent} == 1",
                    lambda: [s for s in stack.vector(f'up{{job="{JOB}"}}') if s["value"][1] == "1"])
    assert up[0]["metric"]["instance"] == f"127.0.0.1:{stack.agent_port}"

    def scraped() -> set[str] | None:
        names = {s["metric"]["__name__"] for s in stack.vector(f'{{__name__=~"gpu_node_agent_.+",job="{JOB}"}}')}
        return names if names >= set(CORE_METRICS) else None

    # the first scrape can land before the supervisor has started every subsystem (no subsystem_up sample yet)
    names = stack.wait(f"every one of {sorted(CORE_METRICS)} scraped", scraped)
    for name in CORE_METRICS:
        assert name in names, f"{name} missing from the scraped series {sorted(names)}"
    build = stack.vector(f'gpu_node_agent_build_info{{job="{JOB}"}}')
    assert build and build[0]["metric"]["version"] == __version__
    plugin = stack.wait("the device-plugin subsystem up",
                        lambda: stack.vector(f'gpu_node_agent_subsystem_up{{job="{JOB}",subsystem="device-plugin"}}'
                                             " == 1"))
    assert plugin[0]["metric"]["node"] == "sim-node"


def test_alert_rules_evaluate_without_errors(stack):
    def evaluated() -> list[dict[str, Any]] | None:
        status, body = _get(f"{stack.prometheus_url}/api/v1/rules")
        if status != 200:
            return None
        rules = [r for g in json.loads(body)["data"]["groups"] for r in g["rules"]]
        return rules if rules and all(r["health"] != "unknown" for r in rules) else None

    rules = stack.wait("every alert rule to be evaluated", evaluated)
    expected = sum(len(group["rules"]) for group in rule_groups())
    assert len(rules) == expected
    broken = {r["name"]: r.get("lastError") for r in rules if r["health"] != "ok"}
    assert not broken, broken


QUERIES = dashboard_queries()


@pytest.mark.parametrize(("title", "expr"), QUERIES, ids=[f"{t}:{i}" for i, (t, _) in enumerate(QUERIES)])
def test_dashboard_query_runs(stack, title, expr):
    status, body = stack.query(substitute_grafana_variables(expr))
    assert status == 200 and body.get("status") == "success", f"{title}: {body.get('error')}"


def test_health_endpoints_answer(stack):
    assert _get(f"http://127.0.0.1:{stack.agent_port}/healthz")[0] == 200
    status, text = stack.wait("/readyz 200", lambda: _ok(f"http://127.0.0.1:{stack.agent_port}/readyz"))
    assert status == 200 and text.strip() == "ready"

