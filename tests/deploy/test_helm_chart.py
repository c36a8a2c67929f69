"""deploy/helm/gpu-node-agent rendered and linted by Helm's own engine (helm-python-sdk, Helm v4's Go SDK): it
creates the same objects as the kustomize trees, follows the release's name and namespace, and each value changes
what it should and nothing else."""

from __future__ import annotations

import json
import re
import tomllib
from typing import Any

import helm_python
import kubernetes_validate
import pytest
import yaml

from tests.deploy.helm import (
    CHART,
    EVERYTHING_ON,
    FULL,
    NAMESPACE,
    comparable,
    differences,
    key,
    normalise,
    render,
    render_files,
    without_extra_labels,
)
from tests.deploy.kustomize import CLUSTER_SCOPED, KUBECTL, TREES, build_with_kubectl, build_without_kubectl
from tests.deploy.manifests import CRD_GROUPS, DASHBOARD, DEPLOY, ROOT, configmap_config_text
from tests.fakes.cli import run_agent

# kustomize tree -> the chart values that give the same objects
TREE_VALUES: dict[str, dict[str, Any]] = {
    "deploy": {},
    "dropin": {"dropIn": {"enabled": True}},
    "monitoring": {"metrics": {"serviceMonitor": {"enabled": True}}, "prometheusRule": {"enabled": True}},
    "dra": {"dra": {"enabled": True}},
    "gfd-read": {"nodeLabels": {"gfdReadNamespaces": ["gpu-operator"]}},
    "nvsentinel": {"nvsentinel": {"enabled": True}},
}


def assert_same_objects(chart_docs: list[dict[str, Any]], kustomize_docs: list[dict[str, Any]]) -> None:
    ours, theirs = comparable(chart_docs), comparable(kustomize_docs)
    assert sorted(ours) == sorted(theirs)
    for name, expected in theirs.items():
        got = without_extra_labels(ours[name], expected)
        assert got == expected, sorted(differences([got], [expected]))


def test_chart_version_app_version_and_image_tag_are_the_projects_version():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]
    metadata = yaml.safe_load((CHART / "Chart.yaml").read_text(encoding="utf-8"))
    assert metadata["apiVersion"] == "v2"
    assert metadata["version"] == metadata["appVersion"] == project
    (daemonset,) = [d for d in render() if d["kind"] == "DaemonSet"]
    assert daemonset["spec"]["template"]["spec"]["containers"][0]["image"].endswith(f":{project}")


def test_files_are_copies_of_the_kustomize_ones():
    """Helm's .Files sees only the chart directory: the chart carries copies, byte for byte."""
    files = CHART / "files"
    assert (files / "config.yaml").read_text(encoding="utf-8") == configmap_config_text()
    assert (files / "gpu-node-agent.json").read_bytes() == DASHBOARD.read_bytes()
    assert (files / "prometheusrule.yaml").read_bytes() == (DEPLOY / "monitoring" / "prometheusrule.yaml").read_bytes()
    assert (files / "sriovdp-config.json").read_bytes() == (ROOT / "overlays/dropin/sriovdp-config.json").read_bytes()


@pytest.mark.parametrize("values", [{}, EVERYTHING_ON, FULL], ids=["defaults", "parts-on", "every-value"])
def test_lint_reports_no_error(values: dict[str, Any]):
    result = helm_python.lint(str(CHART), values, namespace=NAMESPACE, kube_version="v1.34.0", strict=True)
    assert [m for m in result["messages"] if m["severity"] >= 2] == [], result
    assert result["errors"] == []


def test_every_value_renders_objects_the_api_server_accepts():
    """Strict OpenAPI validation (unknown fields refused) of a render with every value set; the Prometheus
    Operator's kinds are CRDs the validator does not know."""
    docs = render(FULL)
    checked = [doc for doc in docs if not doc["apiVersion"].startswith(CRD_GROUPS)]
    for doc in checked:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
    assert len(checked) == len(docs) - 2 >= 16


