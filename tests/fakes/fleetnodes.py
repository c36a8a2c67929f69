"""Realistic Nodes as the API server returns them (labels, managedFields, images, capacity, the kubelet's
conditions) in every state the agent leaves them in, each with the truth the fleet view must report for it.

The truth is the scenario the node was built from, written down here by hand, not recomputed by the agent's
rules: a rule implemented wrongly in the agent disagrees with it.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from typing import Any

P = "gpunodeagent.io"
NOW = float(int(time.time()))  # the CLI reads the real clock: windows have minutes of margin
DAY = 86_400.0


def stamp(epoch: float) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(epoch, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Truth:
    name: str
    verdict: str
    cordoned: bool
    latched: bool
    gpus_expected: int | None
    gpus_healthy: int | None
    repeat_offender: bool
    pool: str


#: scenario -> (verdict, cordon intact); the node is built to match
SCENARIOS: dict[str, tuple[str, bool]] = {
    "healthy": ("healthy", False),
    "isolate": ("isolate", False),
    "isolate-empty-annotation": ("healthy", False),   # an empty isolated-devices is no isolation
    "degraded": ("degraded", False),
    "admin-uncordoned": ("degraded", False),           # cordon-by left, spec.unschedulable gone
    "taint-removed": ("degraded", False),              # cordon-by left, the agent's taint gone
    "cordon": ("cordon", True),
    "deferred": ("cordon", False),                     # True, no slot: RemediationDeferred message
    "drain": ("drain", True),
    "drain-admin-uncordoned": ("degraded", False),     # drain annotation, cordon lifted
    "no-condition": ("unknown", False),
    "status-unknown": ("unknown", False),
    "healthy-other-cordon": ("healthy", False),        # an admin's cordon without the agent's
}
WEIGHTS = {"healthy": 60, "isolate": 4, "isolate-empty-annotation": 2, "degraded": 4, "admin-uncordoned": 2,
           "taint-removed": 2, "cordon": 6, "deferred": 2, "drain": 5, "drain-admin-uncordoned": 2,
           "no-condition": 4, "status-unknown": 2, "healthy-other-cordon": 5}


def _images(rng: random.Random) -> list[dict[str, Any]]:
    repos = ["nvcr.io/nvidia/pytorch", "nvcr.io/nvidia/tritonserver", "registry.k8s.io/kube-proxy",
             "nvcr.io/nvidia/k8s/dcgm-exporter", "ghcr.io/example/gpu-node-agent", "docker.io/library/busybox"]
    images = []
    for _ in range(rng.randint(12, 24)):
        repo = rng.choice(repos)
        digest = f"{rng.getrandbits(256):064x}"
        images.append({"names": [f"{repo}@sha256:{digest}", f"{repo}:{rng.randint(20, 25)}.{rng.randint(1, 12)}"],
                       "sizeBytes": rng.randint(10 << 20, 20 << 30)})
    return images


def _incidents(rng: random.Random, kind: str) -> tuple[str | None, bool]:
    """(annotation value, repeat offender at N=3)."""
    if kind == "none":
        return None, False
    if kind == "garbage":
        return rng.choice(['{"count": "many"}', "not json", "[1,2,3]", '{"count":3,"recent":"x","windowSeconds":1}',
                           ""]), False
    window = 604_800
    if kind == "repeat":
        recent = sorted(NOW - rng.uniform(0, window - 60) for _ in range(rng.randint(3, 6)))
    elif kind == "two":
        recent = sorted(NOW - rng.uniform(0, window - 60) for _ in range(2))
    else:  # "old": many, but outside the window, and one inside
        recent = sorted([NOW - window - rng.uniform(100, DAY) for _ in range(4)] + [NOW - 3600])
    value = {"count": len(recent) + rng.randint(0, 5), "last": stamp(recent[-1]), "lastCause": "GpuXid79",
             "recent": [stamp(t) for t in recent], "windowSeconds": window}
    return json.dumps(value), kind == "repeat"


def build(i: int, rng: random.Random) -> tuple[dict[str, Any], Truth]:
    """Node number `i` and its truth."""
    name = f"gpu-{i // 1000:02d}-{i:05d}"
    scenario = rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()))[0]
    verdict, intact = SCENARIOS[scenario]
    pool = "a" if i % 3 else "b"
    labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
              "node.kubernetes.io/instance-type": "p5.48xlarge", "topology.kubernetes.io/zone": f"zone-{i % 4}",
              "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "nvidia.com/gpu.count": "8",
              "nvidia.com/gpu.memory": "81559", "nvidia.com/cuda.driver.major": "550", "pool": pool,
              "feature.node.kubernetes.io/pci-10de.present": "true", "nvidia.com/mig.capable": "true"}
    expected_label = rng.choice(["8", "8", "8", "8", "16", "-1", "eight", "", None, "+8"])
    healthy_label = rng.choice(["8", "8", "7", "6", "0", "x", None])
    labels.update({k: v for k, v in ((f"{P}/gpu.expected", expected_label), (f"{P}/gpu.healthy", healthy_label))
                   if v is not None})
    annotations = {"node.alpha.kubernetes.io/ttl": "0",
                   "volumes.kubernetes.io/controller-managed-attach-detach": "true",
                   "csi.volume.kubernetes.io/nodeid": json.dumps({"ebs.csi.aws.com": f"i-{i:017x}"})}
    taints: list[dict[str, str]] = []
    unschedulable = False
    conditions = [{"type": t, "status": s, "reason": r, "message": m, "lastHeartbeatTime": stamp(NOW - 30),
                   "lastTransitionTime": stamp(NOW - 40 * DAY)}
                  for t, s, r, m in (("MemoryPressure", "False", "KubeletHasSufficientMemory", "ok"),
                                     ("DiskPressure", "False", "KubeletHasNoDiskPressure", "ok"),
                                     ("PIDPressure", "False", "KubeletHasSufficientPID", "ok"),
                                     ("Ready", "True", "KubeletReady", "kubelet is posting ready status"))]
    cond: tuple[str, str, str] | None = None
    if scenario in ("healthy", "healthy-other-cordon"):
        cond = ("False", "GpuHealthy", "all GPU and NIC checks pass")
    elif scenario == "isolate":
        cond = ("False", "GpuXid48", "device isolated, node schedulable: double-bit ECC (devices: GPU-3)")
        annotations[f"{P}/isolated-devices"] = f"GPU-{i}-3"
    elif scenario == "isolate-empty-annotation":
        cond = ("False", "GpuHealthy", "all GPU and NIC checks pass")
        annotations[f"{P}/isolated-devices"] = ""
    elif scenario == "status-unknown":
        cond = ("Unknown", "AgentGone", "")
    elif scenario != "no-condition":
        cond = ("True", "GpuXid79", "GPU fell off the bus (devices: GPU-1)")
        if scenario == "deferred":
            cond = ("True", "GpuXid79", "RemediationDeferred (no free slot): GPU fell off the bus (devices: GPU-1)")
    if scenario in ("cordon", "drain", "admin-uncordoned", "taint-removed", "drain-admin-uncordoned"):
        annotations.update({f"{P}/cordon-by": "gpu-node-agent", f"{P}/cordon-reason": "GpuXid79",
                            f"{P}/cordon-timestamp": stamp(NOW - 3600), f"{P}/cordon-hardware": "true",
                            f"{P}/cordon-unschedulable": "true"})
        unschedulable = scenario not in ("admin-uncordoned", "drain-admin-uncordoned")
        if scenario != "taint-removed":
            taints.append({"key": f"{P}/gpu-unhealthy", "value": "GpuXid79", "effect": "NoSchedule"})
    if scenario in ("drain", "drain-admin-uncordoned"):
        annotations[f"{P}/drain"] = rng.choice(["running", "complete", "deadline"])
        annotations[f"{P}/drain-started"] = stamp(NOW - 1800)
    if scenario == "healthy-other-cordon":
        unschedulable = True
        taints.append({"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"})
    latched = cond is not None and cond[0] == "True" and rng.random() < 0.2
    if latched:
        annotations[f"{P}/needs-human-attention"] = "3 remediations within 604800s"
    if cond is not None:
        conditions.append({"type": "GpuUnhealthy", "status": cond[0], "reason": cond[1], "message": cond[2],
                           "lastHeartbeatTime": stamp(NOW - 60), "lastTransitionTime": stamp(NOW - 7200)})
    rng.shuffle(conditions)
    kind = rng.choices(["none", "repeat", "two", "old", "garbage"], weights=[70, 8, 10, 6, 6])[0]
    value, repeat = _incidents(rng, kind)
    if value is not None:
        annotations[f"{P}/incidents"] = value
    node = {
        "kind": "Node", "apiVersion": "v1",
        "metadata": {"name": name, "uid": f"{i:08x}-0000-4000-8000-000000000000",
                     "creationTimestamp": stamp(NOW - 90 * DAY), "labels": labels, "annotations": annotations,
                     "managedFields": [{"manager": m, "operation": "Update", "apiVersion": "v1",
                                        "time": stamp(NOW - 60), "fieldsType": "FieldsV1",
                                        "fieldsV1": {"f:metadata": {"f:labels": {f"f:{k}": {} for k in labels}}}}
                                       for m in ("kubelet", "gpu-node-agent", "kube-controller-manager")]},
        "spec": {"podCIDR": f"10.{i >> 8 & 255}.{i & 255}.0/24", "providerID": f"aws:///zone/i-{i:017x}",
                 **({"unschedulable": True} if unschedulable else {}), **({"taints": taints} if taints else {})},
        "status": {
            "capacity": {"cpu": "192", "memory": "2097152000Ki", "nvidia.com/gpu": "8", "pods": "250",
                         "ephemeral-storage": "3750000000Ki", "gpunodeagent.io/sriov_rdma": "32"},
            "allocatable": {"cpu": "191450m", "memory": "2090000000Ki", "nvidia.com/gpu": "8", "pods": "250",
                            "ephemeral-storage": "3450000000Ki", "gpunodeagent.io/sriov_rdma": "32"},
            "conditions": conditions,
            "addresses": [{"type": "InternalIP", "address": f"10.1.{i >> 8 & 255}.{i & 255}"},
                          {"type": "Hostname", "address": name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": {"machineID": f"{rng.getrandbits(128):032x}", "systemUUID": f"{rng.getrandbits(128):032x}",
                         "bootID": f"{rng.getrandbits(128):032x}", "kernelVersion": "6.8.0-1021-aws",
                         "osImage": "Ubuntu 22.04.5 LTS", "containerRuntimeVersion": "containerd://1.7.27",
                         "kubeletVersion": "v1.33.2", "kubeProxyVersion": "v1.33.2", "operatingSystem": "linux",
                         "architecture": "amd64"},
            "images": _images(rng)}}

    def count(value: str | None) -> int | None:
        return int(value) if value is not None and value.isdigit() else None

    truth = Truth(name, verdict, intact, latched, count(expected_label), count(healthy_label), repeat, pool)
    return node, truth


def fleet(n: int, seed: int = 42) -> tuple[list[dict[str, Any]], list[Truth]]:
    """`n` nodes and their truths."""
    rng = random.Random(seed)  # noqa: S311 - reproducible test data, not secrets
    built = [build(i, rng) for i in range(n)]
    return [b[0] for b in built], [b[1] for b in built]
