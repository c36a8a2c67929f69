"""The Grafana dashboard: valid JSON in the shape Grafana imports, every query on known metrics, and the
panels an operator looks for. (test_prometheus_scrape.py runs every query against a real Prometheus.)"""

from __future__ import annotations

import pytest

from tests.deploy.manifests import METRICS, dashboard, dashboard_panels, dashboard_queries, metric_names

QUERIES = dashboard_queries()


def test_dashboard_shape():
    board = dashboard()
    assert board["uid"] == "gpu-node-agent"
    assert board["title"]
    assert isinstance(board["schemaVersion"], int)
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in dashboard_panels():
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]


def test_panels_do_not_overlap():
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard()["panels"]:
        grid = panel["gridPos"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


@pytest.mark.parametrize(("title", "expr"), QUERIES, ids=[f"{t}:{i}" for i, (t, _) in enumerate(QUERIES)])
def test_query_uses_known_metrics(title, expr):
    names = metric_names(expr)
    assert names, f"{title}: no metric in {expr!r}"
    assert names <= METRICS, f"{title}: unknown metrics {names - METRICS}"


def test_variable_queries_use_known_metrics():
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] == "query":
            assert metric_names(variable["query"]["query"]) <= METRICS


@pytest.mark.parametrize("metric", [
    "gpu_node_agent_device_healthy",
    "gpu_node_agent_allocations_total",
    "gpu_node_agent_xid_errors_total",
    "gpu_node_agent_node_verdict",
    "gpu_node_agent_remediation_actions_total",
    "gpu_node_agent_apiserver_requests_total",
    "gpu_node_agent_network_receive_bytes_total",
    "gpu_node_agent_network_transmit_bytes_total",
    "gpu_node_agent_pod_network_receive_bytes_total",
    "gpu_node_agent_pod_network_transmit_bytes_total",
    "gpu_node_agent_pod_internet_shaped_bytes_total",
    "gpu_node_agent_pod_internet_limit_bits_per_second",
    "gpu_node_agent_pod_internet_dropped_packets_total",
    "gpu_node_agent_nic_link_up",
    "gpu_node_agent_health_check_up",
    "gpu_node_agent_nic_port_events_total",
    "gpu_node_agent_nic_link_flaps_total",
    "gpu_node_agent_pcie_link_degraded",
    "gpu_node_agent_pcie_aer_errors_total",
    "gpu_node_agent_gpus_expected",
    "gpu_node_agent_gpus_present",
    "process_resident_memory_bytes",
    "process_cpu_seconds_total",
    "gpu_node_agent_nvlink_links_down",
    "gpu_node_agent_gpu_fabric_state",
    "gpu_node_agent_gpu_recovery_action",
])
def test_dashboard_shows(metric):
    assert any(metric in metric_names(expr) for _, expr in QUERIES), f"no panel shows {metric}"


def test_allocations_are_broken_down_by_resource_and_level():
    exprs = [expr for _, expr in QUERIES if "gpu_node_agent_allocations_total" in metric_names(expr)]
    assert any("by (resource, level)" in expr for expr in exprs)


def test_traffic_panels_split_internet_and_cluster_in_and_out():
    exprs = [expr for _, expr in QUERIES if "gpu_node_agent_network_receive_bytes_total" in metric_names(expr)
             or "gpu_node_agent_network_transmit_bytes_total" in metric_names(expr)]
    assert any("traffic" in expr and "receive" in expr for expr in exprs)
    assert any("traffic" in expr and "transmit" in expr for expr in exprs)
    assert any("by (namespace" in expr for _, expr in QUERIES), "per-namespace traffic"
