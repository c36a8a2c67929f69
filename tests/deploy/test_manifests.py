"""Every manifest under deploy/ against the Kubernetes schemas (kubernetes-validate, strict), offline.

Strict mode rejects unknown fields (a typo such as `hostNetwrok` would otherwise be silently dropped by the API
server). kubernetes-validate has no schemas for CRDs, so the ServiceMonitor and PrometheusRule are checked
structurally here and semantically (promtool) in test_prometheus_rules.py.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess

import kubernetes_validate
import pytest
import yaml

from tests.deploy.manifests import (
    CRD_GROUPS,
    DASHBOARD,
    DEPLOY,
    JOB,
    MANIFEST_FILES,
    MONITORING_FILES,
    NAMESPACE,
    all_documents,
    load_documents,
    one,
    render_overlay,
)

# The oldest Kubernetes minor still commonly run, and the newest the bundled schemas know.
VERSIONS = ("1.30", kubernetes_validate.latest_version())
DOCUMENTS = list(all_documents())
BUILTIN = [(name, doc) for name, doc in DOCUMENTS if not doc["apiVersion"].startswith(CRD_GROUPS)]
DURATION = re.compile(r"^(\d+(ms|s|m|h|d|w|y))+$")


def _id(item: tuple[str, dict]) -> str:
    name, doc = item
    return f"{name}:{doc['kind']}/{doc['metadata']['name']}"


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("item", BUILTIN, ids=[_id(item) for item in BUILTIN])
def test_manifest_is_valid_in_strict_mode(item, version):
    _, doc = item
    kubernetes_validate.validate(doc, version, strict=True)


def test_strict_validation_catches_an_unknown_field():
    """Guards the test above: a misspelt field must fail, or the validation proves nothing."""
    daemonset = copy.deepcopy(one("DaemonSet"))
    spec = daemonset["spec"]["template"]["spec"]
    spec["hostNetwrok"] = spec.pop("hostNetwork")
    with pytest.raises(kubernetes_validate.ValidationError, match="hostNetwrok"):
        kubernetes_validate.validate(daemonset, VERSIONS[-1], strict=True)


def test_every_namespaced_object_is_in_the_agent_namespace():
    cluster_scoped = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
    for name, doc in DOCUMENTS:
        namespace = doc["metadata"].get("namespace")
        if doc["kind"] in cluster_scoped:
            assert namespace is None, f"{name}: {doc['kind']} is cluster-scoped"
        else:
            assert namespace == NAMESPACE, f"{name}: {doc['kind']} {doc['metadata']['name']} in {namespace!r}"


def test_namespace_allows_privileged_pods():
    labels = one("Namespace")["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"


def test_kustomization_lists_every_manifest_and_the_dashboard():
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text(encoding="utf-8"))
    assert kustomization["namespace"] == NAMESPACE
    assert list(kustomization["resources"]) == list(MANIFEST_FILES)
    on_disk = {path.name for path in DEPLOY.glob("*.yaml")} - {"kustomization.yaml"}
    assert on_disk == set(MANIFEST_FILES), "a manifest in deploy/ is missing from kustomization.yaml"
    component = yaml.safe_load((DEPLOY / "monitoring" / "kustomization.yaml").read_text(encoding="utf-8"))
    assert component["kind"] == "Component"
    assert [f"monitoring/{name}" for name in component["resources"]] == list(MONITORING_FILES)
    generated = [file for generator in kustomization["configMapGenerator"] for file in generator["files"]]
    assert generated == [str(DASHBOARD.relative_to(DEPLOY))]
    for image in kustomization["images"]:
        assert any(c["image"].startswith(image["name"] + ":")
                   for c in one("DaemonSet")["spec"]["template"]["spec"]["containers"])


def test_the_base_applies_on_a_bare_cluster_and_monitoring_is_a_component():
    """Issue 29: `kubectl apply -k deploy/` failed without the Prometheus Operator's CRDs."""
    base = {doc["kind"] for _name, doc in all_documents(monitoring=False)}
    assert not base & {"ServiceMonitor", "PrometheusRule", "PodMonitor"}
    assert {doc["kind"] for _name, doc in all_documents()} - base == {"ServiceMonitor", "PrometheusRule"}
    assert {d["kind"] for d in render_overlay("monitoring")} >= {"ServiceMonitor", "PrometheusRule", "DaemonSet"}
    assert not {d["kind"] for d in render_overlay("dropin")} & {"ServiceMonitor", "PrometheusRule"}


KUBECTL = shutil.which("kubectl")


