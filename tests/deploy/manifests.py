"""Shared helpers of the deploy tests: the manifests as data, the metric catalog, PromQL metric-name extraction.

No pytest here. `METRICS` is the list of metric names the deploy artifacts (alerts, dashboard) may use: the
agent's documented metrics plus the standard process/platform ones and Prometheus's `up`. A name a query uses
that is not here is a typo or a metric nobody exports.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "dashboards" / "gpu-node-agent.json"
DOCKERFILE = ROOT / "images" / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
MANIFEST_FILES = ("namespace.yaml", "serviceaccount.yaml", "rbac.yaml", "configmap.yaml", "daemonset.yaml",
                  "service.yaml")
# The Prometheus Operator's objects: the kustomize Component deploy/monitoring (they need its CRDs, so the base
# leaves them out and applies on a bare cluster)
MONITORING_FILES = ("monitoring/servicemonitor.yaml", "monitoring/prometheusrule.yaml")
NAMESPACE = "gpu-node-agent"
JOB = "gpu-node-agent"
CRD_GROUPS = ("monitoring.coreos.com/",)

# The agent's metrics (issue 5 health, 4 allocation, 6 remediation, 7 netacct, 8 process, 16 shaping), as scraped.
AGENT_METRICS: dict[str, str] = {
    "gpu_node_agent_build_info": "gauge {version}: 1",
    "gpu_node_agent_subsystem_up": "gauge {subsystem}: 1 running, 0 failed",
    "gpu_node_agent_hardware_rescans_total": "counter: full rescans, at most one a second",
    "gpu_node_agent_xid_errors_total": "counter {gpu,uuid,pci_bus_id,xid}",
    "gpu_node_agent_ecc_errors_total": "counter {gpu,uuid,pci_bus_id,error_type,counter_type}",
    "gpu_node_agent_retired_pages": "gauge {gpu,uuid,pci_bus_id,cause}",
    "gpu_node_agent_retired_pages_pending": "gauge {gpu,uuid,pci_bus_id}: 1 waiting for a reset",
    "gpu_node_agent_remapped_rows": "gauge {gpu,uuid,pci_bus_id,error_type}",
    "gpu_node_agent_row_remap_pending": "gauge {gpu,uuid,pci_bus_id}: 1 waiting for a reset",
    "gpu_node_agent_gpu_reset_pending": "gauge {gpu,uuid,pci_bus_id}: 1 a GPU reset pending (advisory or cure)",
    "gpu_node_agent_row_remap_failure": "gauge {gpu,uuid,pci_bus_id}: 1 remap failed",
    "gpu_node_agent_device_healthy": "gauge {resource,device}: 1 Healthy, 0 Unhealthy",
    "gpu_node_agent_nic_link_up": "gauge {pci_bus_id,netdev,rdma}",
    "gpu_node_agent_node_verdict": "gauge {verdict}: 1 for the current verdict, 0 for the others",
    "gpu_node_agent_health_check_up": "gauge {check}",
    "gpu_node_agent_nic_port_events_total": "counter {device,port,counter}: the kernel's value",
    "gpu_node_agent_nic_link_flaps_total": "counter {device,port}: down->up cycles seen",
    "gpu_node_agent_pcie_link_degraded": "gauge {device}: 1 when narrower than max width",
    "gpu_node_agent_pcie_link_width_lanes": "gauge {device,which}",
    "gpu_node_agent_pcie_link_speed_gts": "gauge {device,which}",
    "gpu_node_agent_pcie_aer_errors_total": "counter {device,severity}",
    "gpu_node_agent_gpus_expected": "gauge",
    "gpu_node_agent_gpus_present": "gauge",
    "gpu_node_agent_gpus_healthy": "gauge: GPUs present and Healthy",
    "gpu_node_agent_incidents_total": "counter: new fault findings recorded on the Node",
    "gpu_node_agent_nvsentinel_events_total": "counter {outcome}: health events for NVSentinel's connector",
    "gpu_node_agent_nvlink_links_active": "gauge {gpu,uuid,pci_bus_id}",
    "gpu_node_agent_nvlink_links_inactive": "gauge {gpu,uuid,pci_bus_id}",
    "gpu_node_agent_nvlink_links_down": "gauge {gpu,uuid,pci_bus_id}: inactive links its peers have active",
    "gpu_node_agent_gpu_fabric_state": "gauge {gpu,uuid,pci_bus_id,state}: 1 for the current state",
    "gpu_node_agent_gpu_fabric_status": "gauge {gpu,uuid,pci_bus_id}: NVML return code of the registration",
    "gpu_node_agent_gpu_recovery_action": "gauge {gpu,uuid,pci_bus_id,action}: 1 for the driver's request",
    "gpu_node_agent_kmsg_records_lost_total": "counter",
    "gpu_node_agent_dcgm_scrapes_total": "counter {result}",
    "gpu_node_agent_dcgm_unknown_gpus": "gauge",
    "gpu_node_agent_allocations_total": "counter {resource,level}",
    "gpu_node_agent_allocations_pix_missed_total": "counter {resource}: worse than PIX although PIX was offered",
    "gpu_node_agent_preference_fallbacks_total": "counter {reason}: preference calls without partner facts",
    "gpu_node_agent_pod_spec_fetches_total": "counter {outcome}: pod specs fetched for preference calls",
    "gpu_node_agent_devices_not_served": "gauge {reason}: devices found but not advertised",
    "gpu_node_agent_preferred_allocation_failures_total": "counter {resource}",
    "gpu_node_agent_remediation_actions_total": "counter {action,result}",
    "gpu_node_agent_remediation_latched": "gauge: 1 while NeedsHumanAttention",
    "gpu_node_agent_apiserver_requests_total": "counter {verb,code}",
    "gpu_node_agent_node_label_writes_total": "counter {outcome}",
    "gpu_node_agent_apiserver_foreign_pods_total": "counter {request}: pods of other nodes skipped in a LIST answer",
    "gpu_node_agent_dra_slice_publishes_total": "counter {result}",
    "gpu_node_agent_dra_claims_total": "counter {call,result}",
    "gpu_node_agent_dra_state_unreadable": "gauge: 1 the prepared-claims record cannot be read (fails closed)",
    "gpu_node_agent_network_receive_bytes_total": "counter {traffic,scope}",
    "gpu_node_agent_network_transmit_bytes_total": "counter {traffic,scope}",
    "gpu_node_agent_network_receive_packets_total": "counter {traffic,scope}",
    "gpu_node_agent_network_transmit_packets_total": "counter {traffic,scope}",
    "gpu_node_agent_pod_network_receive_bytes_total": "counter {namespace,pod,traffic}",
    "gpu_node_agent_pod_network_transmit_bytes_total": "counter {namespace,pod,traffic}",
    "gpu_node_agent_netacct_up": "gauge: 1 when the last read of every counter succeeded",
    "gpu_node_agent_netacct_read_duration_seconds": "gauge",
    "gpu_node_agent_netacct_sync_failures_total": "counter",
    "gpu_node_agent_netacct_backend_info": "gauge {backend}",
    "gpu_node_agent_netacct_layout_info": "gauge {layout}",
    "gpu_node_agent_netacct_repairs_total": "counter {what}: objects someone else removed that the agent re-created",
    "gpu_node_agent_pod_internet_limit_bits_per_second": "gauge {namespace,pod,direction}",
    "gpu_node_agent_pod_internet_shaped_bytes_total": "counter {namespace,pod,direction}",
    "gpu_node_agent_pod_internet_dropped_packets_total": "counter {namespace,pod,direction}",
    "gpu_node_agent_shaping_up": "gauge: 1 when the last read of the shapers' counters succeeded",
    "gpu_node_agent_shaping_pods": "gauge {state}",
    "gpu_node_agent_shaping_sync_failures_total": "counter",
    "gpu_node_agent_shaping_invalid_annotations_total": "counter: bandwidth annotation values refused",
}
# Exposed by every agent, simulate mode included: the scrape test checks that they are really there.
CORE_METRICS = ("gpu_node_agent_build_info", "gpu_node_agent_subsystem_up")
STANDARD_METRICS = frozenset({
    "up",
    "process_resident_memory_bytes", "process_virtual_memory_bytes", "process_cpu_seconds_total",
    "process_start_time_seconds", "process_open_fds", "process_max_fds", "python_info",
})
METRICS = frozenset(AGENT_METRICS) | STANDARD_METRICS


def load_documents(name: str) -> list[dict[str, Any]]:
    """The YAML documents of one file under deploy/ (empty documents dropped)."""
    with (DEPLOY / name).open(encoding="utf-8") as handle:
        return [doc for doc in yaml.safe_load_all(handle) if doc]


def all_documents(*, monitoring: bool = True) -> Iterator[tuple[str, dict[str, Any]]]:
    """(file name, document) for every manifest the kustomization lists, and the monitoring component's."""
    for name in MANIFEST_FILES + (MONITORING_FILES if monitoring else ()):
        for doc in load_documents(name):
            yield name, doc


