"""The Helm chart rendered with Helm's own engine (helm-python-sdk), and objects normalised for comparison with
kustomize's (../shared/reference/helm-chart.md, section 5). No pytest here."""

from __future__ import annotations

import copy
import json
from typing import Any

import helm_python
import yaml

from tests.deploy.kustomize import CLUSTER_SCOPED
from tests.deploy.manifests import DEPLOY

CHART = DEPLOY / "helm" / "gpu-node-agent"
RELEASE = NAMESPACE = "gpu-node-agent"
# Labels Helm (or kustomize) adds for its own bookkeeping; they never enter a comparison.
BOOKKEEPING_LABELS = frozenset({"helm.sh/chart", "app.kubernetes.io/managed-by", "app.kubernetes.io/instance",
                                "app.kubernetes.io/version"})
_NAME_KEYED = frozenset({"containers", "initContainers", "env", "volumes", "volumeMounts", "ports",
                         "imagePullSecrets"})
EVERYTHING_ON: dict[str, Any] = {"metrics": {"serviceMonitor": {"enabled": True}},
                                 "prometheusRule": {"enabled": True}, "dropIn": {"enabled": True},
                                 "dra": {"enabled": True}, "nvsentinel": {"enabled": True}}
# Every optional part on and every value of item 2 given: for lint and strict validation.
FULL: dict[str, Any] = {
    **EVERYTHING_ON,
    "image": {"repository": "registry.example/gpu-node-agent", "tag": "0.1.0-site", "pullPolicy": "Always"},
    "imagePullSecrets": [{"name": "registry"}], "nameOverride": "gna", "fullnameOverride": "gna-site",
    "namespaceOverride": "gpu-agents", "config": {"remediation": {"enabled": True, "dryRun": True}},
    "extraArgs": ["--log-level", "debug"], "env": [{"name": "GPU_NODE_AGENT_LOG_FORMAT", "value": "text"}],
    "resources": {"requests": {"cpu": "50m"}}, "nodeSelector": {"node.kubernetes.io/pool": "h100"},
    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}]}]}}},
    "tolerations": [{"operator": "Exists"}], "priorityClassName": "gpu-critical",
    "updateStrategy": {"type": "OnDelete"}, "podAnnotations": {"example.com/team": "ml-infra"},
    "podLabels": {"example.com/team": "ml-infra"},
    "serviceAccount": {"create": True, "name": "agent", "annotations": {"example.com/owner": "infra"},
                       "automount": True},
    "rbac": {"create": True}, "nodeLabels": {"rbac": {"create": True}, "gfdReadNamespaces": ["gpu-operator"]},
    "metrics": {"port": 10500, "service": {"enabled": True},
                                          "serviceMonitor": {"enabled": True}},
    "dropIn": {"enabled": True, "sriovDpConfig": {"resourceList": [{"resourceName": "ib", "selectors": {
        "isRdma": True}}]}},
    "nvsentinel": {"enabled": True, "hostSocketDir": "/run/nvsentinel-site", "socketName": "connector.sock"},
}

Doc = dict[str, Any]
_chart: helm_python.Chart | None = None


def chart() -> helm_python.Chart:
    """The chart, loaded once per test session (loading is the slow part)."""
    global _chart  # noqa: PLW0603 - a per-process cache of the loaded chart
    if _chart is None:
        _chart = helm_python.Chart.load(str(CHART))
    return _chart


def render_files(values: dict[str, Any] | None = None, *, name: str = RELEASE,
                 namespace: str = NAMESPACE) -> dict[str, str]:
    """{template path: rendered text}, NOTES.txt included, as `helm install` would render them."""
    return chart().render(values or {}, name=name, namespace=namespace, is_install=True)


def render(values: dict[str, Any] | None = None, *, name: str = RELEASE, namespace: str = NAMESPACE) -> list[Doc]:
    """The objects a `helm install` with these values would create."""
    docs: list[Doc] = []
    for path, text in render_files(values, name=name, namespace=namespace).items():
        if not path.endswith("NOTES.txt"):
            docs += [doc for doc in yaml.safe_load_all(text) if doc]
    return docs


def key(doc: Doc) -> tuple[str, str]:
    return doc["kind"], doc["metadata"]["name"]


def _as_data(text: str) -> Any:
    """ConfigMap data that is a JSON/YAML map or list, as data (toYaml sorts keys and drops comments)."""
    for parse in (json.loads, yaml.safe_load):
        try:
            value = parse(text)
        except (ValueError, yaml.YAMLError):
            continue
        if isinstance(value, dict | list):
            return value
    return text


