"""What a user relies on in the DaemonSet and its ConfigMap: mounts for every path the agent uses, probes on the
endpoints the agent serves, the config parsing with the agent's own loader, identity from the downward API."""

from __future__ import annotations

import argparse
import dataclasses
import posixpath
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent import __version__, config
from agent.config import AgentConfig
from agent.config.address import parse_address
from agent.config.remediation import RemediationConfig
from tests.deploy.manifests import DEPLOY, agent_container, configmap_config_text, one

DAEMONSET = one("DaemonSet")
POD = DAEMONSET["spec"]["template"]["spec"]
CONTAINER = agent_container()
VOLUMES = {volume["name"]: volume for volume in POD["volumes"]}
MOUNTS = CONTAINER["volumeMounts"]


def _load_configmap_config(tmp_path: Path) -> AgentConfig:
    path = tmp_path / "config.yaml"
    path.write_text(configmap_config_text(), encoding="utf-8")
    return config.load(argparse.Namespace(config=str(path)), {})


def _paths(obj: Any, where: str = "") -> list[tuple[str, str]]:
    """(setting, value) of every absolute path in a config object."""
    found: list[tuple[str, str]] = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        name = f"{where}.{f.name}" if where else f.name
        if dataclasses.is_dataclass(value):
            found.extend(_paths(value, name))
        elif isinstance(value, str) and value.startswith("/"):
            found.append((name, value))
    return found


def _mount_for(path: str) -> dict[str, Any] | None:
    """The most specific mount that holds `path`."""
    holding = [m for m in MOUNTS
               if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]
    return max(holding, key=lambda m: len(m["mountPath"]), default=None)


def _host_path(mount: dict[str, Any]) -> dict[str, Any]:
    return VOLUMES[mount["name"]].get("hostPath", {})


def test_configmap_config_loads_with_the_agent_loader(tmp_path):
    cfg = _load_configmap_config(tmp_path)
    assert cfg.node_name == "", "the node name must come from the downward API, not the shared ConfigMap"
    assert cfg.device_plugin.serve_gpus is False


def test_container_args_are_valid_run_flags_and_point_at_the_mounted_config():
    parser = argparse.ArgumentParser()
    config.add_flags(parser)
    args = parser.parse_args(CONTAINER["args"])
    mount = _mount_for(args.config)
    assert mount is not None and mount["mountPath"] == posixpath.dirname(args.config)
    volume = VOLUMES[mount["name"]]
    assert volume["configMap"]["name"] == one("ConfigMap")["metadata"]["name"]
    assert posixpath.basename(args.config) in one("ConfigMap")["data"]


@pytest.mark.parametrize("source", ["defaults", "configmap"])
def test_every_host_path_the_agent_uses_is_mounted_from_the_host(source, tmp_path):
    cfg = AgentConfig() if source == "defaults" else _load_configmap_config(tmp_path)
    paths = _paths(cfg)  # dra.pluginDir (empty: /var/lib/kubelet/plugins/<driver>) is the deploy/dra component's
    assert {name for name, _ in paths} >= {"state_dir", "topology.sysfs_root", "device_plugin.device_plugin_dir",
                                           "health.kmsg", "pod_resources.socket"}
    for name, path in paths:
        mount = _mount_for(path)
        assert mount is not None, f"{name} = {path} is not mounted into the container"
        host = _host_path(mount)
        assert host, f"{name} = {path} is mounted from {VOLUMES[mount['name']]}, not from the host"
        assert host["path"] == mount["mountPath"], f"{name}: host {host['path']} appears at {mount['mountPath']}"


# path, host path type, read-only
EXPECTED_HOST_MOUNTS = [
    ("/var/lib/kubelet/device-plugins", "Directory", False),
    ("/var/lib/kubelet/pod-resources", "Directory", True),
    ("/var/lib/kubelet/plugins_registry", "Directory", False),
    ("/var/run/k8s.cni.cncf.io/devinfo/dp", "DirectoryOrCreate", False),
    ("/var/run/cdi", "DirectoryOrCreate", False),
    ("/sys", "Directory", True),
    ("/dev/kmsg", "CharDevice", True),
    ("/run/xtables.lock", "FileOrCreate", False),
    ("/var/lib/gpu-node-agent", "DirectoryOrCreate", False),
]


@pytest.mark.parametrize(("path", "kind", "read_only"), EXPECTED_HOST_MOUNTS)
def test_host_mount(path, kind, read_only):
    mount = next((m for m in MOUNTS if m["mountPath"] == path), None)
    assert mount is not None, f"{path} is not mounted"
    assert _host_path(mount) == {"path": path, "type": kind}
    assert bool(mount.get("readOnly", False)) is read_only


def test_pod_resources_directory_is_mounted_not_the_socket(tmp_path):
    # the kubelet recreates the socket on restart; a socket mount would keep pointing at the dead inode
    socket = _load_configmap_config(tmp_path).pod_resources.socket
    mount = _mount_for(socket)
    assert mount is not None and mount["mountPath"] == posixpath.dirname(socket)
    assert _host_path(mount)["type"] == "Directory" and mount["readOnly"] is True


def test_no_other_writable_host_paths():
    writable = {m["mountPath"] for m in MOUNTS if _host_path(m) and not m.get("readOnly")}
    assert writable == {p for p, _, ro in EXPECTED_HOST_MOUNTS if not ro}


