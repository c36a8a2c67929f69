"""Every overlay under overlays/ that patches the base (kubectl apply -k) renders to objects the API server
accepts, validated strictly against the oldest supported and the newest Kubernetes schema. The drop-in overlay,
which also generates a ConfigMap, has its own test (test_dropin_overlay)."""

from __future__ import annotations

import kubernetes_validate
import pytest

from tests.deploy.manifests import CRD_GROUPS, render_overlay


@pytest.mark.parametrize("overlay", ("reboot-kured", "gpu-reset", "monitoring", "netacct-ebpf"))
@pytest.mark.parametrize("version", ("1.30", kubernetes_validate.latest_version()))
def test_every_object_validates_strictly(overlay: str, version: str) -> None:
    for doc in render_overlay(overlay):
        if not doc["apiVersion"].startswith(CRD_GROUPS):
            kubernetes_validate.validate(doc, version, strict=True)


def test_the_ebpf_overlay_adds_cap_bpf_and_the_hosts_bpffs_and_keeps_the_rest() -> None:
    base = next(d for d in render_overlay("gpu-reset") if d["kind"] == "DaemonSet")["spec"]["template"]["spec"]
    spec = next(d for d in render_overlay("netacct-ebpf") if d["kind"] == "DaemonSet")["spec"]["template"]["spec"]
    agent = spec["containers"][0]
    assert agent["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["NET_ADMIN", "NET_RAW", "BPF"]}
    assert agent["securityContext"]["privileged"] is False
    assert {"name": "bpffs", "mountPath": "/sys/fs/bpf"} in agent["volumeMounts"]
    assert {"name": "bpffs", "hostPath": {"path": "/sys/fs/bpf", "type": "Directory"}} in spec["volumes"]
    assert len(spec["volumes"]) == len(base["volumes"]) + 1