def test_the_packaged_chart_renders_the_same(tmp_path):
    """`helm package` (what a chart repository serves) keeps every file the templates read."""
    archive = helm_python.package(str(CHART), destination=str(tmp_path))
    with helm_python.Chart.load(archive) as packaged:
        for values in ({}, FULL):
            assert packaged.render(values, name="gpu-node-agent", namespace=NAMESPACE, is_install=True) == \
                render_files(values)


@pytest.mark.parametrize("tree", TREES)
def test_render_equals_kustomize(tree: str):
    assert_same_objects(render(TREE_VALUES[tree]), build_without_kubectl(tree))


@pytest.mark.skipif(KUBECTL is None, reason="compares this renderer with kubectl's kustomize")
@pytest.mark.parametrize("tree", TREES)
def test_the_kustomize_renderer_equals_kubectl(tree: str):
    def squeeze(value: Any) -> Any:
        # kubectl's YAML writer re-folds `>` block scalars (blank lines around more-indented lines): the text's
        # whitespace is the file's own on both sides, so only its words are compared.
        if isinstance(value, dict):
            return {k: squeeze(v) for k, v in value.items()}
        if isinstance(value, list):
            return [squeeze(v) for v in value]
        return " ".join(value.split()) if isinstance(value, str) else value

    ours = {key(d): squeeze(normalise(d)) for d in build_without_kubectl(tree)}
    theirs = {key(d): squeeze(normalise(d)) for d in build_with_kubectl(tree)}
    assert ours == theirs


@pytest.mark.parametrize("part,kind", [("serviceMonitor", "ServiceMonitor"), ("prometheusRule", "PrometheusRule")])
def test_each_monitoring_value_adds_only_its_object(part: str, kind: str):
    values = {"metrics": {"serviceMonitor": {"enabled": True}}} if part == "serviceMonitor" else \
        {"prometheusRule": {"enabled": True}}
    assert differences(render(), render(values)) == {f"{kind}/gpu-node-agent"}


def _namespace_references(docs: list[dict[str, Any]]) -> list[str]:
    """Every namespace an object names: its own, RBAC subjects, ServiceMonitor matchNames, the DRA policy's user."""
    found = []
    for doc in docs:
        if doc["kind"] not in CLUSTER_SCOPED:
            found.append(doc["metadata"].get("namespace", "<none>"))
        found += [s["namespace"] for s in doc.get("subjects", [])]
        found += doc.get("spec", {}).get("namespaceSelector", {}).get("matchNames", [])
        for condition in doc.get("spec", {}).get("matchConditions", []):
            found.append(condition["expression"].split("system:serviceaccount:")[1].split(":")[0])
    return found


# Namespaces and names no file text contains (the alerts' runbooks name deploy/'s namespace in prose).
@pytest.mark.parametrize("values,namespace,release,want_namespace,want_prefix", [
    ({}, "ns-under-test", "rel", "ns-under-test", "rel-gpu-node-agent"),
    ({"namespaceOverride": "ns-override-under-test"}, "ns-under-test", "gpu-node-agent", "ns-override-under-test",
     "gpu-node-agent"),
    ({"fullnameOverride": "fullname-under-test"}, "ns-under-test", "rel", "ns-under-test", "fullname-under-test"),
])
def test_namespace_and_names_follow_the_release(values: dict[str, Any], namespace: str, release: str,
                                               want_namespace: str, want_prefix: str):
    docs = render({**EVERYTHING_ON, **values}, name=release, namespace=namespace)
    references = _namespace_references(docs)
    assert len(references) > 10 and set(references) == {want_namespace}
    for doc in docs:
        if not doc["metadata"]["name"].endswith(".gpunodeagent.io"):  # DeviceClasses: names workloads use
            assert doc["metadata"]["name"].startswith(want_prefix), key(doc)
    # Renamed back, they are the default release's objects (which equal kustomize's, above): every name and
    # namespace came from the two helpers.
    text = yaml.safe_dump_all(docs)
    for old, new in ((want_prefix, "gpu-node-agent"), (want_namespace, NAMESPACE)):
        text = re.sub(rf"(?<![A-Za-z0-9]){re.escape(old)}(?![A-Za-z0-9])", new, text)
    renamed = {key(d): normalise(d) for d in yaml.safe_load_all(text) if d}
    assert renamed == {key(d): normalise(d) for d in render(EVERYTHING_ON)}