def _strip_labels(labels: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in labels.items() if k not in BOOKKEEPING_LABELS}


def _clean(value: Any, field: str = "") -> Any:
    """Empty values dropped, name-keyed lists sorted by name, tolerations by content; other lists keep order."""
    if isinstance(value, dict):
        out = {k: _clean(v, k) for k, v in value.items()}
        return {k: v for k, v in out.items() if v not in (None, {}, [])}
    if isinstance(value, list):
        items = [_clean(v) for v in value]
        if field in _NAME_KEYED:
            return sorted(items, key=lambda item: str(item.get("name")))
        if field == "tolerations":
            return sorted(items, key=lambda item: json.dumps(item, sort_keys=True))
        return items
    return value


def normalise(doc: Doc) -> Doc:
    """One object as the comparison sees it: no bookkeeping labels or annotations, data parsed, lists sorted."""
    doc = copy.deepcopy(doc)
    meta = doc["metadata"]
    if doc["kind"] in CLUSTER_SCOPED:
        meta.pop("namespace", None)
    for holder in (meta, doc.get("spec", {}).get("template", {}).get("metadata", {})):
        if "labels" in holder:
            holder["labels"] = _strip_labels(holder["labels"])
        if "annotations" in holder:
            holder["annotations"] = {k: v for k, v in holder["annotations"].items()
                                     if not k.startswith(("helm.sh/", "meta.helm.sh/", "checksum/"))}
    spec = doc.get("spec", {})
    if isinstance(spec.get("selector"), dict):
        selector = spec["selector"]
        if "matchLabels" in selector:
            selector["matchLabels"] = _strip_labels(selector["matchLabels"])
        elif doc["kind"] == "Service":
            spec["selector"] = _strip_labels(selector)
    if doc["kind"] == "ConfigMap":
        doc["data"] = {k: _as_data(v) for k, v in doc.get("data", {}).items()}
    return _clean(doc)


def labels_cover(chart_labels: dict[str, str], kustomize_labels: dict[str, str]) -> bool:
    """Every kustomize label is on the chart's object with its value (the chart may add its own)."""
    return all(chart_labels.get(k) == v for k, v in kustomize_labels.items())


def comparable(docs: list[Doc]) -> dict[tuple[str, str], Doc]:
    """Objects by (kind, name), normalised, the kustomize Namespace left out (--create-namespace makes it)."""
    return {key(doc): normalise(doc) for doc in docs if doc["kind"] != "Namespace"}


def without_extra_labels(chart_doc: Doc, kustomize_doc: Doc) -> Doc:
    """The chart's object with only the labels kustomize has (after checking it has all of them)."""
    out = copy.deepcopy(chart_doc)
    for path in (("metadata",), ("spec", "template", "metadata")):
        ours: Any = out
        theirs: Any = kustomize_doc
        for step in path:
            ours, theirs = ours.get(step, {}), theirs.get(step, {})
        wanted = theirs.get("labels", {})
        assert labels_cover(ours.get("labels", {}), wanted), (key(chart_doc), path, ours.get("labels"), wanted)
        if wanted:
            ours["labels"] = dict(wanted)
        else:
            ours.pop("labels", None)
    return out


def flatten(value: Any, path: str = "") -> dict[str, Any]:
    """{path: leaf}; list items of name-keyed lists addressed by name, so an insertion moves no other path."""
    if isinstance(value, dict):
        if not value:
            return {path: {}}
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(flatten(v, f"{path}.{k}"))
        return out
    if isinstance(value, list):
        if not value:
            return {path: []}
        out = {}
        for index, item in enumerate(value):
            label = item["name"] if isinstance(item, dict) and isinstance(item.get("name"), str) else index
            out.update(flatten(item, f"{path}[{label}]"))
        return out
    return {path: value}


def differences(before: list[Doc], after: list[Doc]) -> set[str]:
    """Paths `kind/name.field...` whose value differs between two renders (added and removed objects too)."""
    old = {f"{k}/{n}": doc for (k, n), doc in ((key(d), d) for d in before)}
    new = {f"{k}/{n}": doc for (k, n), doc in ((key(d), d) for d in after)}
    changed = {name for name in old.keys() ^ new.keys()}
    for name in old.keys() & new.keys():
        a, b = flatten(old[name], name), flatten(new[name], name)
        changed |= {path for path in a.keys() | b.keys() if a.get(path, KeyError) != b.get(path, KeyError)}
    return changed
