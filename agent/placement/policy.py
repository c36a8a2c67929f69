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
inputs whatever their order; [] when the request is impossible or malformed. The kubelet treats [] as "no
preference". No I/O and no locks; the only state is a memo of the per-topology tree.

The servicer's entry is `check_request`: the one validation of a kubelet container request against the devices
served and their health. It returns the reason the servicer counts (`Reason`: ok, invalid_request, short) and
what to choose from; `Checked.answered` turns the choice into a `Preference` (empty when the policy found no
answer). An exception from a policy is a bug: the servicer answers it with no preference and counts it.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable, Sequence, Set
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


class Reason(enum.StrEnum):
    """Why a container request got the answer it got; all but `ok` are counted by the servicer."""

    OK = "ok"
    INVALID_REQUEST = "invalid_request"  # inconsistent, or names devices not served here
    EMPTY = "empty"  # the policy found no valid answer
    SHORT = "short"  # fewer healthy devices offered than asked for: a partial preference


@dataclass(frozen=True, kw_only=True)
class Partner:
    """What the kubelet's records (`agent.ownership`) say about the container under admission and the other kind.

    `held`: the other kind's devices it holds, a fact (empty: none yet); None when not known, and then `reason`
    says why (a `gpu_node_agent_preference_fallbacks_total` reason). `candidates`: the devices of the containers
    that may be it (several new holders under different switches; empty when none). `free`: the other
    kind's free devices at the kubelet's last reading, in the IDs its servers use (a time-sliced GPU's replicas);
    None when never read, or too old to beat the allocator's own estimate.
    """

    held: frozenset[str] | None = None
    reason: str = ""
    candidates: frozenset[str] = frozenset()
    free: frozenset[str] | None = None


@dataclass(frozen=True, kw_only=True)
class ContainerRequest:
    """One GetPreferredAllocation container request as the kubelet sent it, with what the servicer knows.

    `served`: the resource's device IDs in pool order; `unhealthy`: those marked Unhealthy here (the kubelet's
    view may lag by one ListAndWatch message, so it can still offer them). `partner`: the kubelet's facts about
    this container's devices of the other kind; None when there are none to ask (then the admission context
    guesses, and the other kind's free devices are the allocator's estimate).
    """

    served: Sequence[str]
    available: Sequence[str]
    size: int
    must_include: Sequence[str] = ()
    unhealthy: Set[str] = frozenset()
    partner: Partner | None = None


# (resource, level label): one Allocate of `resource` whose container's GPU-NIC level is now known (`joint`)
AllocationLevel = tuple[str, str]


@dataclass(frozen=True, kw_only=True)
class Decision:
    """What one preference call decided about its container, for the Allocate that follows it: the servicer
    keeps it and hands it back to `joint.JointAllocator.allocated`, which takes it only where it still holds
    (its own resource, nothing allocated or preferred in between, within the admission time-out, every device
    allocated from this offer): a stale one is ignored, never applied to another container.

    `partner`: the other kind's devices this container holds, as the topology names them (None: not known);
    `completes`: the preference took the admission context's record of the other kind (the guess: this is that
    container's second resource); `pix_possible`: the offer held a device at PIX to the container's other kind;
    `pairs_with`: the first resource and devices of the container whose pair this Allocate completes, for the
    level it counts (the last Allocate's, still unpaired at the preference call), None when it completes none.
    """

    resource: str
    offered: frozenset[str]  # the kubelet's offer (`available`, must_include among it): the Allocate takes from it
    partner: frozenset[str] | None
    completes: bool
    pix_possible: bool
    stamp: int  # the allocator's call count after this preference: only the very next call may take it
    at: float
    pairs_with: tuple[str, frozenset[str]] | None = None


@dataclass(frozen=True)
class Preference:
    """The answer to one container request: the devices (empty: no preference), why, and for the log, detail.

    `levels`: allocations whose container level became known while answering (see `joint`), for the
    servicer's allocation counter. `decision`: what the joint allocator decided, for this container's Allocate
    (None from a policy without one, or an invalid request).
    """

    devices: tuple[str, ...]
    reason: Reason = Reason.OK
    detail: str = ""
    levels: tuple[AllocationLevel, ...] = ()
    decision: Decision | None = None