@pytest.mark.parametrize("values,message", [
    ({"image": 5}, "at '/image': got number, want object"),
    ({"iamge": {"tag": "1"}}, "additional properties 'iamge' not allowed"),
    ({"extraArgs": ["--log-level", 3]}, "at '/extraArgs/1': got number, want string"),
    ({"tolerations": {"key": "x"}}, "at '/tolerations': got object, want array"),
    ({"dra": {"enabled": "yes"}}, "at '/dra/enabled': got string, want boolean"),
    ({"nodeLabels": {"gfdReadNamespaces": "gpu-operator"}},
     "at '/nodeLabels/gfdReadNamespaces': got string, want array"),
    ({"nodeLabels": {"gfdReadNamespaces": ["GPU_Operator"]}}, "at '/nodeLabels/gfdReadNamespaces/0': "),
    ({"nodeLabels": {"gfdReadNamespaces": ["gpu-operator", "gpu-operator"]}}, "at '/nodeLabels/gfdReadNamespaces': "),
])
def test_the_schema_refuses(values: dict[str, Any], message: str):
    with pytest.raises(helm_python.HelmValuesError, match=message.replace("[", r"\[")):
        render(values)


def test_install_into_default_is_refused_naming_the_value_that_allows_it():
    with pytest.raises(helm_python.HelmRenderError, match=r"allowDefaultNamespace=true"):
        render(namespace="default")
    with pytest.raises(helm_python.HelmRenderError, match=r"allowDefaultNamespace=true"):
        render({"namespaceOverride": "default"}, namespace="gpus")
    assert {d["metadata"].get("namespace") for d in render({"allowDefaultNamespace": True}, namespace="default")} \
        == {"default", None}
    assert render({"namespaceOverride": "gpus"}, namespace="default")


@pytest.mark.parametrize("values,message", [
    ({"existingConfigMap": "mine", "config": {"logLevel": "debug"}}, "existingConfigMap=mine and config"),
    ({"config": {"metricsAddress": ":9999"}}, "config.metricsAddress=:9999 does not use metrics.port=10437"),
    ({"metrics": {"service": {"enabled": False}, "serviceMonitor": {"enabled": True}}},
     "metrics.serviceMonitor.enabled=true needs metrics.service.enabled=true"),
    ({"podLabels": {"app.kubernetes.io/name": "other"}}, "podLabels.app.kubernetes.io/name: the DaemonSet's selector"),
    ({"securityContext": {"privileged": True}}, "securityContext.privileged=true needs securityContext.allowPrivil"),
    ({"config": {"nodeLabels": {"mode": False}}}, r'config.nodeLabels.mode=false: .* Quote it: mode: "off"'),
])
def test_bad_combinations_are_refused(values: dict[str, Any], message: str):
    with pytest.raises(helm_python.HelmRenderError, match=message):
        render(values)


DS = "DaemonSet/gpu-node-agent.spec.template"
AGENT = f"{DS}.spec.containers[agent]"
CHECKSUM = f"{DS}.metadata.annotations.checksum/config"
CONFIG = "ConfigMap/gpu-node-agent-config.data.config.yaml"


