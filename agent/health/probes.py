"""Active one-shot checks for preflight: ask NVML and the links *now* instead of waiting for passive findings.

A node carrying the preflight taint must prove itself before it takes work: no row remap waiting for a reset,
no uncorrectable ECC error since the last reset, every RDMA link up. Each probe returns (ok, detail) and is
blocking (NVML, sysfs, netlink), so remediation runs it in a worker thread. A probe that cannot look (NVML
unavailable) fails: an unverified node keeps its preflight taint, and the condition says why.

The probes read the ports (`agent.host`) and the model (`agent.topology`), so they live in health, above both;
remediation's preflight receives them as plain callables from the wiring.
"""

from __future__ import annotations

from collections.abc import Callable

from agent.host.links import LinkPort
from agent.host.nvml import GpuLostError, MemoryHealth, NvmlError, NvmlHealth
from agent.topology.model import Topology

Probe = Callable[[], tuple[bool, str]]
CurrentTopology = Callable[[], Topology]  # the latest rescan, read when the probe runs


def _memory(nvml: NvmlHealth, topology: Topology) -> tuple[list[MemoryHealth], list[str]]:
    """Memory health of every GPU NVML knows, and the problems met while asking."""
    polled: list[MemoryHealth] = []
    problems: list[str] = []
    if not nvml.available:
        return polled, ["NVML unavailable: cannot verify GPU memory health"]
    for gpu in topology.gpus:
        if gpu.uuid is None:
            problems.append(f"GPU {gpu.index} ({gpu.bus_id}) unknown to NVML")
            continue
        try:
            polled.append(nvml.memory_health(gpu.uuid))
        except GpuLostError:
            problems.append(f"GPU {gpu.index} ({gpu.bus_id}) is lost")
        except NvmlError as exc:
            problems.append(f"GPU {gpu.index} ({gpu.bus_id}): {exc}")
    return polled, problems


def no_pending_row_remap(nvml: NvmlHealth, topology: CurrentTopology) -> Probe:
    """No GPU has a row remap pending (needs a reset) or a failed remap."""
    def probe() -> tuple[bool, str]:
        polled, problems = _memory(nvml, topology())
        problems += [f"{m.uuid}: row remap pending" for m in polled if m.remap_pending]
        problems += [f"{m.uuid}: row remap failed" for m in polled if m.remap_failure]
        return not problems, "; ".join(problems) or f"{len(polled)} GPUs without pending or failed row remaps"
    return probe


def no_uncorrectable_ecc(nvml: NvmlHealth, topology: CurrentTopology) -> Probe:
    """No GPU counted an uncorrectable ECC error since its last reset."""
    def probe() -> tuple[bool, str]:
        polled, problems = _memory(nvml, topology())
        problems += [f"{m.uuid}: {m.ecc_uncorrected_volatile} uncorrectable ECC errors" for m in polled
                     if m.ecc_uncorrected_volatile]
        return not problems, "; ".join(problems) or f"{len(polled)} GPUs without uncorrectable ECC errors"
    return probe


def nic_links_up(links: LinkPort, topology: CurrentTopology) -> Probe:
    """Every RDMA NIC's ports are ACTIVE and its netdevs up."""
    def probe() -> tuple[bool, str]:
        netdevs = links.netdev_states()
        problems: list[str] = []
        nics = topology().rdma_nics
        for nic in nics:
            ports = links.rdma_port_states(nic.rdma or "")
            problems += [f"{nic.rdma} port {n} is {state}" for n, state in sorted(ports.items()) if state != "ACTIVE"]
            for name in nic.netdevs:
                state = netdevs.get(name)
                if state is not None and state.operstate not in ("up", "unknown"):
                    problems.append(f"{name} is {state.operstate}")
        return not problems, "; ".join(problems) or f"{len(nics)} RDMA NICs up"
    return probe
