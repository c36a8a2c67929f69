"""Human and machine views of the node model: the `topology` command's matrix and its JSON."""

from __future__ import annotations

from typing import Any

from agent.topology.model import Level, Topology

LEGEND = (
    ("X", "Self"),
    ("SYS", "Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)"),
    ("NODE", "Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node"),
    ("PHB", "Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)"),
    ("P2C", "GPU over its NVLink-C2C link to the CPU, then PCIe to the NIC (Grace/Vera; nvidia-smi says SYS)"),
    ("PXB", "Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)"),
    ("PIX", "Connection traversing at most a single PCIe bridge"),
)


def _numa(value: int | None) -> int:
    return -1 if value is None else value


def _locality(path: str, group: str) -> str:
    return f" path {path} group {group}" if group else " (no GPUDirect group)"


def _dma(function: str) -> str:
    return f" Data Direct via {function}" if function else ""


def to_json(topology: Topology) -> dict[str, Any]:
    """The `topology --json` document: GPUs (each with its MIG devices), RDMA physical functions, GPU->NIC levels."""
    nics = topology.rdma_nics
    gpus: list[dict[str, Any]] = []
    for gpu in topology.gpus:
        entry: dict[str, Any] = {"index": gpu.index, "pci": gpu.bus_id, "numa": _numa(gpu.numa)}
        if gpu.uuid:
            entry["uuid"] = gpu.uuid
        entry["pcie_root"] = gpu.location.root
        entry["gpu_direct_path"] = gpu.gpu_direct_path or None
        entry["gpu_direct_group"] = gpu.gpu_direct_group or None
        entry["mig_devices"] = [{"uuid": mig.uuid, "profile": mig.profile, "gpu_instance": mig.gpu_instance,
                                 "compute_instance": mig.compute_instance, "parent_uuid": gpu.uuid}
                                for mig in gpu.mig_devices]  # NVML's order; empty unless in MIG mode
        gpus.append(entry)
    return {
        "source": topology.source,
        "gpus": gpus,
        "nics": [
            {
                "pci": nic.bus_id,
                "rdma": nic.rdma,
                "netdev": nic.netdevs[0] if nic.netdevs else None,
                "numa": _numa(nic.numa),
                "link_type": nic.link_type,
                "pcie_root": nic.location.root,
                "gpu_direct_path": nic.gpu_direct_path or None,
                "gpu_direct_group": nic.gpu_direct_group or None,
                "data_direct_function": nic.data_direct_function or None,
                "vfs": [vf.bus_id for vf in nic.vfs],
            }
            for nic in nics
        ],
        "links": {
            gpu.bus_id: {nic.bus_id: topology.level(gpu.bus_id, nic.bus_id).name for nic in nics}
            for gpu in topology.gpus
        },
    }


def to_matrix(topology: Topology) -> str:
    """A GPU + NIC distance matrix in the style of `nvidia-smi topo -m`, with legends."""
    nics = topology.rdma_nics
    names = [f"GPU{g.index}" for g in topology.gpus] + [f"NIC{i}" for i in range(len(nics))]
    bus_ids = [g.bus_id for g in topology.gpus] + [n.bus_id for n in nics]
    numas = [g.numa for g in topology.gpus] + [n.numa for n in nics]
    width = max([6, *(len(n) + 2 for n in names)])
    lines = ["".ljust(width) + "".join(n.ljust(width) for n in names) + "NUMA Affinity"]
    for row, name in enumerate(names):
        cells = []
        for col in range(len(names)):
            level = topology.level(bus_ids[row], bus_ids[col])
            cells.append((" X" if level is Level.X else level.name).ljust(width))
        numa = "N/A" if numas[row] is None else str(numas[row])
        lines.append(name.ljust(width) + "".join(cells) + numa)
    if not names:
        lines = ["No GPUs or RDMA NICs found."]
    lines += ["", "Legend:", ""]
    lines += [f"  {key:<4} = {text}" for key, text in LEGEND]
    if nics:
        lines += ["", "NIC Legend:", ""]
        lines += [f"  NIC{i}: {nic.rdma} ({nic.bus_id}, {len(nic.vfs)} VFs)"
                  + _locality(nic.gpu_direct_path, nic.gpu_direct_group) + _dma(nic.data_direct_function)
                  for i, nic in enumerate(nics)]
    if topology.gpus:
        lines += ["", "GPU Legend:", ""]
        for g in topology.gpus:
            lines.append(f"  GPU{g.index}: {g.bus_id} {g.uuid or '(UUID unknown: NVML unavailable)'}"
                         f"{_locality(g.gpu_direct_path, g.gpu_direct_group)}")
            # a MIG device sits where its parent sits: its row in the matrix is the parent's
            lines += [f"    MIG {m.profile} GI {m.gpu_instance} CI {m.compute_instance}: {m.uuid}"
                      for m in g.mig_devices]
    lines.append(f"\nSource: {topology.source}")
    return "\n".join(lines)