def one(kind: str, name: str | None = None) -> dict[str, Any]:
    """The single manifest of `kind` (and `name`)."""
    found = [doc for _, doc in all_documents()
             if doc["kind"] == kind and (name is None or doc["metadata"]["name"] == name)]
    if len(found) != 1:
        raise LookupError(f"expected one {kind} {name or ''}, found {len(found)}")
    return found[0]


def agent_container() -> dict[str, Any]:
    """The DaemonSet's agent container."""
    containers = one("DaemonSet")["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "agent")


def configmap_config_text() -> str:
    """The agent config file carried by the ConfigMap."""
    return one("ConfigMap", "gpu-node-agent-config")["data"]["config.yaml"]


def rule_groups() -> list[dict[str, Any]]:
    """The PrometheusRule's groups: plain Prometheus rule-file syntax."""
    return one("PrometheusRule")["spec"]["groups"]


def alert_rules() -> list[dict[str, Any]]:
    """Every alerting rule."""
    return [rule for group in rule_groups() for rule in group["rules"] if "alert" in rule]


def dashboard() -> dict[str, Any]:
    """The Grafana dashboard as data."""
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def dashboard_panels() -> list[dict[str, Any]]:
    """Every panel, rows' nested panels included; rows themselves are left out."""
    out: list[dict[str, Any]] = []
    for panel in dashboard()["panels"]:
        if panel.get("type") == "row":
            out.extend(panel.get("panels", []))
        else:
            out.append(panel)
    return out


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every panel target."""
    return [(panel["title"], target["expr"]) for panel in dashboard_panels() for target in panel.get("targets", [])]


def substitute_grafana_variables(expr: str) -> str:
    """Grafana's variables replaced by values Prometheus accepts, so the query can be run as is."""
    return (expr.replace("$__rate_interval", "1m").replace("$__interval", "1m").replace("$__range", "1h")
            .replace("$node", ".*"))


# --- PromQL: which metric names does an expression use? (a lexer, not a parser; good enough for our queries) ---
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGES = re.compile(r"\[[^\[\]]*\]")
_LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_OFFSETS = re.compile(r"\boffset\s+-?\w+")
_NUMBERS = re.compile(r"(?<![\w:])(?:0x[0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)")
_CALLS = re.compile(r"\b[a-zA-Z_][a-zA-Z0-9_]*\s*\(")
_IDENTIFIERS = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*([^,()]+(?:\{[^}]*\})?)\s*(?:,[^)]*)?\)\s*$")
_KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left",
                       "group_right", "inf", "nan", "Inf", "NaN", "atan2"})


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (Grafana variables and label_values() understood)."""
    match = _LABEL_VALUES.match(expr)
    if match:
        expr = match.group(1)
    text = _STRINGS.sub('""', expr)
    text = re.sub(r"\$\w+", " ", text)
    previous = None
    while previous != text:  # nested matchers/ranges are not PromQL, but subqueries nest ranges in parentheses
        previous = text
        text = _MATCHERS.sub(" ", text)
        text = _RANGES.sub(" ", text)
    text = _LABEL_LISTS.sub(" ", text)
    text = _OFFSETS.sub(" ", text)
    text = _NUMBERS.sub(" ", text)
    text = _CALLS.sub("(", text)
    return {name for name in _IDENTIFIERS.findall(text) if name not in _KEYWORDS}


def binary(name: str) -> str | None:
    """Path of a Prometheus binary, or None (Debian package `prometheus` provides prometheus and promtool)."""
    return shutil.which(name)


PROMETHEUS_MISSING = "needs the prometheus/promtool binaries (Debian: apt-get install -y prometheus)"


# Strategic-merge keys of the lists the overlay's patch touches (k8s.io/api core/v1 `patchMergeKey` tags).
_MERGE_KEYS = {"containers": "name", "env": "name", "volumeMounts": "mountPath", "volumes": "name"}


def _merge(base: Any, patch: Any, key: str = "") -> Any:
    """Strategic merge as kustomize applies it, for maps and the keyed lists above (enough for this patch)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for name, value in patch.items():
            merged[name] = _merge(base[name], value, name) if name in base else value
        return merged
    if isinstance(base, list) and isinstance(patch, list) and key in _MERGE_KEYS:
        field = _MERGE_KEYS[key]
        merged_list = list(base)
        for item in patch:
            at = next((i for i, old in enumerate(merged_list) if old.get(field) == item.get(field)), None)
            if at is None:
                merged_list.append(item)
            else:
                merged_list[at] = _merge(merged_list[at], item)
        return merged_list
    return patch


def apply_patch(docs: list[dict[str, Any]], patch: dict[str, Any]) -> list[dict[str, Any]]:
    """A strategic-merge patch file applied to the object of the same kind and name."""
    target = (patch["kind"], patch["metadata"]["name"])
    return [_merge(doc, patch) if (doc["kind"], doc["metadata"]["name"]) == target else doc for doc in docs]


def render_overlay(name: str) -> list[dict[str, Any]]:
    """overlays/<name> (the base manifests plus its patches) rendered as kustomize would, without kubectl."""
    overlay = ROOT / "overlays" / name
    kustomization = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["../../deploy"]
    monitoring = "../../deploy/monitoring" in kustomization.get("components", [])
    docs = [doc for _name, doc in all_documents(monitoring=monitoring)]
    for entry in kustomization.get("patches", []):
        docs = apply_patch(docs, yaml.safe_load((overlay / entry["path"]).read_text()))
    return docs
