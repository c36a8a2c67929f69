"""The score the preferred-allocation policy maximises, one definition per admission situation.

A score is a tuple of non-negative counts compared lexicographically, larger is better. Every count is a sum
over PCIe groups (see `tree`) of a function of how many chosen devices fall in the group, which
is what lets the search find the exact optimum by dynamic programming over counts.

Terms, for the chosen set S of the requested kind ("units" are NIC VFs, or VF-less PFs):

- alignment[L] (L = PIX..SYS; P2C between PXB and PHB): GPU-NIC pairs at level <= L in a best one-to-one
  matching of S with its partners. Partners are the devices of the other kind just allocated to this container
  (the admission context) or, when there are none, the free devices of the other kind (all of them when
  unknown). Compared from PIX up, so this is the per-GPU level histogram: most PIX first, then most PXB, and so on.
- locality[L] (L = NODE, PHB, P2C, PXB, PIX): pairs within S at level <= L. Compared from NODE down, which is
  "fewest SYS pairs, then fewest NODE pairs, ...": the worst pairwise level first.
- spread: pairs of units of S on different PFs. Largest when S uses as many PFs as it can, as evenly as
  it can: one VF per PF up to the number of PFs, then two, and so on.
- proximity[L] (L = PIX..SYS): units of S within L of some partner GPU (extra VFs stay near the GPUs).
- pix_pairs_left: GPU-NIC pairs that can still be made at PIX after this allocation, summed per switch:
  min(free GPUs, free units) left under it. When S's partners are the free devices, S is assumed to take
  its PIX partners with it (the next call of this container will). Less is fragmentation.
- free_clustering[L] (L = PIX..NODE): pairs among the GPUs left free at level <= L; keeps free GPUs
  together for later multi-GPU pods (best fit).

Order per situation (`FIELDS`): GPU first: locality, alignment, pix_pairs_left, free_clustering. GPU after
NIC: alignment, locality, pix_pairs_left, free_clustering. NIC first (also NIC only, GPUs served elsewhere):
alignment with the free GPUs, spread, locality, pix_pairs_left, so one VF per PF when the size equals the
number of PFs. NIC after GPU: alignment, spread, proximity, pix_pairs_left. Why: with a context, aligning
with this container's devices is the point; GPUs first keep their own locality first (NVLink is usually
uniform, PCIe locality is what differs), then prefer GPUs with free NICs under their switches because the
same container's NIC call usually follows, and only then think of later pods. Exact ties after the whole
score go to the lowest GPU index or bus id.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from agent.placement.tree import NO_PF, PcieTree
from agent.topology.model import Level


class Mode(enum.Enum):
    """Which kind is chosen, and whether the other kind was already allocated to this container."""

    GPU_FIRST = "gpu-first"
    GPU_AFTER_NIC = "gpu-after-nic"
    NIC_FIRST = "nic-first"
    NIC_AFTER_GPU = "nic-after-gpu"

    @property
    def after_context(self) -> bool:
        """True when the partners are the other kind's devices already given to this container."""
        return self in (Mode.GPU_AFTER_NIC, Mode.NIC_AFTER_GPU)


class Term(enum.Enum):
    """One family of counts of the score (see the module docstring)."""

    ALIGNMENT = "alignment"
    LOCALITY = "locality"
    SPREAD = "spread"
    PROXIMITY = "proximity"
    PIX_PAIRS_LEFT = "pix_pairs_left"
    FREE_CLUSTERING = "free_clustering"


Field = tuple[Term, Level | None]

_UP = (Level.PIX, Level.PXB, Level.P2C, Level.PHB, Level.NODE, Level.SYS)  # P2C: Grace/Vera C2C nodes
_ALIGNMENT: list[Field] = [(Term.ALIGNMENT, level) for level in _UP]
_LOCALITY: list[Field] = [(Term.LOCALITY, level) for level in (Level.NODE, Level.PHB, Level.P2C, Level.PXB,
                                                                Level.PIX)]
_PROXIMITY: list[Field] = [(Term.PROXIMITY, level) for level in _UP]
_CLUSTERING: list[Field] = [(Term.FREE_CLUSTERING, level) for level in _UP[:-1]]
_SPREAD: list[Field] = [(Term.SPREAD, None)]
_LEFT: list[Field] = [(Term.PIX_PAIRS_LEFT, None)]

FIELDS: dict[Mode, tuple[Field, ...]] = {
    Mode.GPU_FIRST: (*_LOCALITY, *_ALIGNMENT, *_LEFT, *_CLUSTERING),
    Mode.GPU_AFTER_NIC: (*_ALIGNMENT, *_LOCALITY, *_LEFT, *_CLUSTERING),
    Mode.NIC_FIRST: (*_ALIGNMENT, *_SPREAD, *_LOCALITY, *_LEFT),
    Mode.NIC_AFTER_GPU: (*_ALIGNMENT, *_SPREAD, *_PROXIMITY, *_LEFT),
}