def test_probes_use_the_agent_endpoints_on_the_named_metrics_port(tmp_path):
    ports = {p["name"]: p for p in CONTAINER["ports"]}
    _, port = parse_address(_load_configmap_config(tmp_path).metrics_address)
    assert ports["metrics"]["containerPort"] == port
    assert ports["metrics"]["hostPort"] == port, "hostNetwork: the container port is the node's port"
    expected = {"livenessProbe": "/healthz", "readinessProbe": "/readyz", "startupProbe": "/healthz"}
    for probe, path in expected.items():
        http = CONTAINER[probe]["httpGet"]
        assert http == {"path": path, "port": "metrics"}, probe
    assert one("Service")["spec"]["ports"][0]["port"] == port


def test_liveness_does_not_restart_before_the_agent_itself_would_call_the_loop_dead():
    from agent.http import Readiness

    probe = CONTAINER["livenessProbe"]
    tolerated = probe["periodSeconds"] * probe["failureThreshold"]
    assert tolerated >= Readiness().liveness_timeout


def _env() -> dict[str, dict[str, Any]]:
    return {item["name"]: item for item in CONTAINER["env"]}


def _env_name(section: Any, field: str) -> str:
    return next(f.metadata["env"] for f in dataclasses.fields(section) if f.name == field)


@pytest.mark.parametrize(("section", "field", "field_path"), [
    (AgentConfig, "node_name", "spec.nodeName"),
    (RemediationConfig, "pod_name", "metadata.name"),
    (RemediationConfig, "pod_namespace", "metadata.namespace"),
])
def test_identity_comes_from_the_downward_api_under_the_names_the_agent_reads(section, field, field_path):
    env = _env()
    name = _env_name(section, field)
    assert name in env, f"{name} (the env variable of {field}) is not set"
    assert env[name]["valueFrom"]["fieldRef"]["fieldPath"] == field_path


def test_downward_api_conventional_names_and_nvml_environment():
    env = _env()
    for name, field_path in (("NODE_NAME", "spec.nodeName"), ("POD_NAME", "metadata.name"),
                             ("POD_NAMESPACE", "metadata.namespace")):
        assert env[name]["valueFrom"]["fieldRef"]["fieldPath"] == field_path
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"]["value"] == "utility"


def test_security_context_is_root_without_escalation_and_only_the_needed_capabilities():
    context = CONTAINER["securityContext"]
    assert context["runAsUser"] == 0
    assert context["allowPrivilegeEscalation"] is False
    assert context["privileged"] is False
    assert context["readOnlyRootFilesystem"] is True
    assert context["capabilities"]["drop"] == ["ALL"]
    assert sorted(context["capabilities"]["add"]) == ["NET_ADMIN", "NET_RAW"]  # no DAC_READ_SEARCH, no SYSLOG
    tmp = _mount_for("/tmp/x")
    assert tmp is not None and "emptyDir" in VOLUMES[tmp["name"]], "a read-only root needs a writable /tmp"


def test_scheduling():
    assert POD["hostNetwork"] is True
    assert POD["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert POD["priorityClassName"] == "system-node-critical"
    assert POD["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert POD["serviceAccountName"] == one("ServiceAccount")["metadata"]["name"]
    strategy = DAEMONSET["spec"]["updateStrategy"]
    assert strategy == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "10%"}}
    assert DAEMONSET["spec"]["selector"]["matchLabels"].items() <= \
        DAEMONSET["spec"]["template"]["metadata"]["labels"].items()


def test_tolerates_gpu_taints_and_the_agents_own_taints():
    state = pytest.importorskip("agent.remediation.state", reason="remediation taint names live there")
    remediation = RemediationConfig()
    tolerated = {t["key"] for t in POD["tolerations"] if t.get("operator") == "Exists" and "effect" not in t}
    assert "nvidia.com/gpu" in tolerated
    assert remediation.preflight_taint in tolerated, "the agent must run on a node it has not yet cleared"
    assert state.Keys.for_prefix(remediation.prefix).taint in tolerated, "the agent must see the node recover"


def test_resources_cover_the_footprint_goal():
    resources = CONTAINER["resources"]
    assert set(resources) == {"requests", "limits"}
    assert resources["requests"]["memory"].endswith("Mi") and int(resources["requests"]["memory"][:-2]) >= 64
    assert int(resources["limits"]["memory"][:-2]) >= int(resources["requests"]["memory"][:-2])


def test_image_tag_is_the_package_version():
    image = CONTAINER["image"]
    assert image == f"ghcr.io/gpu-node-agent/gpu-node-agent:{__version__}"
    assert DAEMONSET["metadata"]["labels"]["app.kubernetes.io/version"] == __version__


def test_the_api_token_is_mounted_only_when_a_subsystem_calls_the_api():
    """Node labels, remediation, netacct's own-node pod watch and DRA call the API server; nothing else does."""
    config = yaml.safe_load(configmap_config_text())
    netacct = config.get("netacct") or {}
    needs_api = (config.get("nodeLabels") or {}).get("mode", "auto") != "off" or \
        bool((config.get("remediation") or {}).get("enabled")) or \
        (bool(netacct.get("enabled")) and not netacct.get("podsFile")) or bool((config.get("dra") or {}).get("enabled"))
    pod = one("DaemonSet")["spec"]["template"]["spec"]
    assert pod.get("automountServiceAccountToken") is needs_api
    assert one("ServiceAccount").get("automountServiceAccountToken") is False
    dra_patch = yaml.safe_load((DEPLOY / "dra" / "daemonset-dra.yaml").read_text(encoding="utf-8"))
    assert dra_patch["spec"]["template"]["spec"]["automountServiceAccountToken"] is True