@pytest.mark.parametrize("values,changed", [
    ({"image": {"tag": "0.2.0-rc1"}}, {f"{AGENT}.image"}),
    ({"nodeSelector": {"node.kubernetes.io/pool": "h100"}}, {f"{DS}.spec.nodeSelector.node.kubernetes.io/pool"}),
    ({"tolerations": [{"operator": "Exists"}]},
     {f"{DS}.spec.tolerations[0].key", f"{DS}.spec.tolerations[1].key", f"{DS}.spec.tolerations[1].operator",
      f"{DS}.spec.tolerations[2].key", f"{DS}.spec.tolerations[2].operator"}),
    ({"resources": {"limits": {"memory": "512Mi"}}}, {f"{AGENT}.resources.limits.memory"}),
    ({"extraArgs": ["--log-level", "debug"]}, {f"{AGENT}.args[2]", f"{AGENT}.args[3]"}),
    ({"config": {"logLevel": "debug"}}, {CONFIG, CHECKSUM}),
    ({"existingConfigMap": "site-agent-config"},
     {"ConfigMap/gpu-node-agent-config", CHECKSUM, f"{DS}.spec.volumes[config].configMap.name"}),
    ({"nodeLabels": {"rbac": {"create": False}}},
     {"Role/gpu-node-agent-node-labels", "RoleBinding/gpu-node-agent-node-labels"}),
    ({"nodeLabels": {"gfdReadNamespaces": ["nvidia-gfd"]}},
     {"Role/gpu-node-agent-gfd-read", "RoleBinding/gpu-node-agent-gfd-read"}),
    ({"rbac": {"create": False}, "nodeLabels": {"gfdReadNamespaces": ["nvidia-gfd"]}},
     {"ClusterRole/gpu-node-agent", "ClusterRoleBinding/gpu-node-agent", "Role/gpu-node-agent-slots",
      "RoleBinding/gpu-node-agent-slots", "Role/gpu-node-agent-node-labels", "RoleBinding/gpu-node-agent-node-labels"}),
], ids=["image.tag", "nodeSelector", "tolerations", "resources", "extraArgs", "config", "existingConfigMap",
        "nodeLabels.rbac.create", "nodeLabels.gfdReadNamespaces", "rbac.create-covers-node-labels"])
def test_a_value_changes_what_it_should_and_nothing_else(values: dict[str, Any], changed: set[str]):
    after = render(values)
    assert differences(render(), after) == changed
    (daemonset,) = [d for d in after if d["kind"] == "DaemonSet"]
    pod = daemonset["spec"]["template"]["spec"]
    if "existingConfigMap" in values:
        assert {"name": "config", "configMap": {"name": "site-agent-config"}} in pod["volumes"]
    if "image" in values:
        assert pod["containers"][0]["image"] == "ghcr.io/gpu-node-agent/gpu-node-agent:0.2.0-rc1"