# Fields are packed into one integer, most significant first, so comparing and adding scores is one integer
# operation. Each field stays far below half the radix in absolute value (it counts pairs among at most a
# few thousand devices), so partial sums with a negative field (spread, before the root adds its pairs)
# still compare lexicographically.
_RADIX_BITS = 32


def decode(mode: Mode, packed: int) -> tuple[int, ...]:
    """The field values of a packed score (for logs and tests)."""
    count = len(FIELDS[mode])
    mask = (1 << _RADIX_BITS) - 1
    return tuple((packed >> (_RADIX_BITS * (count - 1 - i))) & mask for i in range(count))


def _pairs(count: int) -> int:
    return count * (count - 1) // 2


@dataclass(frozen=True)
class _NodeWeights:
    """What one group adds to the packed score per unit of each of its terms (0: not a term here)."""

    alignment: int = 0
    locality: int = 0
    proximity: int = 0
    clustering: int = 0
    spread: int = 0  # +w at the global root (all pairs), -w at a PF (pairs within it)
    pix_left: int = 0


NodeWeights = tuple[_NodeWeights | None, ...]  # per node of a tree, under one mode

# Weights per tree and mode, derived from the tree alone, so they are kept as long as the tree is (trees are
# immutable and rebuilt per topology object: an entry never goes stale).
_weights: weakref.WeakKeyDictionary[PcieTree, dict[Mode, NodeWeights]] = weakref.WeakKeyDictionary()


def _node_weights(mode: Mode, tree: PcieTree) -> NodeWeights:
    """Per node, its weights under `mode`; None for nodes that add nothing. Memoized per tree."""
    per_mode = _weights.get(tree)
    if per_mode is None:
        per_mode = _weights[tree] = {}
    cached = per_mode.get(mode)
    if cached is not None:
        return cached
    fields = FIELDS[mode]
    weight = {field: 1 << (_RADIX_BITS * (len(fields) - 1 - i)) for i, field in enumerate(fields)}
    spread = weight.get((Term.SPREAD, None), 0)
    result: list[_NodeWeights | None] = []
    for index, node in enumerate(tree.nodes):
        # a maximal group is the "within L" class for every L from its own level up to its parent's (exclusive):
        # a top switch under a root complex is the class for PXB and P2C, a Grace socket's C2C group for P2C and
        # PHB. Every count is linear in its weight, so the group's weight is the sum over those levels.
        covered = [] if not node.maximal else [level for level in Level if node.level <= level and (
            node.parent < 0 or level < tree.nodes[node.parent].level)]

        def of(term: Term, covered: list[Level] = covered) -> int:
            return sum(weight.get((term, level), 0) for level in covered)

        weights = _NodeWeights(
            alignment=of(Term.ALIGNMENT),
            locality=of(Term.LOCALITY),
            proximity=of(Term.PROXIMITY),
            clustering=of(Term.FREE_CLUSTERING),
            spread=spread if index == 0 else -spread if node.pf != NO_PF else 0,
            pix_left=weight[(Term.PIX_PAIRS_LEFT, None)] if node.under_switch else 0,
        )
        result.append(weights if weights != _NodeWeights() else None)
    per_mode[mode] = cached = tuple(result)
    return cached


NodeValues = Callable[[int, int, int], list[int] | None]


def node_values_function(mode: Mode, tree: PcieTree, free: list[int], partners: list[int],
                         other_free: list[int]) -> NodeValues:
    """values(node, low, n): the packed contribution of one group for low, low + 1, ... chosen devices.

    None for groups that contribute nothing under this mode.

    `free`, `partners` and `other_free` are per-node subtree counts of the available devices of the chosen
    kind, of the partners, and of the free devices of the other kind.
    """
    all_weights = _node_weights(mode, tree)
    consume = not mode.after_context

    def values(index: int, low: int, count: int) -> list[int] | None:
        weights = all_weights[index]
        if weights is None:
            return None
        mine, theirs, other = free[index], partners[index], other_free[index]
        out: list[int] = []
        for x in range(low, low + count):
            pairs = x * (x - 1) // 2
            total = (weights.alignment * min(x, theirs) + weights.locality * pairs
                     + weights.spread * pairs)
            if weights.proximity and theirs:
                total += weights.proximity * x
            if weights.clustering:
                total += weights.clustering * _pairs(mine - x)
            if weights.pix_left:
                total += weights.pix_left * min(mine - x, other - (min(x, other) if consume else 0))
            out.append(total)
        return out

    return values
