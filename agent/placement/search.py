"""Exact search for the best count of chosen devices per PCIe group.

The score is a sum over groups of a function of the group's count (`score`), so the best way to
place `size` devices is a knapsack over the tree: for each group and each count x, the best total of its
subtree, combined child by child (max-plus convolution). Cost is O(groups x size^2) additions of packed
integers whatever the number of subsets: a few hundred steps for an 8-GPU, 8-PF node. Enumerating subsets
instead would be fine at C(8, 4) = 70 GPU sets but not for VFs (C(64, 8) sets) or bigger nodes, and would
need a cap with a greedy fallback; this needs neither and stays exact. Ties go to the group
whose devices have the lowest bus ids, which keeps the answer deterministic and packs devices in bus order.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.placement.score import NodeValues
from agent.placement.tree import PcieTree


@dataclass
class _Table:
    low: int  # the smallest feasible count; values[i] is the best for count low + i
    values: list[int]
    # (child, child's low, child's offset per combined offset; None: the whole offset is the child's)
    steps: list[tuple[int, int, list[int] | None]]
    own_low: int


def best_counts(tree: PcieTree, size: int, *, own_low: dict[int, int], own_high: dict[int, int],
                values_of: NodeValues, searched: list[int]) -> dict[int, int] | None:
    """Chosen devices per node that hold them (`own_low` <= count <= `own_high`), summing to `size`.

    `searched` is the per-node subtree count of available devices: groups with none are fixed at zero and
    skipped. None when no placement meets the bounds.
    """
    tables: dict[int, _Table] = {}
    for index in range(len(tree.nodes) - 1, -1, -1):
        if not searched[index]:
            continue
        low = own_low.get(index, 0)
        values = [0] * (min(own_high.get(index, 0), size) - low + 1)
        if not values:
            return None
        steps: list[tuple[int, int, list[int] | None]] = []
        for child in tree.nodes[index].children:
            table = tables.get(child)
            if table is None:
                continue
            limit = size - low - table.low
            if len(values) == 1 and not values[0]:  # nothing chosen so far: the child's table as it is
                values, choice = table.values[: max(limit + 1, 0)], None
            else:
                values, choice = _combine(values, table.values, limit)
            if not values:
                return None
            steps.append((child, table.low, choice))
            low += table.low
        own = values_of(index, low, len(values))
        if own is not None:
            values = [total + value for total, value in zip(values, own, strict=True)]
        tables[index] = _Table(low, values, steps, own_low.get(index, 0))

    root = tables.get(0)
    if root is None or not root.low <= size < root.low + len(root.values):
        return None
    counts: dict[int, int] = {}
    _unwind(tables, 0, size, counts)
    return counts


def _combine(left: list[int], right: list[int], limit: int) -> tuple[list[int], list[int]]:
    """Max-plus convolution of two offset-indexed tables, truncated at offset `limit`.

    Returns the combined values and, per combined offset, the right table's offset. On ties the left
    (earlier, lower bus id) side keeps the larger share.
    """
    size = min(len(left) + len(right) - 1, limit + 1)
    if size <= 0:
        return [], []
    best: list[int | None] = [None] * size
    choice = [0] * size
    for i in range(len(left) - 1, -1, -1):
        a = left[i]
        for j in range(min(len(right), size - i)):
            total = a + right[j]
            current = best[i + j]
            if current is None or total > current:
                best[i + j] = total
                choice[i + j] = j
    return [v for v in best if v is not None], choice


def _unwind(tables: dict[int, _Table], index: int, count: int, counts: dict[int, int]) -> None:
    table = tables[index]
    offset = count - table.low
    for child, child_low, choice in reversed(table.steps):
        taken = offset if choice is None else choice[offset]
        _unwind(tables, child, child_low + taken, counts)
        offset -= taken
    own = table.own_low + offset
    if own:
        counts[index] = own
