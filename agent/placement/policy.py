"""Joint GPU + RDMA NIC preferred allocation by PCIe switch affinity: the pure policy.

The kubelet asks each resource separately, in random order per container, and never says which container it
serves (`kubelet-device-plugin.md` sections 0 and 2.4-2.6). So the agent remembers what it just allocated for
the other resource (`admission.AdmissionContext`) and hands it here as `context`. With it the policy knows
the container's GPUs (or VFs) and aligns with them; without it, it chooses so that the next call can align:

- GPU first: GPUs with the best PCIe locality among themselves, then with free NICs under their switches,
  then leaving the most PIX GPU-NIC pairs and the most clustered free GPUs for later pods.
- NIC after GPU: each GPU gets a VF on the PF nearest to it (PIX before PXB before PHB before NODE before
  SYS), over distinct PFs when the count allows; extra VFs go near the GPUs.
- NIC first: VFs on PFs whose nearby GPUs are free (all GPUs when the free ones are unknown), one VF per PF
  where possible, so the GPU call can then align. This is also the NIC-only case (GPUs served by another
  plugin): spreading over PFs, one VF per PF when the size equals the number of PFs, as operators did by
  hand, lets NCCL find the NIC under each GPU's switch whichever GPUs the other plugin picks.
- GPU after NIC: the GPUs nearest to those VFs' PFs, then the best locality among themselves.

The exact score is in `score`; `search` finds its optimum exactly by reasoning over
counts per PCIe group (VFs of one PF, and GPUs at one location, are interchangeable) rather than subsets.

Contract: exactly `size` IDs, all from `available`, every `must_include` among them, the same answer for equal
inputs whatever their order; [] (never an exception) when the request is impossible or malformed. The kubelet
treats [] as "no preference". No I/O and no locks; the only state is a memo of the per-topology tree.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from agent.placement.score import Mode, node_values_function
from agent.placement.search import best_counts
from agent.placement.tree import PcieTree, matched_levels, subtree_counts, tree_for
from agent.topology.model import Level, Topology

log = logging.getLogger(__name__)


class DeviceKind(enum.StrEnum):
    """The two resources the agent serves. GPUs are named by UUID, NIC devices by VF (or VF-less PF) bus id."""

    GPU = "gpu"
    NIC = "nic"


@dataclass(frozen=True, kw_only=True)
class AllocationRequest:
    """One GetPreferredAllocation container request, plus what the agent knows about the other resource.

    `context`: the other kind's devices just allocated to this same container (empty when this resource
    comes first, or when the other one is not served here). `other_free`: the other kind's free devices,
    None when unknown (then all of them are assumed free). Collections are stored as frozensets: order is
    meaningless in the kubelet's lists.
    """

    topology: Topology
    kind: DeviceKind
    available: frozenset[str]
    size: int
    must_include: frozenset[str] = frozenset()
    context: frozenset[str] = frozenset()
    other_free: frozenset[str] | None = None

    def __post_init__(self) -> None:
        for name in ("available", "must_include", "context"):
            object.__setattr__(self, name, frozenset(getattr(self, name)))
        if self.other_free is not None:
            object.__setattr__(self, "other_free", frozenset(self.other_free))


class _BadRequest(ValueError):
    """Input the contract answers with no preference."""


def preferred_allocation(request: AllocationRequest) -> list[str]:
    """The preferred devices for `request`, in device order; [] when impossible or malformed."""
    try:
        return _preferred(request)
    except _BadRequest as exc:
        log.info("no preferred allocation for %s: %s", getattr(request, "kind", "?"), exc)
    except Exception:
        log.exception("preferred allocation failed; answering with no preference")
    return []


def preferred_vfs_for_gpus(topology: Topology, available: Iterable[str], size: int, gpus: Iterable[str],
                           must_include: Iterable[str] = ()) -> list[str]:
    """VFs for a container whose GPUs are known: each GPU gets a VF on its nearest PF."""
    return preferred_allocation(AllocationRequest(
        topology=topology, kind=DeviceKind.NIC, available=frozenset(available), size=size,
        must_include=frozenset(must_include), context=frozenset(gpus)))


def preferred_gpus_for_vfs(topology: Topology, available: Iterable[str], size: int, vfs: Iterable[str],
                           must_include: Iterable[str] = ()) -> list[str]:
    """GPUs for a container whose VFs are known: the GPUs nearest to those VFs' PFs."""
    return preferred_allocation(AllocationRequest(
        topology=topology, kind=DeviceKind.GPU, available=frozenset(available), size=size,
        must_include=frozenset(must_include), context=frozenset(vfs)))


