"""RBAC is exactly the least privilege agent/kube/port.py needs: no wildcards, no secrets, no extra verbs."""

from __future__ import annotations

import yaml

from tests.deploy.manifests import DEPLOY, NAMESPACE, all_documents, one

CLUSTER_RULES = {
    ("", "nodes"): ["get", "watch", "patch"],
    ("", "nodes/status"): ["patch"],
    ("", "pods"): ["list", "watch"],
    ("", "pods/eviction"): ["create"],
    ("", "events"): ["create", "patch"],
}
NAMESPACED_RULES = {
    ("coordination.k8s.io", "leases"): ["list", "create", "update"],
}
NODE_LABEL_RULES = {  # the agent's NodeFeature, in its own namespace only (issue 39)
    ("nfd.k8s-sigs.io", "nodefeatures"): ["get", "create", "update"],
}


def _flatten(rules: list[dict]) -> dict[tuple[str, str], list[str]]:
    out: dict[tuple[str, str], list[str]] = {}
    for rule in rules:
        assert set(rule) == {"apiGroups", "resources", "verbs"}, f"unexpected rule keys (resourceNames? {rule})"
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                key = (group, resource)
                assert key not in out, f"{key} granted twice"
                out[key] = list(rule["verbs"])
    return out


def test_cluster_role_is_exactly_the_listed_verbs():
    assert _flatten(one("ClusterRole")["rules"]) == CLUSTER_RULES


def test_lease_role_is_namespaced_to_the_agent():
    role = one("Role", "gpu-node-agent-slots")
    assert role["metadata"]["namespace"] == NAMESPACE
    assert _flatten(role["rules"]) == NAMESPACED_RULES


def test_node_feature_role_is_namespaced_to_the_agent_and_gfd_read_is_get_only():
    role = one("Role", "gpu-node-agent-node-labels")
    assert role["metadata"]["namespace"] == NAMESPACE
    assert _flatten(role["rules"]) == NODE_LABEL_RULES
    docs = list(yaml.safe_load_all((DEPLOY / "gfd-read" / "rbac.yaml").read_text(encoding="utf-8")))
    (gfd,) = [d for d in docs if d["kind"] == "Role"]
    assert gfd["metadata"]["namespace"] == "gpu-operator"
    assert _flatten(gfd["rules"]) == {("nfd.k8s-sigs.io", "nodefeatures"): ["get"]}
    (binding,) = [d for d in docs if d["kind"] == "RoleBinding"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "gpu-node-agent", "namespace": NAMESPACE}]


def test_no_wildcards_and_no_secrets_anywhere():
    for _, doc in all_documents():
        for rule in doc.get("rules", []):
            for key in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[key], f"{doc['kind']} {doc['metadata']['name']}: '*' in {key}"
            assert not {"secrets", "configmaps", "serviceaccounts/token"} & set(rule["resources"])
            assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"])


def test_bindings_give_the_roles_to_the_agent_service_account_only():
    account = one("ServiceAccount")["metadata"]
    bindings = [("ClusterRoleBinding", "ClusterRole", "gpu-node-agent")] + \
        [("RoleBinding", "Role", name) for name in ("gpu-node-agent-slots", "gpu-node-agent-node-labels")]
    for kind, role_kind, name in bindings:
        binding = one(kind, name)
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": role_kind,
                                      "name": one(role_kind, name)["metadata"]["name"]}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["name"],
                                        "namespace": account["namespace"]}]
        if kind == "RoleBinding":
            assert binding["metadata"]["namespace"] == one(role_kind, name)["metadata"]["namespace"]
    assert {doc["metadata"]["name"] for _, doc in all_documents() if doc["kind"] == "RoleBinding"} == \
        {"gpu-node-agent-slots", "gpu-node-agent-node-labels"}


def test_node_list_watch_limitation_is_documented():
    """RBAC cannot limit list/watch to the own node; the manifest must say that the agent uses a fieldSelector."""
    text = (DEPLOY / "rbac.yaml").read_text(encoding="utf-8")
    assert "fieldSelector metadata.name" in text
