"""The PCIe tree that the preferred-allocation policy searches, built once per `Topology`.

Why a tree: every level that `Location.level_to` reports is the lowest group two devices share, in the nesting
NUMA node > root complex > top switch > the device's own switch (> its PF, for VFs):

    global (SYS) > NUMA node (NODE) > [Grace/Vera root ports of that node (P2C)] > root complex (PHB; P2C on
    Grace/Vera) > top switch (PXB) > location (PIX, or PHB/P2C for devices straight on a root port) > PF (the VFs
    of one PF sit at the PF's location)

A NIC sits where its data path is (`Topology.unit_location`): a Data Direct NIC at its DMA function.

So "how many pairs sit at level <= L" depends only on how many chosen devices fall in each group, never on
which ones. That lets the policy reason over counts per group (VFs of one PF, and GPUs at one location, are
interchangeable) instead of over subsets, which keeps it exact and sub-millisecond.

The tree agrees with `level_to` whenever NUMA is known for every device or for none. When it is known for
some only (broken firmware), `level_to` calls any cross-root pair involving an unknown NUMA node NODE; the
tree then folds all NUMA nodes into one and calls every cross-root pair NODE.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field

from agent.host.busid import BusIdError, normalize_bus_id
from agent.placement.replicas import physical
from agent.topology.model import Level, Location, Topology

log = logging.getLogger(__name__)

NO_PF = -1


@dataclass(frozen=True)
class TreeNode:
    """One group of the PCIe tree.

    `level` is the level of two devices whose lowest common group is this one. `maximal` is true when the
    parent's level is higher: the maximal groups of level L partition the devices into "within L of each
    other" classes, which is what every count of the score is taken over.
    """

    level: Level
    parent: int  # -1 for the global root
    children: tuple[int, ...]
    maximal: bool
    pf: int = NO_PF  # index of the PF (PF nodes only)
    under_switch: bool = False  # a location under a PCIe switch: its GPU-NIC pairs are PIX


# A device's identity (what makes two spellings the same device: the GPU index, the canonical bus id of a NIC
# function) mapped to the tree node it sits at.
Located = Mapping[int | str, int]


@dataclass(frozen=True, eq=False)
class PcieTree:
    """The groups of one topology, parents before children, plus the device-ID lookups the policy needs.

    Immutable once built: everything the policy derives from the topology alone is computed here, once.
    """

    topology: Topology
    nodes: tuple[TreeNode, ...]
    gpu_node: tuple[int, ...]  # GPU index -> its location node
    pf_node: tuple[int, ...]  # PF index -> its PF node
    gpu_ids: tuple[str, ...]  # GPU index -> the ID the kubelet sees (UUID, else bus id)
    assumed_units: tuple[str, ...]  # NIC IDs presumed free when the caller does not know: RDMA VFs and VF-less PFs
    _gpu_by_id: dict[str, int]
    _pf_by_unit: dict[str, int]
    # Where every GPU, and every assumed unit, sits: the other kind's free devices when the caller does not know
    every_gpu: Located = field(default_factory=dict)
    every_unit: Located = field(default_factory=dict)
    # MIG UUID -> (parent GPU index, identity): a MIG device sits where its parent GPU sits
    _mig_by_id: dict[str, tuple[int, str]] = field(default_factory=dict)

    def everyone(self, gpu: bool) -> Located:
        """identity -> node of every GPU (`gpu`) or of every assumed NIC unit."""
        return self.every_gpu if gpu else self.every_unit

    def gpu_index(self, device_id: str) -> int | None:
        """GPU index for a UUID (or a bus id in any accepted form), None when unknown."""
        found = self._gpu_by_id.get(device_id)
        return found if found is not None else self._gpu_by_id.get(_canonical(device_id) or "")

    def locate(self, gpu: bool, device_id: str) -> tuple[int, int | str] | None:
        """(node, identity) of a GPU (UUID or bus id), a MIG device (MIG UUID: its parent's node), a replica of
        either (`<id>::<n>`: that device) or a NIC device (VF or PF bus id); None if unknown.

        The identity is what makes two spellings the same device: the GPU index, `<GPU index>/<MIG index>` (a
        string that sorts by GPU index), the canonical bus id.
        """
        if gpu:
            device_id = physical(device_id)  # a time-sliced replica is its GPU or MIG device
            mig = self._mig_by_id.get(device_id)
            if mig is not None:
                return self.gpu_node[mig[0]], mig[1]
            index = self.gpu_index(device_id)
            return None if index is None else (self.gpu_node[index], index)
        pf = self._pf_by_unit.get(device_id)  # canonical ids, the kubelet's case, skip parsing
        if pf is None:
            canonical = _canonical(device_id)
            pf = self._pf_by_unit.get(canonical) if canonical else None
            device_id = canonical or device_id
        return None if pf is None else (self.pf_node[pf], device_id)


def _canonical(text: str) -> str | None:
    if not isinstance(text, str):
        return None
    try:
        return normalize_bus_id(text)
    except BusIdError:
        return None


# Indexes by topology identity: a Topology is immutable and a rescan publishes a new object, so the index of
# the object in hand never goes stale. Hashing a whole Topology per call would cost more than the search.
_cache: weakref.WeakValueDictionary[int, PcieTree] = weakref.WeakValueDictionary()
_recent: list[PcieTree] = []  # strong references to the last few, so the weak cache keeps them
_RECENT = 4


def tree_for(topology: Topology) -> PcieTree:
    """The tree of `topology`, memoized per object (a pure function of it, immutable once built)."""
    tree = _cache.get(id(topology))
    if tree is not None and tree.topology is topology:
        return tree
    tree = build_tree(topology)
    _cache[id(topology)] = tree
    _recent.append(tree)
    del _recent[:-_RECENT]
    return tree


def build_tree(topology: Topology) -> PcieTree:
    """Group the GPUs and NIC PFs of `topology` into the PCIe tree."""
    gpus = topology.gpus
    pfs = tuple(sorted(topology.nics, key=lambda nic: nic.bus_id))
    places = [topology.unit_location(nic) for nic in pfs]
    groups = _Groups(fold_numa=_mixed_numa([gpu.location for gpu in gpus] + places))
    gpu_keys = [groups.add(gpu.location, gpu.bus_id) for gpu in gpus]
    pf_keys = [groups.add(where, nic.bus_id, pf=index) for index, (nic, where) in enumerate(zip(pfs, places,
                                                                                                  strict=True))]
    order = groups.breadth_first()
    index_of = {key: i for i, key in enumerate(order)}
    nodes = tuple(TreeNode(
        level=groups.levels[key],
        parent=index_of[groups.parents[key]] if key in groups.parents else -1,
        children=tuple(index_of[child] for child in groups.children.get(key, ())),
        maximal=key not in groups.parents or groups.levels[groups.parents[key]] > groups.levels[key],
        pf=key[1] if key[0] == "pf" and isinstance(key[1], int) else NO_PF,
        under_switch=key[0] == "loc" and bool(key[3]),
    ) for key in order)

    gpu_by_id: dict[str, int] = {}
    for index, gpu in enumerate(gpus):
        gpu_by_id[gpu.bus_id] = index
        if gpu.uuid:
            gpu_by_id[gpu.uuid] = index
    mig_by_id = {mig.uuid: (index, f"{index:04d}/{mig.index:02d}") for index, gpu in enumerate(gpus)
                 for mig in gpu.mig_devices}
    pf_by_unit: dict[str, int] = {}
    assumed: list[str] = []
    for index, nic in enumerate(pfs):
        pf_by_unit[nic.bus_id] = index
        pf_by_unit.update((vf.bus_id, index) for vf in nic.vfs)
        if nic.is_rdma:
            assumed.extend(sorted(vf.bus_id for vf in nic.vfs) or [nic.bus_id])
    gpu_node = tuple(index_of[key] for key in gpu_keys)
    pf_node = tuple(index_of[key] for key in pf_keys)
    every_gpu: dict[int | str, int] = dict(enumerate(gpu_node))
    every_unit: dict[int | str, int] = {bus_id: pf_node[pf_by_unit[bus_id]] for bus_id in assumed}
    return PcieTree(
        topology=topology,
        nodes=nodes,
        gpu_node=gpu_node,
        pf_node=pf_node,
        gpu_ids=tuple(gpu.uuid or gpu.bus_id for gpu in gpus),
        assumed_units=tuple(assumed),
        _gpu_by_id=gpu_by_id,
        _pf_by_unit=pf_by_unit,
        every_gpu=every_gpu,
        every_unit=every_unit,
        _mig_by_id=mig_by_id,
    )


def _mixed_numa(locations: list[Location]) -> bool:
    numas = {location.numa for location in locations}
    if None in numas and len(numas) > 1:
        log.warning("NUMA node known for some devices only; treating the node as one NUMA domain")
        return True
    return False


# A group: its kind (sys, numa, root, top, loc, pf) then what tells it apart (NUMA node, root, switches, PF)
_Key = tuple[str | int | tuple[str, ...] | None, ...]
_ROOT_KEY: _Key = ("sys",)
_GROUP_LEVEL = {"sys": Level.SYS, "numa": Level.NODE, "c2c": Level.P2C, "root": Level.PHB, "top": Level.PXB}


@dataclass
class _Groups:
    """Group keys with their parents and levels, collected device by device."""

    fold_numa: bool
    parents: dict[_Key, _Key] = field(default_factory=dict)
    levels: dict[_Key, Level] = field(default_factory=lambda: {_ROOT_KEY: Level.SYS})
    lowest_bus: dict[_Key, str] = field(default_factory=dict)
    children: dict[_Key, list[_Key]] = field(default_factory=dict)

    def add(self, location: Location, bus_id: str, pf: int | None = None) -> _Key:
        """Register a device's groups; returns the key of its own node (location, or PF)."""
        numa = None if self.fold_numa else location.numa
        c2c = location.c2c and numa is not None  # `level_to` makes such pairs of one node P2C, even across roots
        chain: list[_Key] = [_ROOT_KEY, ("numa", numa)]
        if c2c:
            chain.append(("c2c", numa))
        chain.append(("root", numa, location.root))
        if location.switches:
            chain.append(("top", numa, location.root, location.switches[0]))
        chain.append(("loc", numa, location.root, location.switches))
        if pf is not None:
            chain.append(("pf", pf))
        own_level = location.level_to(location)  # PIX under a switch, PHB straight on a root port
        for parent, child in itertools.pairwise(chain):
            self.parents[child] = parent
            level = _GROUP_LEVEL.get(str(child[0]), own_level)
            self.levels[child] = min(level, Level.P2C) if c2c else level
        for key in chain:  # siblings are ordered by the lowest bus id below them
            if bus_id < self.lowest_bus.get(key, "~"):
                self.lowest_bus[key] = bus_id
        return chain[-1]

    def breadth_first(self) -> list[_Key]:
        """All keys, parents before children, siblings in bus order; fills `children`."""
        for child, parent in self.parents.items():
            self.children.setdefault(parent, []).append(child)
        for siblings in self.children.values():
            siblings.sort(key=lambda key: (self.lowest_bus[key], repr(key)))
        order = [_ROOT_KEY]
        for key in order:
            order.extend(self.children.get(key, ()))
        return order


def subtree_counts(tree: PcieTree, at_node: dict[int, int]) -> list[int]:
    """Per node, the sum of `at_node` over its subtree (children come after parents in `tree.nodes`)."""
    totals = [0] * len(tree.nodes)
    for node, count in at_node.items():
        totals[node] += count
    for index in range(len(tree.nodes) - 1, 0, -1):
        if totals[index]:
            totals[tree.nodes[index].parent] += totals[index]
    return totals


def matched_levels(tree: PcieTree, gpu_nodes: dict[int, int], unit_nodes: dict[int, int]) -> list[Level]:
    """Levels of a best one-to-one GPU-NIC matching, best first (one entry per matched pair).

    Greedy bottom-up matching is optimal on a tree: pairs made in a group are at least as close as any
    pair made above it, so matching as much as possible in each group maximises the pairs at every level.
    """
    gpus = subtree_counts(tree, gpu_nodes)
    units = subtree_counts(tree, unit_nodes)
    matched = [min(g, u) for g, u in zip(gpus, units, strict=True)]
    levels: list[Level] = []
    for index, node in enumerate(tree.nodes):
        here = matched[index] - sum(matched[c] for c in node.children)
        levels.extend([node.level] * here)
    return sorted(levels)


def switch_groups(topology: Topology, gpu: bool, device_ids: frozenset[str]) -> frozenset[int] | None:
    """The locations (a PCIe switch, or a root port) of GPUs (`gpu`) or NIC devices, as tree nodes; None when
    one is not on the topology. Two sets of devices with the same groups sit under the same switches, so the
    other kind's best choice is the same for either."""
    tree = tree_for(topology)
    groups: set[int] = set()
    for device_id in device_ids:
        found = tree.locate(gpu, device_id)
        if found is None:
            return None
        node = found[0]
        groups.add(node if gpu else tree.nodes[node].parent)  # a unit sits at its PF, under the PF's location
    return frozenset(groups)
