"""The drop-in overlay (overlays/dropin): renders, validates strictly, and configures what docs/device-plugin.md
promises."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from agent import config as agent_config
from agent.config.model import AgentConfig
from agent.deviceplugin.sriovdp import read_config
from tests.deploy.manifests import CRD_GROUPS, ROOT, all_documents, apply_patch

OVERLAY = ROOT / "overlays" / "dropin"
KUBECTL = shutil.which("kubectl")
VERSIONS = ("1.30", kubernetes_validate.latest_version())


def render_without_kubectl() -> list[dict[str, Any]]:
    """The overlay rendered from its own files: base objects, the generated ConfigMap, the DaemonSet patch."""
    kustomization = yaml.safe_load((OVERLAY / "kustomization.yaml").read_text())
    base = ROOT / "deploy"
    namespace = yaml.safe_load((base / "kustomization.yaml").read_text())["namespace"]
    docs = [doc for name, doc in all_documents()]
    for generator in kustomization["configMapGenerator"]:
        data = {}
        for entry in generator["files"]:
            key, _, file = entry.partition("=")
            data[key] = (OVERLAY / file).read_text()
        docs.append({"apiVersion": "v1", "kind": "ConfigMap",
                     "metadata": {"name": generator["name"], "namespace": generator.get("namespace", namespace),
                                  "labels": generator["options"]["labels"]}, "data": data})
    for entry in kustomization["patches"]:
        patch = yaml.safe_load((OVERLAY / entry["path"]).read_text())
        docs = apply_patch(docs, patch)
    return docs


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    """kubectl's kustomize when present (CI has none), else the same merge done here; both checked alike."""
    if KUBECTL is None:
        return render_without_kubectl()
    result = subprocess.run([KUBECTL, "kustomize", str(OVERLAY)], capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.mark.skipif(KUBECTL is None, reason="compares with kubectl's kustomize")
def test_the_fallback_renders_the_daemonset_as_kustomize_does(rendered: list[dict[str, Any]]) -> None:
    (ours,) = [d for d in render_without_kubectl() if d["kind"] == "DaemonSet"]
    (theirs,) = [d for d in rendered if d["kind"] == "DaemonSet"]
    ours_spec, theirs_spec = ours["spec"]["template"]["spec"], theirs["spec"]["template"]["spec"]
    assert ours_spec["nodeSelector"] == theirs_spec["nodeSelector"]
    for part, key in (("env", "name"), ("volumeMounts", "mountPath")):  # kustomize puts new items first
        assert sorted(ours_spec["containers"][0][part], key=lambda i: i[key]) == \
            sorted(theirs_spec["containers"][0][part], key=lambda i: i[key])
    assert sorted(v["name"] for v in ours_spec["volumes"]) == sorted(v["name"] for v in theirs_spec["volumes"])


@pytest.mark.parametrize("version", VERSIONS)
def test_every_object_validates_strictly(rendered: list[dict[str, Any]], version: str) -> None:
    checked = 0
    for doc in rendered:
        if not doc["apiVersion"].startswith(CRD_GROUPS):
            kubernetes_validate.validate(doc, version, strict=True)
            checked += 1
    assert checked >= 8


def _daemonset(rendered: list[dict[str, Any]]) -> dict[str, Any]:
    (daemonset,) = [doc for doc in rendered if doc["kind"] == "DaemonSet"]
    return daemonset


def test_daemonset_mounts_the_sriov_config_and_sets_the_dropin_settings(rendered: list[dict[str, Any]],
                                                                        tmp_path: Path) -> None:
    spec = _daemonset(rendered)["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    mount = next(m for m in container["volumeMounts"] if m["name"] == "sriovdp-config")
    volume = next(v for v in spec["volumes"] if v["name"] == "sriovdp-config")
    (configmap,) = [d for d in rendered if d["kind"] == "ConfigMap" and d["metadata"]["name"]
                    == volume["configMap"]["name"]]
    assert configmap["metadata"]["namespace"] == _daemonset(rendered)["metadata"]["namespace"]
    assert env["GPU_NODE_AGENT_SRIOV_DP_CONFIG"] == f"{mount['mountPath']}/config.json"
    # the settings load as the agent would load them, and the SR-IOV file is one the agent accepts
    (tmp_path / "config.json").write_text(configmap["data"]["config.json"])
    cfg: AgentConfig = agent_config.load(None, {k: v for k, v in env.items() if v is not None})
    plugin = cfg.device_plugin
    assert (plugin.serve_gpus, plugin.gpu_resource_name, plugin.device_list_strategy, plugin.device_id_strategy,
            plugin.registration_mode) == (True, "nvidia.com/gpu", ["envvar"], "uuid", "auto")
    pools = read_config(str(tmp_path / "config.json")).pools
    assert [f"{p.resource_prefix}/{p.resource_name}" for p in pools] == ["mellanox.com/mlnx_rdma",
                                                                         "intel.com/intel_rdma"]
    mounted = {m["mountPath"] for m in container["volumeMounts"]}
    assert {cfg.dra.plugin_registry_dir, plugin.device_info_dir, plugin.device_plugin_dir} <= mounted
