"""Monotonic counters from kernel counters that can restart: delta accumulation per stable identity.

Kernel counters restart when a rule is rewritten or a set element is re-created, and Prometheus reads any decrease
of an exported (summed) counter as a reset of the whole sum. So this book keeps, per stable identity, the last raw
value it saw and an accumulated total, and only ever adds deltas (reference netacct.md §7.4):

- rules are identified by (source, key): the source is the IP family for the iptables layout's rules (4) and
  `nft4`/`nft6` for the native layout's named counters, the key e.g. "traffic=internet-in scope=host". Both
  layouts add into the same totals per key, so a migration carries the old layout's final counts (the old
  source is forgotten once its objects are gone);
- set elements by (set name, member), and each element belongs to the pod that owns its address; its deltas go to
  that pod's totals, so an address that moves to another pod starts counting for the new pod from that moment.
  An element nobody owns yet (after a restart, before the pod list arrives) keeps its raw value for its first
  owner, so per-pod totals continue across agent restarts too.

A raw value below the last one means the kernel counter restarted, and the raw value is all new traffic. A rule the
engine rewrites is marked so that its next value counts from zero. The first sight of an identity counts from zero
too, so after an agent restart the totals continue from the kernel's counters instead of dropping. A layout
migration creates the new layout's counters holding the exported totals (carry) and says so, so that their first
sight adds nothing. Pure data, no I/O: the engine feeds it under its lock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from agent.netacct import ipsets

PodKey = tuple[str, str]  # namespace, name
Source = int | str  # an IP family (iptables layout) or "nft4" / "nft6" (native layout)
Counts = tuple[int, int]  # packets, bytes


def _delta(raw: Counts, last: Counts) -> Counts:
    if raw[0] < last[0] or raw[1] < last[1]:
        return raw
    return raw[0] - last[0], raw[1] - last[1]


@dataclass
class _Element:
    owner: PodKey | None
    last: Counts = (0, 0)


@dataclass
class CounterBook:
    """Accumulated packets/bytes per rule key (summed over families) and per pod and set role."""

    _rule_last: dict[tuple[Source, str], Counts] = field(default_factory=dict)
    _rule_total: dict[str, Counts] = field(default_factory=dict)
    _elements: dict[str, dict[ipsets.Member, _Element]] = field(default_factory=dict)
    _owners: dict[bytes, PodKey] = field(default_factory=dict)
    _pod_total: dict[PodKey, dict[str, Counts]] = field(default_factory=dict)
    # The last raw values of rules and owned elements that disappeared from the kernel without the engine removing
    # them (someone else did): a repair re-creates them holding these, so the kernel keeps the totals.
    _vanished_rules: dict[tuple[Source, str], Counts] = field(default_factory=dict)
    _vanished_elements: dict[str, dict[ipsets.Member, Counts]] = field(default_factory=dict)

    # -- feeding ------------------------------------------------------------------------------------------------

    def observe_rules(self, family: Source, raw: Mapping[str, Counts]) -> None:
        """A complete read of one source's rule counters (keys missing now are forgotten)."""
        for key, value in raw.items():
            last = self._rule_last.get((family, key), (0, 0))
            delta = _delta(value, last)
            total = self._rule_total.get(key, (0, 0))
            self._rule_total[key] = (total[0] + delta[0], total[1] + delta[1])
        for gone in [k for k in self._rule_last if k[0] == family and k[1] not in raw]:
            if (last := self._rule_last.pop(gone)) != (0, 0):
                self._vanished_rules[gone] = last
        self._rule_last.update(((family, key), value) for key, value in raw.items())

    def observe_set(self, name: str, role: str, raw: Mapping[ipsets.Member, Counts]) -> None:
        """A complete dump of one counted set; deltas go to each element's owning pod."""
        old = self._elements.get(name, {})
        new: dict[ipsets.Member, _Element] = {}
        for member, value in raw.items():
            element = old.get(member) or _Element(self._owners.get(member[0]))
            new[member] = element
            if element.owner is None or element.owner not in self._pod_total:
                continue  # unowned (pods not known yet): its traffic goes to whoever owns it first
            delta = _delta(value, element.last)
            element.last = value
            totals = self._pod_total[element.owner]
            total = totals.get(role, (0, 0))
            totals[role] = (total[0] + delta[0], total[1] + delta[1])
        for member, element in old.items():
            if member not in new and element.owner is not None and element.last != (0, 0):
                self._vanished_elements.setdefault(name, {})[member] = element.last
        self._elements[name] = new

    def take_vanished(self) -> tuple[dict[tuple[Source, str], Counts], dict[str, dict[ipsets.Member, Counts]]]:
        """The last raw values of rules and elements someone else removed since the last call (then forgotten)."""
        rules, elements = self._vanished_rules, self._vanished_elements
        self._vanished_rules, self._vanished_elements = {}, {}
        return rules, elements

    @property
    def owners(self) -> dict[bytes, PodKey]:
        """The current address owners."""
        return dict(self._owners)

    def rules_restarted(self, family: Source, keys: Iterable[str]) -> None:
        """These rules were just re-created: their next raw value is all new traffic."""
        for key in keys:
            self._rule_last[(family, key)] = (0, 0)

    def rules_created_with(self, source: Source, raw: Mapping[str, Counts]) -> None:
        """These rules were just created holding `raw` (a migration's carry, already in the totals): their next
        value counts from there, so the carried part is neither added again nor lost."""
        for key, value in raw.items():
            self._rule_last[(source, key)] = value

    def elements_created_with(self, name: str, raw: Mapping[ipsets.Member, Counts]) -> None:
        """These elements of set `name` were just created holding `raw` (a migration's carry): as for rules."""
        elements = self._elements.setdefault(name, {})
        for member, value in raw.items():
            elements[member] = _Element(self._owners.get(member[0]), value)

    def kernel_state_lost(self) -> None:
        """Every rule and set was re-created (cleanup then install): forget raw values, keep totals."""
        self._rule_last.clear()
        self._elements.clear()
        self.take_vanished()

    def forget(self, sources: Iterable[Source], set_names: Iterable[str]) -> None:
        """These rule sources and sets are gone (a layout removed or re-created): their next sight, if any, is new
        traffic. Totals are kept."""
        gone = set(sources)
        for key in [k for k in self._rule_last if k[0] in gone]:
            del self._rule_last[key]
        for key in [k for k in self._vanished_rules if k[0] in gone]:
            del self._vanished_rules[key]
        for name in set_names:
            self._elements.pop(name, None)
            self._vanished_elements.pop(name, None)

    def set_pods(self, owners: Mapping[bytes, PodKey]) -> None:
        """The current pods, as address owners; departed pods lose their totals, moved addresses change owner."""
        self._owners = dict(owners)
        live = set(owners.values())
        for pod in live - set(self._pod_total):
            self._pod_total[pod] = {}
        for pod in set(self._pod_total) - live:
            del self._pod_total[pod]
        for elements in self._elements.values():
            for member, element in elements.items():
                element.owner = self._owners.get(member[0])

    # -- reading ------------------------------------------------------------------------------------------------

    def rule_totals(self) -> dict[str, Counts]:
        """Accumulated (packets, bytes) per rule key, summed over IPv4 and IPv6."""
        return dict(self._rule_total)

    def pod_totals(self) -> dict[PodKey, dict[str, Counts]]:
        """Accumulated (packets, bytes) per current pod and counted-set role (rx-inet, tx-clus, ...)."""
        return {pod: dict(roles) for pod, roles in self._pod_total.items()}
