"""What a layout migration writes into the new layout's fresh counters, so that the kernel holds the totals.

Why in the kernel: a count carried only in the agent's memory is gone at the next restart, and the exported sums
then drop, which Prometheus reads as a counter reset (and `increase()` over-counts). So the new layout's counters
are created holding the totals the agent exports at the migration, and a later restart, which sums the raw
kernel values, continues from exactly there.

The totals are split over the new objects: an exported node series (a rule key) over the families the new layout
counts, a pod's series (a counted-set role) over that pod's addresses in the new sets. Each new object keeps the
old raw value of its counterpart (same key and family, same set role, family and address) where the split allows,
and the rest goes to the first one; so per-address and per-family counters stay meaningful whenever the old raw
values add up to the totals (always, for a migration at start-up). Where they do not (the book carried counts of
its own, e.g. an address that moved to another pod) the totals still add up: the first object takes the total and
the others start from zero. A total with no object to hold it (a pod without addresses in the new families, a
family turned off) is not carried; its series keeps its value until the next restart.

Pure data, no I/O: identities are layout-neutral (family and rule key; set role, family and member), and each
layout names its own objects.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from agent.netacct import ipsets
from agent.netacct.counters import CounterBook, Counts, PodKey

SetId = tuple[str, int]  # counted-set role (rx-inet, ...), IP family


def rule_keys() -> list[str]:
    """Every node series as a layout-neutral key, e.g. `traffic=cluster-in scope=host` (each layout counts each
    key once per family)."""
    return [f"traffic={cls}-{way} scope={scope}" for cls in ("cluster", "internet") for way in ("in", "out")
            for scope in ("host", "pod")]


@dataclass
class Carry:
    """Initial values for the new layout's counters: per family and rule key, per set and member."""

    rules: dict[int, dict[str, Counts]] = field(default_factory=dict)
    elements: dict[SetId, dict[ipsets.Member, Counts]] = field(default_factory=dict)


@dataclass
class OldRaw:
    """The old layout's final raw values, as read under the engine's lock."""

    rules: dict[int, dict[str, Counts]] = field(default_factory=dict)
    elements: dict[SetId, dict[ipsets.Member, Counts]] = field(default_factory=dict)


def split(total: Counts, parts: list[Counts]) -> list[Counts]:
    """`parts` (non-empty) adjusted to add up to `total`, per component: each keeps its value where the others
    fit, the rest goes to the first; if even the others exceed the total, the first takes all of it."""
    out = [list(p) for p in parts]
    for c in (0, 1):
        rest = total[c] - sum(p[c] for p in parts[1:])
        if rest >= 0:
            out[0][c] = rest
        else:
            for i, part in enumerate(out):
                part[c] = total[c] if i == 0 else 0
    return [(p[0], p[1]) for p in out]


def plan(book: CounterBook, old: OldRaw, *, keys: list[str], families: tuple[int, ...],
         members: Mapping[int, set[ipsets.Member]], owners: Mapping[bytes, PodKey],
         rule_families: tuple[int, ...] | None = None) -> Carry:
    """The new layout's initial values for the totals `book` exports now: `keys` are the rule keys it counts in
    each of `families` (or only `rule_families` where the others cannot be preloaded), `members` the pod addresses
    it puts into its counted sets (owned per `owners`)."""
    rule_totals, pod_totals = book.rule_totals(), book.pod_totals()
    carry = Carry()
    holders = rule_families or families
    for key in keys:
        total = rule_totals.get(key, (0, 0))
        if total == (0, 0):
            continue
        values = split(total, [old.rules.get(f, {}).get(key, (0, 0)) for f in holders])
        for family, value in zip(holders, values, strict=True):
            if value != (0, 0):
                carry.rules.setdefault(family, {})[key] = value
    for role in ipsets.COUNTED:
        held: dict[PodKey, list[tuple[int, ipsets.Member]]] = {}
        for family in families:
            for member in sorted(members.get(family, set())):
                if (owner := owners.get(member[0])) is not None:
                    held.setdefault(owner, []).append((family, member))
        for pod, objects in held.items():
            total = pod_totals.get(pod, {}).get(role, (0, 0))
            if total == (0, 0):
                continue
            raws = [old.elements.get((role, f), {}).get(m, (0, 0)) for f, m in objects]
            for (family, member), value in zip(objects, split(total, raws), strict=True):
                if value != (0, 0):
                    carry.elements.setdefault((role, family), {})[member] = value
    return carry
