"""The kured overlay (overlays/reboot-kured) (validated strictly in test_overlays): mounts only the agent's own host
directory, and sets a sentinel path and condition the agent's config accepts (docs/remediation.md, "Reboot
requests")."""

from __future__ import annotations

import posixpath

from agent import config as agent_config
from tests.deploy.manifests import render_overlay


def test_the_agent_writes_only_into_its_own_host_directory() -> None:
    (daemonset,) = [d for d in render_overlay("reboot-kured") if d["kind"] == "DaemonSet"]
    spec = daemonset["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    cfg = agent_config.load(None, {k: v for k, v in env.items() if v is not None})
    sentinel = cfg.remediation.reboot_sentinel_path
    assert cfg.remediation.reboot_condition_type == "GpuNodeRebootRequired" and cfg.remediation.reboot_requests
    assert cfg.remediation.reboot_sentinel_dir == posixpath.dirname(sentinel)
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == posixpath.dirname(sentinel))
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    assert volume["hostPath"] == {"path": "/var/run/gpu-node-agent", "type": "DirectoryOrCreate"}
    assert not mount.get("readOnly")
