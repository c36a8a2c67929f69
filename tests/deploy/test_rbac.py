"""RBAC is exactly the least privilege agent/kube/port.py needs: no wildcards, no secrets, no extra verbs."""

from __future__ import annotations

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
    role = one("Role")
    assert role["metadata"]["namespace"] == NAMESPACE
    assert _flatten(role["rules"]) == NAMESPACED_RULES


def test_no_wildcards_and_no_secrets_anywhere():
    for _, doc in all_documents():
        for rule in doc.get("rules", []):
            for key in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[key], f"{doc['kind']} {doc['metadata']['name']}: '*' in {key}"
            assert not {"secrets", "configmaps", "serviceaccounts/token"} & set(rule["resources"])
            assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"])


def test_bindings_give_the_roles_to_the_agent_service_account_only():
    account = one("ServiceAccount")["metadata"]
    for kind, role_kind in (("ClusterRoleBinding", "ClusterRole"), ("RoleBinding", "Role")):
        binding = one(kind)
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": role_kind,
                                      "name": one(role_kind)["metadata"]["name"]}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["name"],
                                        "namespace": account["namespace"]}]
    assert one("RoleBinding")["metadata"]["namespace"] == one("Role")["metadata"]["namespace"]


def test_node_list_watch_limitation_is_documented():
    """RBAC cannot limit list/watch to the own node; the manifest must say that the agent uses a fieldSelector."""
    text = (DEPLOY / "rbac.yaml").read_text(encoding="utf-8")
    assert "fieldSelector metadata.name" in text
