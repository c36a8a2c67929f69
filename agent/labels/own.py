"""The agent's own `gpunodeagent.io/` labels: topology and health facts no other labeler has (pure functions).

- `gpu-nic.pix`: GPUs with an RDMA NIC (physical function) under the same PCIe switch (topology level PIX);
- `nic.rdma.count`: RDMA physical functions; `nic.link-layer`: `infiniband`, `ethernet` (RoCE) or `mixed`;
- `nic.rate-gbps`: the lowest rate of the ACTIVE ports of those NICs (Gb/s as the kernel writes it, `400`);
- `topology.source`: `nccl-xml` when an NCCL topology file placed the devices, else `sysfs` (`+` is not allowed
  in a label value, so `sysfs+nccl-xml` is `nccl-xml`);
- `gpu.expected` / `gpu.healthy`: GPUs the node should have, and those whose health is known and healthy now. A
  GPU whose health is only unknown (its check could not look) counts as it last was: a failing source never
  turns the count into 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence, Set

from agent.config.fields import PROJECT_DOMAIN
from agent.host.nic_sysfs import PortReading
from agent.topology.model import Gpu, Level, Nic, Topology

OWN = f"{PROJECT_DOMAIN}/"
GPU_NIC_PIX, NIC_RDMA_COUNT, NIC_RATE, NIC_LINK_LAYER = (f"{OWN}gpu-nic.pix", f"{OWN}nic.rdma.count",
                                                        f"{OWN}nic.rate-gbps", f"{OWN}nic.link-layer")
GPU_EXPECTED, GPU_HEALTHY, TOPOLOGY_SOURCE = f"{OWN}gpu.expected", f"{OWN}gpu.healthy", f"{OWN}topology.source"
_LAYERS = {"infiniband": "infiniband", "ethernet": "ethernet", "ether": "ethernet"}


def _layer(nic: Nic) -> str:
    for port in nic.ports:
        if port.link_layer:
            return _LAYERS.get(port.link_layer.lower(), "")
    return _LAYERS.get(nic.link_type.lower(), "")


def topology_labels(topology: Topology) -> dict[str, str]:
    """pix, RDMA NIC count, link layer and source, from the topology alone."""
    rdma = topology.rdma_nics
    pix = sum(1 for gpu in topology.gpus if any(topology.level(gpu.bus_id, nic.bus_id) == Level.PIX for nic in rdma))
    labels = {GPU_NIC_PIX: str(pix), NIC_RDMA_COUNT: str(len(rdma)),
              TOPOLOGY_SOURCE: "nccl-xml" if "nccl-xml" in topology.source.split("+") else "sysfs"}
    layers = {_layer(nic) for nic in rdma} - {""}
    if layers:
        labels[NIC_LINK_LAYER] = layers.pop() if len(layers) == 1 else "mixed"
    return labels


def rate_label(ports: Iterable[PortReading]) -> dict[str, str] | None:
    """The lowest ACTIVE port rate; None when no port is ACTIVE with a rate (nothing to say: keep the last)."""
    rates = [p.rate_gbps for p in ports if p.state == "ACTIVE" and p.rate_gbps]
    return {NIC_RATE: f"{min(rates):g}"} if rates else None


class HealthyGpus:
    """Counts GPUs known healthy, remembering each GPU's last known health for the time its health is unknown."""

    def __init__(self) -> None:
        self.last: dict[str, bool] = {}  # GPU UUID -> healthy, as last known

    def count(self, gpus: Sequence[Gpu], unhealthy: Set[str], unknown: Set[str]) -> int | None:
        """GPUs healthy now; None while a GPU's health was never known (no UUID yet, or unknown since start)."""
        healthy = 0
        complete = True
        for gpu in gpus:
            if gpu.uuid is None:
                complete = False
                continue
            if gpu.uuid in unknown:
                state = self.last.get(gpu.uuid)
            else:
                state = gpu.uuid not in unhealthy
                self.last[gpu.uuid] = state
            if state is None:
                complete = False
            healthy += bool(state)
        return healthy if complete else None