def _config_file(values: dict[str, Any]) -> str:
    docs = render(values)
    (configmap,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-config")]
    return configmap["data"]["config.yaml"]


def test_the_rendered_config_file_passes_the_agent(tmp_path):
    """`config` merges into the default file: maps by key, lists and scalars (false included) replace."""
    path = tmp_path / "config.yaml"
    path.write_text(_config_file({"config": {
        "logLevel": "debug", "devicePlugin": {"rdmaCdi": True, "pools": [{"resourceName": "ib", "selectors": {
            "isRdma": True}}]}, "remediation": {"enabled": True, "dryRun": True}, "health": {"kmsg": ""},
        "netacct": {"perPodMetrics": False}}}), encoding="utf-8")
    result = run_agent("config", "--config", str(path))
    assert result.returncode == 0, result.stderr
    effective = yaml.safe_load(result.stdout)
    assert effective["logLevel"] == "debug"
    assert effective["devicePlugin"]["rdmaCdi"] is True and effective["devicePlugin"]["serveGpus"] is False
    assert [p["resourceName"] for p in effective["devicePlugin"]["pools"]] == ["ib"]
    assert effective["remediation"]["enabled"] is True and effective["remediation"]["slots"] == 3
    assert effective["health"]["kmsg"] == "" and effective["netacct"]["perPodMetrics"] is False
    assert effective["metricsAddress"] == ":10437"
    # A value the agent refuses renders (Helm cannot know the agent's rules), and this check catches it.
    path.write_text(_config_file({"config": {"logLevel": "loud"}}), encoding="utf-8")
    refused = run_agent("config", "--config", str(path))
    assert refused.returncode == 2 and "logLevel" in refused.stderr


def test_privileged_for_kmsg_renders_with_escalation_allowed():
    (daemonset,) = [d for d in render({"securityContext": {"privileged": True, "allowPrivilegeEscalation": True}})
                    if d["kind"] == "DaemonSet"]
    kubernetes_validate.validate(daemonset, kubernetes_validate.latest_version(), strict=True)
    context = daemonset["spec"]["template"]["spec"]["containers"][0]["securityContext"]
    assert context["privileged"] is True and context["allowPrivilegeEscalation"] is True


def test_on_delete_drops_the_default_rolling_update():
    """Helm merges a given updateStrategy into the default; the API refuses rollingUpdate next to OnDelete."""
    (daemonset,) = [d for d in render({"updateStrategy": {"type": "OnDelete"}}) if d["kind"] == "DaemonSet"]
    assert daemonset["spec"]["updateStrategy"] == {"type": "OnDelete"}


def test_the_sriov_config_value_is_the_file_the_agent_reads(tmp_path):
    sriov = {"resourceList": [{"resourceName": "ib_rdma", "resourcePrefix": "example.com",
                               "selectors": {"vendors": ["15b3"], "isRdma": True}}]}
    (configmap,) = [d for d in render({"dropIn": {"enabled": True, "sriovDpConfig": sriov}})
                    if d["metadata"]["name"] == "gpu-node-agent-sriovdp-config"]
    path = tmp_path / "config.json"
    path.write_text(configmap["data"]["config.json"], encoding="utf-8")
    assert json.loads(path.read_text(encoding="utf-8")) == sriov
    result = run_agent("config", "--sriov-dp-config", str(path))
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["devicePlugin"]["sriovDpConfig"] == str(path)


def test_metrics_port_moves_every_use_of_it_together():
    docs = render({"metrics": {"port": 10500}})
    assert yaml.safe_load(_config_file({"metrics": {"port": 10500}}))["metricsAddress"] == ":10500"
    (daemonset,) = [d for d in docs if d["kind"] == "DaemonSet"]
    (port,) = daemonset["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert port["containerPort"] == port["hostPort"] == 10500
    (service,) = [d for d in docs if d["kind"] == "Service"]
    assert service["spec"]["ports"][0]["port"] == 10500


def test_the_api_token_follows_the_config():
    def automount(values: dict[str, Any]) -> bool:
        (daemonset,) = [d for d in render(values) if d["kind"] == "DaemonSet"]
        return daemonset["spec"]["template"]["spec"]["automountServiceAccountToken"]

    labels_off = {"nodeLabels": {"mode": "off"}}
    assert automount({}) is True  # the default config publishes node labels
    assert automount({"config": {"nodeLabels": {"mode": "node"}}}) is True
    assert automount({"config": labels_off}) is False
    assert automount({"config": {**labels_off, "remediation": {"enabled": True}}}) is True
    assert automount({"config": {**labels_off, "netacct": {"enabled": True}}}) is True
    assert automount({"config": {**labels_off, "netacct": {"enabled": True, "podsFile": "/run/pods.json"}}}) is False
    assert automount({"config": labels_off, "dra": {"enabled": True}}) is True
    assert automount({"config": labels_off, "serviceAccount": {"automount": True}}) is True
    assert automount({"serviceAccount": {"automount": False}}) is False


def test_gfd_read_grants_get_in_each_namespace_listed_to_the_releases_account():
    """deploy/gfd-read once per namespace: the Role lives in GFD's namespace, its subject is the agent's."""
    docs = render({"nodeLabels": {"gfdReadNamespaces": ["gpu-operator", "nvidia-gfd"]}}, name="rel",
                  namespace="ns-under-test")
    grants = [d for d in docs if d["metadata"]["name"] == "rel-gpu-node-agent-gfd-read"]
    assert sorted((d["kind"], d["metadata"]["namespace"]) for d in grants) == [
        ("Role", "gpu-operator"), ("Role", "nvidia-gfd"),
        ("RoleBinding", "gpu-operator"), ("RoleBinding", "nvidia-gfd")]
    for doc in grants:
        if doc["kind"] == "Role":
            assert doc["rules"] == [{"apiGroups": ["nfd.k8s-sigs.io"], "resources": ["nodefeatures"], "verbs": ["get"]}]
        else:
            assert doc["subjects"] == [{"kind": "ServiceAccount", "name": "rel-gpu-node-agent",
                                        "namespace": "ns-under-test"}]


def test_notes_say_how_to_label_the_namespace_and_check_the_agent():
    notes = render_files(namespace="gpus")["gpu-node-agent/templates/NOTES.txt"]
    assert "kubectl label namespace gpus pod-security.kubernetes.io/enforce=privileged" in notes
    assert "kubectl -n gpus exec ds/gpu-node-agent -c agent -- gpu-node-agent doctor" in notes
