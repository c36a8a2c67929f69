"""Judge one pass of NIC port counters, PCIe link widths and AER counters: by increase, never by level.

Most IB error counters are 4/8/16-bit and saturate, and history from before the agent is not a fault, so every
rule looks at what changed between two passes (node-health-checks.md §1.3, §2):

- any increase of `link_downed` (nic_link_downed), `local_link_integrity_errors` or
  `excessive_buffer_overrun_errors` (nic_link_errors);
- `symbol_error` increase over the last hour above a rate (nic_symbol_errors, default 120/h);
- `port_rcv_errors` per second between two passes above a rate (nic_rcv_errors);
- `link_error_recovery` increases plus observed down->up cycles within a minute at a rate (nic_link_flapping);
- a port down longer than the outage threshold, even once it is back (nic_link_outage); every down->up cycle is
  counted with its downtime;
- an ACTIVE port slower than the fastest ACTIVE port of the same link layer (nic_low_rate);
- `current_link_width` below `max_link_width` (pcie_downtrained; speed alone is not judged: idle GPUs slow
  their links to save power);
- an increase of `aer_dev_fatal` / `aer_dev_nonfatal` TOTAL (pcie_aer_fatal / pcie_aer_nonfatal).

A counter lower than before was reset (driver reload, `perfquery -R`): it becomes the new baseline. `restore`
takes the values an earlier agent saved in the same boot, so increases while it was down are judged once.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from agent.host.nic_sysfs import CounterPass, PcieLink, PortReading

_HOUR, _MINUTE = 3600.0, 60.0


@dataclass(frozen=True)
class Thresholds:
    """The rates the rules use (HealthConfig's nic_* settings)."""

    symbol_errors_per_hour: float = 120.0
    flaps_per_minute: float = 5.0
    rcv_errors_per_second: float = 10.0
    outage_seconds: float = 30.0


@dataclass(frozen=True)
class Observation:
    """A condition seen in this pass. `subject`: "mlx5_0/1" for a port, a bus id for a PCI function."""

    check: str
    subject: str
    reason: str
    code: str
    hardware: bool = True


@dataclass
class _Window:
    """Increases with their time, summed over a sliding window."""

    span: float
    items: deque[tuple[float, int]] = field(default_factory=deque)

    def add(self, now: float, amount: int) -> int:
        if amount > 0:
            self.items.append((now, amount))
        while self.items and self.items[0][0] <= now - self.span:
            self.items.popleft()
        return sum(n for _, n in self.items)


@dataclass
class _PortState:
    counters: dict[str, int] = field(default_factory=dict)
    at: float | None = None
    down_since: float | None = None
    symbol: _Window = field(default_factory=lambda: _Window(_HOUR))
    flaps: _Window = field(default_factory=lambda: _Window(_MINUTE))


@dataclass(frozen=True)
class Flap:
    """One observed down->up cycle of a port."""

    subject: str
    downtime: float


class CounterJudge:
    """Keeps the last values per port and function; `judge` turns a new pass into observations."""

    def __init__(self, thresholds: Thresholds) -> None:
        self.t = thresholds
        self.ports: dict[str, _PortState] = {}
        self.aer: dict[str, dict[str, int]] = {}
        self.flap_totals: dict[str, int] = {}  # "mlx5_0/1" -> down->up cycles seen since the agent started
        self.last_flaps: list[Flap] = []
        self.latest = CounterPass()

    def restore(self, ports: dict[str, dict[str, int]], aer: dict[str, dict[str, int]], at: float) -> None:
        """Values saved earlier in this boot (at monotonic time `at`): the next pass judges what grew since."""
        for subject, counters in ports.items():
            self.ports[subject] = _PortState(dict(counters), at)
        self.aer = {bus: dict(kinds) for bus, kinds in aer.items()}

    def saved(self) -> tuple[dict[str, dict[str, int]], dict[str, dict[str, int]]]:
        """What to persist: port counters and AER totals as last read."""
        return {s: dict(p.counters) for s, p in self.ports.items() if p.counters}, \
            {b: dict(k) for b, k in self.aer.items()}

    def judge(self, reading: CounterPass, now: float) -> list[Observation]:
        """Observations of this pass (the caller holds findings for the hold time)."""
        self.latest = reading
        self.last_flaps = []
        found: list[Observation] = []
        for port in reading.ports:
            found += self._port(port, now)
        found += self._rates(reading.ports)
        for link in reading.links:
            found += _link(link)
        for bus_id, counts in reading.aer.items():
            found += self._aer(bus_id, counts)
        return found

    def _port(self, port: PortReading, now: float) -> list[Observation]:
        subject = f"{port.device}/{port.port}"
        state = self.ports.setdefault(subject, _PortState())
        before, elapsed = state.counters, (now - state.at) if state.at is not None else None
        grew = {name: value - before[name] for name, value in port.counters.items()
                if name in before and value > before[name]}
        state.counters, state.at = dict(port.counters), now  # lower than before = reset: the new baseline
        found: list[Observation] = []
        name = f"{port.device} port {port.port}"
        if grew.get("link_downed"):
            found.append(Observation("nic_link_downed", subject, f"{name} link went down {grew['link_downed']} "
                                     "time(s) (link_downed grew)", "NicLinkDowned"))
        errors = {k: v for k, v in grew.items() if k in ("local_link_integrity_errors",
                                                         "excessive_buffer_overrun_errors")}
        if errors:
            found.append(Observation("nic_link_errors", subject, f"{name} link errors: " + ", ".join(
                f"{k} +{v}" for k, v in sorted(errors.items())), "NicLinkErrors"))
        symbols = state.symbol.add(now, grew.get("symbol_error", 0))
        if symbols > self.t.symbol_errors_per_hour:
            found.append(Observation("nic_symbol_errors", subject, f"{name} symbol errors: {symbols} in the last "
                                     f"hour (over {self.t.symbol_errors_per_hour:g})", "NicSymbolErrors"))
        rcv = grew.get("port_rcv_errors", 0)
        if rcv and elapsed and rcv / elapsed > self.t.rcv_errors_per_second:
            found.append(Observation("nic_rcv_errors", subject, f"{name} receive error storm: {rcv / elapsed:.1f}/s "
                                     f"(over {self.t.rcv_errors_per_second:g}/s)", "NicRcvErrors"))
        cycles = 0
        if port.state != "ACTIVE":
            if state.down_since is None:
                state.down_since = now
            down_for = now - state.down_since
            if down_for >= self.t.outage_seconds:
                found.append(Observation("nic_link_outage", subject, f"{name} down for {down_for:.0f} s "
                                         f"({port.state or '?'}, {port.phys_state or '?'})", "NicLinkOutage"))
        elif state.down_since is not None:
            downtime, state.down_since = now - state.down_since, None
            cycles = 1
            self.flap_totals[subject] = self.flap_totals.get(subject, 0) + 1
            self.last_flaps.append(Flap(subject, downtime))
            if downtime >= self.t.outage_seconds:
                found.append(Observation("nic_link_outage", subject, f"{name} was down for {downtime:.0f} s",
                                         "NicLinkOutage"))
        flaps = state.flaps.add(now, grew.get("link_error_recovery", 0) + cycles)
        if flaps >= self.t.flaps_per_minute:
            found.append(Observation("nic_link_flapping", subject, f"{name} flapping: {flaps} link recoveries "
                                     "or down/up cycles in the last minute", "NicLinkFlapping"))
        return found

    @staticmethod
    def _rates(ports: tuple[PortReading, ...]) -> list[Observation]:
        best: dict[str, float] = {}
        for p in ports:
            if p.state == "ACTIVE" and p.rate_gbps:
                best[p.link_layer] = max(best.get(p.link_layer, 0.0), p.rate_gbps)
        return [Observation("nic_low_rate", f"{p.device}/{p.port}", f"{p.device} port {p.port} at {p.rate_gbps:g} "
                            f"Gb/s, its peers at {best[p.link_layer]:g} Gb/s", "NicLowRate")
                for p in ports if p.state == "ACTIVE" and p.rate_gbps and p.rate_gbps < best[p.link_layer]]

    def _aer(self, bus_id: str, counts: dict[str, int]) -> list[Observation]:
        before = self.aer.get(bus_id)
        self.aer[bus_id] = dict(counts)
        if before is None:
            return []
        found: list[Observation] = []
        for kind, check, code in (("fatal", "pcie_aer_fatal", "PcieAerFatal"),
                                  ("nonfatal", "pcie_aer_nonfatal", "PcieAerNonFatal")):
            if kind in counts and kind in before and counts[kind] > before[kind]:
                found.append(Observation(check, bus_id, f"PCIe AER {kind} errors on {bus_id}: "
                                         f"+{counts[kind] - before[kind]}", code))
        return found


def _link(link: PcieLink) -> list[Observation]:
    if link.max_width is None or link.current_width is None or link.current_width >= link.max_width:
        return []
    what = "no link" if link.current_width == 0 else f"x{link.current_width} of x{link.max_width}"
    return [Observation("pcie_downtrained", link.bus_id, f"PCIe link of {link.bus_id} downtrained: {what}",
                        "PcieLinkDowntrained")]
