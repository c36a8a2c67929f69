"""The DRA component (deploy/dra): DeviceClasses, RBAC with the node-binding ValidatingAdmissionPolicy, the
DaemonSet patch, and the example claim templates, validated offline against the Kubernetes schemas.

kubernetes-validate knows `resource.k8s.io/v1` from 1.34 (the version DRA went GA) to its newest bundled
release, so every document is checked strictly on both ends. The allocator tests in tests/dra use the same
DeviceClasses and templates, so a selector or constraint typo fails there too.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from agent.config import load
from tests.deploy.manifests import DEPLOY, NAMESPACE, one

DRA = DEPLOY / "dra"
VERSIONS = ("1.34", kubernetes_validate.latest_version())
FILES = ("deviceclasses.yaml", "rbac.yaml", "examples/resourceclaimtemplates.yaml")
DOCUMENTS = [(name, doc) for name in FILES for doc in yaml.safe_load_all((DRA / name).read_text()) if doc]
KUBECTL = shutil.which("kubectl")


def _docs(kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in DOCUMENTS if doc["kind"] == kind]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("item", DOCUMENTS, ids=[f"{n}:{d['kind']}/{d['metadata']['name']}" for n, d in DOCUMENTS])
def test_valid_in_strict_mode(item: tuple[str, dict[str, Any]], version: str) -> None:
    kubernetes_validate.validate(item[1], version, strict=True)


def test_device_classes_select_our_driver_and_type() -> None:
    classes = {d["metadata"]["name"]: d["spec"]["selectors"][0]["cel"]["expression"] for d in _docs("DeviceClass")}
    assert set(classes) == {"gpu.gpunodeagent.io", "mig.gpunodeagent.io", "rdma.gpunodeagent.io"}
    for name, expression in classes.items():
        kind = name.split(".", 1)[0]
        assert expression == (f'device.driver == "gpunodeagent.io" && '
                              f'device.attributes["gpunodeagent.io"].type == "{kind}"')


def test_rbac_is_least_privilege() -> None:
    (role,) = _docs("ClusterRole")
    rules = {(g, r): sorted(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"]
             for r in rule["resources"]}
    assert rules == {("resource.k8s.io", "resourceslices"): ["create", "delete", "list", "update"],
                     ("resource.k8s.io", "resourceclaims"): ["get"]}
    (binding,) = _docs("ClusterRoleBinding")
    account = one("ServiceAccount")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                    "namespace": NAMESPACE}]


def test_admission_policy_binds_slice_writes_to_the_token_node() -> None:
    (policy,) = _docs("ValidatingAdmissionPolicy")
    (binding,) = _docs("ValidatingAdmissionPolicyBinding")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"] and binding["spec"]["validationActions"] == \
        ["Deny"]
    spec = policy["spec"]
    (rule,) = spec["matchConstraints"]["resourceRules"]
    assert rule["resources"] == ["resourceslices"] and set(rule["operations"]) == {"CREATE", "UPDATE", "DELETE"}
    account = one("ServiceAccount")["metadata"]["name"]
    assert spec["matchConditions"][0]["expression"] == \
        f'request.userInfo.username == "system:serviceaccount:{NAMESPACE}:{account}"'
    variables = {v["name"]: v["expression"] for v in spec["variables"]}
    assert 'request.userInfo.extra["authentication.kubernetes.io/node-name"][0]' in variables["nodeName"]
    assert 'request.operation == "DELETE" ? oldObject : object' in variables["objectNodeName"]
    assert [v["expression"] for v in spec["validations"]] == ['variables.nodeName != ""',
                                                             "variables.nodeName == variables.objectNodeName"]


def test_daemonset_patch_turns_dra_on_with_the_kubelet_paths() -> None:
    patch = yaml.safe_load((DRA / "daemonset-dra.yaml").read_text())
    (container,) = patch["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    cfg = load(None, env)
    assert cfg.dra.enabled
    volumes = {v["name"]: v["hostPath"]["path"] for v in patch["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts == volumes, "the kubelet dials the socket path the plugin names: same path inside and out"
    assert set(mounts.values()) == {cfg.dra.socket_dir}


@pytest.mark.skipif(KUBECTL is None, reason="needs kubectl (its built-in kustomize renders the overlay)")
def test_component_renders_on_the_base(tmp_path: Path) -> None:
    assert KUBECTL is not None
    shutil.copytree(DEPLOY, tmp_path / "deploy")
    (tmp_path / "kustomization.yaml").write_text("resources: [deploy]\ncomponents: [deploy/dra]\n")
    result = subprocess.run([KUBECTL, "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stderr
    rendered = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    for doc in rendered:
        if doc["kind"] in {"DeviceClass", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",
                           "DaemonSet", "ClusterRole", "ClusterRoleBinding"}:
            kubernetes_validate.validate(doc, VERSIONS[-1], strict=True)
    (daemonset,) = [doc for doc in rendered if doc["kind"] == "DaemonSet"]
    (agent,) = daemonset["spec"]["template"]["spec"]["containers"]
    assert {"name": "GPU_NODE_AGENT_DRA", "value": "true"} in agent["env"]
    assert len(agent["env"]) > 1, "the patch merges into the base's env, it does not replace it"
    paths = [m["mountPath"] for m in agent["volumeMounts"]]
    assert len(paths) == len(set(paths)), "a path mounted twice is refused by the API server"
    cfg = load(None, {})
    assert {cfg.dra.plugin_registry_dir, cfg.dra.socket_dir, cfg.dra.cdi_spec_dir} <= set(paths)
    volumes = {v["name"]: v for v in daemonset["spec"]["template"]["spec"]["volumes"]}
    for mount in agent["volumeMounts"]:
        host = volumes[mount["name"]].get("hostPath")
        if mount["mountPath"] in {cfg.dra.plugin_registry_dir, cfg.dra.socket_dir, cfg.dra.cdi_spec_dir}:
            assert host and host["path"] == mount["mountPath"]