@pytest.mark.skipif(KUBECTL is None, reason="needs kubectl (its built-in kustomize renders deploy/)")
def test_kustomize_build_renders_valid_objects_and_the_dashboard_configmap():
    assert KUBECTL is not None
    result = subprocess.run([KUBECTL, "kustomize", str(DEPLOY)], capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stderr
    rendered = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    kinds = sorted(doc["kind"] for doc in rendered)
    assert kinds == sorted([doc["kind"] for _, doc in all_documents(monitoring=False)] + ["ConfigMap"])
    monitored = subprocess.run([KUBECTL, "kustomize", str(DEPLOY.parent / "overlays" / "monitoring")],
                               capture_output=True, text=True, timeout=120, check=False)
    assert monitored.returncode == 0, monitored.stderr
    extra = sorted(doc["kind"] for doc in yaml.safe_load_all(monitored.stdout) if doc)
    assert extra == sorted([*kinds, "PrometheusRule", "ServiceMonitor"])
    for doc in rendered:
        if not doc["apiVersion"].startswith(CRD_GROUPS):
            kubernetes_validate.validate(doc, VERSIONS[-1], strict=True)
    (board,) = [doc for doc in rendered if doc["kind"] == "ConfigMap" and "gpu-node-agent.json" in doc["data"]]
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(board["data"]["gpu-node-agent.json"]) == json.loads(DASHBOARD.read_text(encoding="utf-8"))
    (daemonset,) = [doc for doc in rendered if doc["kind"] == "DaemonSet"]
    assert daemonset["spec"]["selector"] == one("DaemonSet")["spec"]["selector"], "selectors must stay as written"


# --- CRDs: structural checks (no schema available offline) ------------------------------------------------


def test_servicemonitor_selects_the_service_port():
    monitor = one("ServiceMonitor")
    service = one("Service")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    spec = monitor["spec"]
    assert set(spec) <= {"jobLabel", "selector", "namespaceSelector", "endpoints", "targetLabels", "podTargetLabels"}
    labels = service["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items(), "the selector does not match the Service"
    assert labels[spec["jobLabel"]] == JOB, "alerts and dashboard select job=gpu-node-agent"
    assert service["metadata"]["namespace"] in spec["namespaceSelector"]["matchNames"]
    port_names = {port["name"] for port in service["spec"]["ports"]}
    allowed = {"port", "path", "interval", "scrapeTimeout", "honorLabels", "relabelings", "metricRelabelings",
               "scheme"}
    for endpoint in spec["endpoints"]:
        assert set(endpoint) <= allowed, f"unexpected endpoint keys {set(endpoint) - allowed}"
        assert endpoint["port"] in port_names
        assert endpoint["path"] == "/metrics"
        assert DURATION.match(endpoint["interval"]) and DURATION.match(endpoint["scrapeTimeout"])
        for relabel in endpoint.get("relabelings", []):
            assert set(relabel) <= {"sourceLabels", "targetLabel", "action", "regex", "replacement", "separator"}


def test_service_is_headless_over_the_metrics_port():
    service = one("Service")
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= \
        one("DaemonSet")["spec"]["template"]["metadata"]["labels"].items()
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == "metrics"


def test_prometheusrule_structure():
    rule = one("PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(rule["spec"]) == {"groups"}
    names = [group["name"] for group in rule["spec"]["groups"]]
    assert len(names) == len(set(names)), "group names must be unique"
    alerts = []
    for group in rule["spec"]["groups"]:
        assert set(group) <= {"name", "interval", "rules"}
        for item in group["rules"]:
            assert isinstance(item["expr"], str) and item["expr"].strip()
            if "record" in item:  # a recording rule: `level:metric:operation`, no alert fields
                assert set(item) <= {"record", "expr", "labels"}, item["record"]
                assert re.fullmatch(r"[a-z_]+:[a-z_]+:[a-z0-9_]+", item["record"]), item["record"]
                continue
            assert set(item) <= {"alert", "expr", "for", "labels", "annotations"}, item.get("alert")
            if "for" in item:
                assert DURATION.match(item["for"])
            assert all(isinstance(v, str) for v in item.get("labels", {}).values())
            assert item["labels"]["severity"] in {"critical", "warning", "info"}
            assert {"summary", "description", "runbook"} <= set(item["annotations"]), item["alert"]
            alerts.append(item["alert"])
    assert len(alerts) == len(set(alerts)), "alert names must be unique"


def test_every_file_parses_as_yaml_documents():
    for name in MANIFEST_FILES:
        assert load_documents(name), name