def achieved_levels(topology: Topology, gpus: Iterable[str], nics: Iterable[str]) -> list[Level]:
    """GPU-NIC levels of a container's devices in a best one-to-one matching, best first.

    One entry per matched pair (min of the two counts); unknown IDs are ignored. For metrics and tests.
    """
    tree = tree_for(topology)
    gpu_nodes = _count(_located(tree, True, gpus).values())
    unit_nodes = _count(_located(tree, False, nics).values())
    return matched_levels(tree, gpu_nodes, unit_nodes)


def _preferred(request: AllocationRequest) -> list[str]:
    kind = DeviceKind(request.kind)
    size = request.size
    available, must = request.available, request.must_include
    if not isinstance(size, int) or size <= 0:
        raise _BadRequest(f"allocation size {size!r} is not positive")
    if not must <= available:
        raise _BadRequest(f"{len(must - available)} must_include devices are not available")
    if not len(must) <= size <= len(available):
        raise _BadRequest(f"size {size} outside [{len(must)} must_include, {len(available)} available]")
    tree = tree_for(request.topology)
    gpu = kind is DeviceKind.GPU
    atoms = _resolve(tree, gpu, available)
    if size == len(available):
        return _in_order(atoms, available)
    if size == len(must):
        return _in_order(atoms, must)

    context = _located(tree, not gpu, request.context)
    if request.other_free is None:  # unknown: every device of the other kind (memoized per tree)
        other_free = tree.memo.get(("all", not gpu))
        if other_free is None:
            everyone = tree.gpu_ids if not gpu else tree.assumed_units
            other_free = tree.memo[("all", not gpu)] = _located(tree, not gpu, everyone)
    else:
        other_free = _located(tree, not gpu, request.other_free)
    other_counts = _count(node for identity, node in other_free.items() if identity not in context)
    context_counts = _count(context.values())
    if gpu:
        mode = Mode.GPU_AFTER_NIC if context else Mode.GPU_FIRST
    else:
        mode = Mode.NIC_AFTER_GPU if context else Mode.NIC_FIRST

    own_high = _count(node for node, _ in atoms.values())
    own_low = _count(atoms[device_id][0] for device_id in must)
    free = subtree_counts(tree, own_high)
    values = node_values_function(mode, tree, free, subtree_counts(tree, context_counts or other_counts),
                                  subtree_counts(tree, other_counts))
    counts = best_counts(tree, size, own_low=own_low, own_high=own_high, values_of=values, searched=free)
    if counts is None:
        raise _BadRequest("no placement meets the bounds")  # unreachable after the checks above

    by_node: dict[int, list[tuple[bool, int | str, str]]] = {}
    for device_id, (node, identity) in atoms.items():
        by_node.setdefault(node, []).append((device_id not in must, identity, device_id))
    chosen: list[str] = []
    for node, count in counts.items():  # must_include first, then the lowest GPU index or bus id
        chosen.extend(device_id for _, _, device_id in sorted(by_node[node])[:count])
    log.debug("%s: %d of %d chosen", mode.value, size, len(available))
    return _in_order(atoms, chosen)


def _resolve(tree: PcieTree, gpu: bool, ids: Iterable[str]) -> dict[str, tuple[int, int | str]]:
    """(node, identity) of each requested ID; _BadRequest on unknown devices or one device named twice."""
    resolved: dict[str, tuple[int, int | str]] = {}
    for device_id in ids:
        found = tree.locate(gpu, device_id)
        if found is None:
            raise _BadRequest(f"unknown {'GPU' if gpu else 'NIC'} device {device_id!r}")
        resolved[device_id] = found
    if len({identity for _, identity in resolved.values()}) != len(resolved):
        raise _BadRequest("a device is listed twice under different names")
    return resolved


def _located(tree: PcieTree, gpu: bool, ids: Iterable[str]) -> dict[int | str, int]:
    """identity -> node of the known devices among `ids`; unknown ones are skipped (they are hints)."""
    located: dict[int | str, int] = {}
    for device_id in ids:
        found = tree.locate(gpu, device_id)
        if found is None:
            log.debug("ignoring unknown %s device %r", "GPU" if gpu else "NIC", device_id)
        else:
            located[found[1]] = found[0]
    return located


def _count(nodes: Iterable[int]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for node in nodes:
        counts[node] = counts.get(node, 0) + 1
    return counts


def _in_order(atoms: dict[str, tuple[int, int | str]], ids: Iterable[str]) -> list[str]:
    return sorted(ids, key=lambda device_id: (atoms[device_id][1], device_id))