@dataclass(frozen=True)
class Checked:
    """A validated container request: what to choose from, and how many."""

    reason: Reason  # ok, invalid_request or short
    detail: str
    offered: tuple[str, ...]  # the available devices healthy here (must_include always kept), kubelet order
    size: int  # devices to choose: the size asked for, or fewer when short (0 when invalid)

    @property
    def proceed(self) -> bool:
        """Whether there is anything to choose (a valid request with a healthy device offered)."""
        return self.size > 0

    def answered(self, devices: Sequence[str], levels: Iterable[AllocationLevel] = (),
                 decision: Decision | None = None) -> Preference:
        """The preference for the `devices` chosen; `empty` when none were although the request was whole."""
        if not devices and self.reason is Reason.OK:
            return Preference((), Reason.EMPTY, "the policy found no valid answer", tuple(levels), decision)
        return Preference(tuple(devices), self.reason, self.detail, tuple(levels), decision)


def check_request(request: ContainerRequest) -> Checked:
    """The one validation of a kubelet container request: invalid, short (partial) or ok."""
    problem = _unknown_problem(request.served, request.available, request.must_include) or bounds_problem(
        frozenset(request.available), frozenset(request.must_include), request.size)
    if problem is not None:
        return Checked(Reason.INVALID_REQUEST, problem, (), 0)
    must = frozenset(request.must_include)
    offered = tuple(device_id for device_id in dict.fromkeys(request.available)
                    if device_id not in request.unhealthy or device_id in must)
    size = min(request.size, len(offered))
    if size < request.size:
        return Checked(Reason.SHORT, f"only {size} of the {request.size} devices asked for are healthy; "
                       "partial preference", offered, size)
    return Checked(Reason.OK, "", offered, size)


def bounds_problem(available: Set[str], must_include: Set[str], size: object) -> str | None:
    """Why `size` devices cannot be chosen from `available` with every `must_include`; None when they can."""
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        return f"allocation_size {size!r} is not positive"
    missing = sorted(must_include - available)
    if missing:
        return f"must_include devices not in available: {', '.join(missing)}"
    if len(must_include) > size:
        return f"{len(must_include)} must_include devices exceed allocation_size {size}"
    if len(available) < size:
        return f"only {len(available)} devices available for allocation_size {size}"
    return None


def _unknown_problem(served: Sequence[str], available: Sequence[str], must_include: Sequence[str]) -> str | None:
    unknown = sorted((set(available) | set(must_include)) - set(served))
    return f"unknown device IDs: {', '.join(unknown)}" if unknown else None


def in_served_order(served: Sequence[str], offered: Sequence[str], must_include: Sequence[str],
                    size: int) -> list[str]:
    """The simple policy: `must_include` first, then offered devices in served (pool) order up to `size`."""
    chosen = list(dict.fromkeys(must_include))
    offered_set = set(offered)
    for device_id in served:
        if len(chosen) >= size:
            break
        if device_id in offered_set and device_id not in chosen:
            chosen.append(device_id)
    return chosen[:size]


def simple_preference(request: ContainerRequest) -> Preference:
    """`check_request`, then `in_served_order`: the policy of a servicer without PCIe awareness."""
    checked = check_request(request)
    if not checked.proceed:
        return checked.answered(())
    return checked.answered(in_served_order(request.served, checked.offered, request.must_include, checked.size))


class _BadRequest(ValueError):
    """Input the contract answers with no preference."""


def preferred_allocation(request: AllocationRequest) -> list[str]:
    """The preferred devices for `request`, in device order; [] when impossible or malformed."""
    try:
        return _preferred(request)
    except _BadRequest as exc:
        log.info("no preferred allocation for %s: %s", request.kind, exc)
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
    if request.kind not in tuple(DeviceKind):
        raise _BadRequest(f"unknown device kind {request.kind!r}")
    kind = DeviceKind(request.kind)
    size = request.size
    available, must = request.available, request.must_include
    problem = bounds_problem(available, must, size)
    if problem is not None:
        raise _BadRequest(problem)
    tree = tree_for(request.topology)
    gpu = kind is DeviceKind.GPU
    atoms = _resolve(tree, gpu, available)
    if size == len(available):
        return _in_order(atoms, available)
    if size == len(must):
        return _in_order(atoms, must)

    context = _located(tree, not gpu, request.context)
    # unknown free devices of the other kind: all of them are assumed free
    other_free = tree.everyone(not gpu) if request.other_free is None else _located(
        tree, not gpu, request.other_free)
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
