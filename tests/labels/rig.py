"""A real `gpu-node-agent run --simulate` against the HTTP API double, for the node-label tests, and the labels a
simulated profile must carry (GFD v0.20.0's keys and values for those GPUs, and the agent's own)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from tests.app.agentproc import AgentProcess
from tests.fakes.apiserver import ApiServerDouble, write_kubeconfig
from tests.fakes.clock import FakeClock
from tests.fakes.polling import until

NODE = "gpu-node-1"
NAMESPACE = "gpu-node-agent"
POD = "gpu-node-agent-x7k2p"
FEATURE = f"gpu-node-agent-{NODE}"
DAEMONSET = {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "gpu-node-agent", "uid": "ds-uid-1",
             "controller": True, "blockOwnerDeletion": True}

# What GFD computes for 8 H100 SXM5 80GB on driver 550.54.15 (CUDA 12.4), MIG strategy none, no sharing
H100_GFD = {
    "nvidia.com/cuda.driver.major": "550", "nvidia.com/cuda.driver.minor": "54", "nvidia.com/cuda.driver.rev": "15",
    "nvidia.com/cuda.driver-version.major": "550", "nvidia.com/cuda.driver-version.minor": "54",
    "nvidia.com/cuda.driver-version.revision": "15", "nvidia.com/cuda.driver-version.full": "550.54.15",
    "nvidia.com/cuda.runtime.major": "12", "nvidia.com/cuda.runtime.minor": "4",
    "nvidia.com/cuda.runtime-version.major": "12", "nvidia.com/cuda.runtime-version.minor": "4",
    "nvidia.com/cuda.runtime-version.full": "12.4",
    "nvidia.com/gpu.machine": "unknown", "nvidia.com/mig.capable": "true", "nvidia.com/mps.capable": "false",
    "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "nvidia.com/gpu.count": "8", "nvidia.com/gpu.replicas": "1",
    "nvidia.com/gpu.sharing-strategy": "none", "nvidia.com/gpu.memory": "81559", "nvidia.com/gpu.family": "hopper",
    "nvidia.com/gpu.compute.major": "9", "nvidia.com/gpu.compute.minor": "0", "nvidia.com/gpu.mode": "compute",
    "nvidia.com/vgpu.present": "false",
}
H100_OWN = {
    "gpunodeagent.io/gpu-nic.pix": "8", "gpunodeagent.io/nic.rdma.count": "8", "gpunodeagent.io/nic.rate-gbps": "400",
    "gpunodeagent.io/nic.link-layer": "infiniband", "gpunodeagent.io/gpu.expected": "8",
    "gpunodeagent.io/gpu.healthy": "8", "gpunodeagent.io/topology.source": "sysfs",
}
# dgx-h100-mig (GPUs 0-3 with seven 1g.10gb each) under --mig-strategy mixed: whole-GPU keys as above (count 8:
# MIG-enabled GPUs count too), plus the profile's resource
MIG_1G_10GB = {
    "nvidia.com/mig.strategy": "mixed",
    "nvidia.com/mig-1g.10gb.product": "NVIDIA-H100-80GB-HBM3-MIG-1g.10gb", "nvidia.com/mig-1g.10gb.count": "28",
    "nvidia.com/mig-1g.10gb.replicas": "1", "nvidia.com/mig-1g.10gb.sharing-strategy": "none",
    "nvidia.com/mig-1g.10gb.memory": "9984", "nvidia.com/mig-1g.10gb.multiprocessors": "16",
    "nvidia.com/mig-1g.10gb.slices.gi": "1", "nvidia.com/mig-1g.10gb.slices.ci": "1",
    "nvidia.com/mig-1g.10gb.engines.copy": "1", "nvidia.com/mig-1g.10gb.engines.decoder": "1",
    "nvidia.com/mig-1g.10gb.engines.encoder": "0", "nvidia.com/mig-1g.10gb.engines.jpeg": "1",
    "nvidia.com/mig-1g.10gb.engines.ofa": "0",
}


async def start(directory: Path, *args: str, profile: str = "dgx-h100", nfd: bool = True,
                api: ApiServerDouble | None = None) -> tuple[AgentProcess, ApiServerDouble, Path]:
    """The agent (node labels every second) on a double serving NFD or not, with its own DaemonSet pod; returned
    once it runs, with the double and its kmsg file."""
    if api is None:
        api = ApiServerDouble(FakeClock(), NODE)
        api.nfd_served = nfd
        await api.start()
        api.add_pod(NAMESPACE, POD, owner="")
        api.update_pod(NAMESPACE, POD, {"metadata": {"ownerReferences": [DAEMONSET]}})
    kubeconfig = write_kubeconfig(directory / "kubeconfig", api.url)
    kmsg = directory / "kmsg"
    kmsg.touch()
    agent = AgentProcess(directory, "--kubeconfig", str(kubeconfig), "--node-name", NODE, "--pod-name", POD,
                         "--pod-namespace", NAMESPACE, "--kmsg", str(kmsg), "--node-labels-interval", "1", *args,
                         profile=profile)
    return agent, api, kmsg


def feature(api: ApiServerDouble) -> dict[str, Any] | None:
    """The agent's NodeFeature on the double."""
    return api.node_features.get((NAMESPACE, FEATURE))


def feature_labels(api: ApiServerDouble) -> dict[str, str]:
    """Its spec.labels (empty when there is none)."""
    return dict(((feature(api) or {}).get("spec") or {}).get("labels") or {})


async def published(api: ApiServerDouble, agent: AgentProcess, labels: Any, timeout: float = 60) -> None:
    """Wait until `labels(api)` is non-empty (the agent still running)."""
    await until(lambda: labels(api) or agent.process.poll() is not None, "the agent's labels", timeout=timeout)
    assert agent.process.poll() is None, agent.log_tail()


def nvml_overrides(agent: AgentProcess) -> Path:
    """Where the simulated node reads NVML faults (from the start line)."""
    for message in agent.messages():
        found = re.search(r"NVML faults: <GPU UUID>\.json in (\S+?)\)", message)
        if found:
            return Path(found.group(1))
    raise AssertionError(f"no NVML overrides directory in the log: {agent.log_tail()}")


def xid_line(bus_id: str, xid: int = 79) -> str:
    """A kernel-log record of the driver reporting an Xid on the GPU at `bus_id`."""
    domain, bus, rest = bus_id.split(":")
    return (f"3,7001,12345678,-;NVRM: Xid (PCI:{domain}:{bus}:{rest.split('.')[0]}): {xid}, pid=4242, "
            "name=python3, GPU has fallen off the bus.\n")
