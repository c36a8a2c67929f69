"""Health events for NVSentinel as one switch in both deployment forms: the chart's `nvsentinel.*` values and the
kustomize Component deploy/nvsentinel mount the host's socket directory at the same path and tell the agent the
socket in it (GPU_NODE_AGENT_NVSENTINEL_SOCKET); the agent accepts that path; nonsense values are refused with a
message naming the value. test_helm_chart.py compares the enabled render with the Component (TREES "nvsentinel")."""

from __future__ import annotations

import posixpath
from typing import Any

import helm_python
import kubernetes_validate
import pytest
import yaml

from agent.host.nvsentinel import DEFAULT_SOCKET
from tests.deploy.helm import CHART, NAMESPACE, differences, render
from tests.deploy.kustomize import build_without_kubectl
from tests.fakes.cli import run_agent

ENV = "GPU_NODE_AGENT_NVSENTINEL_SOCKET"
DS = "DaemonSet/gpu-node-agent.spec.template.spec"
AGENT = f"{DS}.containers[agent]"


def _pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (daemonset,) = [d for d in docs if d["kind"] == "DaemonSet"]
    spec: dict[str, Any] = daemonset["spec"]["template"]["spec"]
    return spec


def _wiring(docs: list[dict[str, Any]]) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(socket the agent is told, its volumeMount, its volume) of the nvsentinel-socket volume."""
    pod = _pod(docs)
    (agent,) = pod["containers"]
    (socket,) = [e["value"] for e in agent["env"] if e["name"] == ENV]
    (mount,) = [m for m in agent["volumeMounts"] if m["name"] == "nvsentinel-socket"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "nvsentinel-socket"]
    return socket, mount, volume


def _assert_one_path(socket: str, mount: dict[str, Any], volume: dict[str, Any]) -> None:
    """The socket the agent dials lies in the mounted directory, which is the host's directory at the same path."""
    assert posixpath.dirname(socket) == mount["mountPath"] == volume["hostPath"]["path"]
    assert mount["readOnly"] is True
    # NVSentinel's connector creates the socket; the directory may not exist yet when the agent starts first.
    assert volume["hostPath"]["type"] == "DirectoryOrCreate"


@pytest.mark.parametrize("form", ["chart", "kustomize"])
def test_enabled_mounts_the_hosts_socket_directory_and_tells_the_agent(form: str) -> None:
    docs = render({"nvsentinel": {"enabled": True}}) if form == "chart" else build_without_kubectl("nvsentinel")
    socket, mount, volume = _wiring(docs)
    _assert_one_path(socket, mount, volume)
    assert socket == DEFAULT_SOCKET == "/var/run/nvsentinel/nvsentinel.sock"
    for doc in docs:
        if doc["kind"] == "DaemonSet":
            kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_the_switch_adds_the_env_the_mount_and_the_volume_and_nothing_else() -> None:
    assert differences(render(), render({"nvsentinel": {"enabled": True}})) == {
        f"{AGENT}.env[{ENV}].name", f"{AGENT}.env[{ENV}].value",
        f"{AGENT}.volumeMounts[nvsentinel-socket].name", f"{AGENT}.volumeMounts[nvsentinel-socket].mountPath",
        f"{AGENT}.volumeMounts[nvsentinel-socket].readOnly",
        f"{DS}.volumes[nvsentinel-socket].name", f"{DS}.volumes[nvsentinel-socket].hostPath.path",
        f"{DS}.volumes[nvsentinel-socket].hostPath.type"}
    # Off (the default), directory and name change nothing.
    assert differences(render(), render({"nvsentinel": {"hostSocketDir": "/run/x", "socketName": "y.sock"}})) == set()


@pytest.mark.parametrize("directory,name,want", [
    ("/run/nvsentinel-site", "connector.sock", "/run/nvsentinel-site/connector.sock"),
    ("/var/run/nvsentinel/", "nvsentinel.sock", "/var/run/nvsentinel/nvsentinel.sock"),  # trailing slash
    ("/var//run/./nvsentinel", "nvsentinel.sock", "/var/run/nvsentinel/nvsentinel.sock"),
])
def test_directory_and_name_move_the_mount_and_the_socket_together(directory: str, name: str, want: str) -> None:
    socket, mount, volume = _wiring(render({"nvsentinel": {"enabled": True, "hostSocketDir": directory,
                                                           "socketName": name}}))
    assert socket == want
    _assert_one_path(socket, mount, volume)


def test_the_agent_accepts_the_socket_it_is_told() -> None:
    socket, _, _ = _wiring(render({"nvsentinel": {"enabled": True}}))
    result = run_agent("config", "--nvsentinel-socket", socket)
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["health"]["nvsentinelSocket"] == socket


def test_lint_is_clean_with_the_switch_on() -> None:
    result = helm_python.lint(str(CHART), {"nvsentinel": {"enabled": True}}, namespace=NAMESPACE,
                              kube_version="v1.34.0", strict=True)
    assert [m for m in result["messages"] if m["severity"] >= 2] == [], result
    assert result["errors"] == []


@pytest.mark.parametrize("values,message", [
    ({"enabled": "yes"}, "at '/nvsentinel/enabled': got string, want boolean"),
    ({"enabled": True, "hostSocketDir": 5}, "at '/nvsentinel/hostSocketDir': got number, want string"),
    ({"enabled": True, "socketName": ""}, "at '/nvsentinel/socketName': "),
    ({"enabled": True, "socketPath": "/var/run/nvsentinel.sock"}, "additional properties 'socketPath' not allowed"),
])
def test_the_schema_refuses(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm_python.HelmValuesError, match=message):
        render({"nvsentinel": values})


@pytest.mark.parametrize("values,message", [
    ({"hostSocketDir": "var/run/nvsentinel"},
     "nvsentinel.hostSocketDir=var/run/nvsentinel is not an absolute path"),
    ({"hostSocketDir": "/"}, r"nvsentinel.hostSocketDir=/ would mount the host's root"),
    ({"socketName": "nvsentinel/nvsentinel.sock"},
     "nvsentinel.socketName=nvsentinel/nvsentinel.sock is not a file name"),
    ({"socketName": ".."}, "nvsentinel.socketName=.. is not a file name"),
    ({"hostSocketDir": "/var/run/" + "n" * 100}, r"is longer than a unix socket path may be \(107 bytes\)"),
])
def test_nonsense_is_refused_naming_the_value(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm_python.HelmRenderError, match=message):
        render({"nvsentinel": {"enabled": True, **values}})
