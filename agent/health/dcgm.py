"""dcgm-exporter's metrics as health observations: parse one scrape, compare it with the last, say what changed.

Almost everything dcgm-exporter shows is a count since some moment the agent did not choose (exporter start, GPU
reset, the GPU's life), so the interpreter judges change, never level:

- Xids come from `DCGM_EXP_XID_ERRORS_TOTAL` (a counter per GPU and Xid code since the exporter started: exact)
  when the scrape has it, else from `DCGM_EXP_XID_ERRORS_COUNT` (occurrences within a sliding window: its rise is
  the new Xids; ones that age out while as many new ones arrive between two scrapes are missed), else from the
  stock `DCGM_FI_DEV_XID_ERRORS` gauge, which holds only the *last* Xid's code: a changed value is one Xid of the
  new code. Two Xids between scrapes look like one, and the same code again looks like none - which is why the
  kernel log and NVML events stay the primary Xid sources and DCGM confirms or fills gaps.
- ECC counters and uncorrectable remapped rows: any growth is the same finding an NVML poll would raise.
- Row-remap pending/failure and retired-pages-pending are current state, judged as they stand.
- NVLink CRC/replay/recovery and PCIe replay counters: the increase per minute between two scrapes against a
  threshold; lifetime totals (which only a GPU reset zeroes) are never judged.
- The first good scrape is a baseline: counts from before the agent looked are history, not news (the kernel
  log's persisted cursor covers what happened while the agent was down). State flags are judged at once.

GPUs are matched by UUID against this node's topology. A bus id alone matches only a topology GPU whose UUID is
unknown, because bus ids repeat across nodes: an exporter URL that reaches another node must never fault this
node's GPUs. Series that match no GPU here are reported as unknown, not acted on.

Pure: text and a monotonic time in, a `Reading` out; reading the page into samples lives in
`agent.health.dcgm_scrape` (its names are importable from here too), the scraping loop in `agent.health.dcgm_watch`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from agent.health.dcgm_scrape import (
    ECC_COUNTERS,
    FLAGS,
    MAX_FOREIGN,
    MAX_LABEL_TEXTS,
    NVLINK,
    PCIE_REPLAY,
    XID_COUNT,
    XID_LAST,
    XID_TOTAL,
    MalformedScrapeError,
    NodeLines,
    Sample,
    Scrape,
    keep_line,
    parse_scrape,
    relevant_lines,
    wanted,
)
from agent.topology.model import Gpu, Topology

__all__ = ["ECC_COUNTERS", "FLAGS", "MAX_FOREIGN", "MAX_LABEL_TEXTS", "MAX_SERIES", "PCIE_REPLAY", "XID_COUNT",
           "XID_LAST", "XID_TOTAL", "DcgmInterpreter", "Flag", "Growth", "MalformedScrapeError", "NodeLines", "Reading",
           "Sample", "Scrape", "XidSeen", "keep_line", "parse_scrape", "relevant_lines", "wanted"]

_CREDIT_SECONDS = 300.0  # how long a gauge-seen Xid waits to be matched by the counted metric's first report
MAX_SERIES = 50_000  # series whose last value is kept; past it only the last scrape's are (a real node: ~2,000)


@dataclass(frozen=True)
class XidSeen:
    """`count` new Xids of `code` on `gpu`, as `metric` showed them."""

    gpu: Gpu
    code: int
    count: int
    metric: str
    gpu_instance: int | None = None


@dataclass(frozen=True)
class Growth:
    """A counter of `gpu` grew: kind `sbe`/`dbe` (any growth) or `nvlink`/`pcie_replay` (over the threshold)."""

    gpu: Gpu
    kind: str
    increase: float
    detail: str


@dataclass(frozen=True)
class Flag:
    """A current-state field of `gpu` (`remap_pending`, `remap_failure`, `retired_pages_pending`)."""

    gpu: Gpu
    name: str
    active: bool


@dataclass
class Reading:
    """What changed since the last good scrape."""

    xids: list[XidSeen] = field(default_factory=list)
    growth: list[Growth] = field(default_factory=list)
    flags: list[Flag] = field(default_factory=list)
    unknown: set[str] = field(default_factory=set)  # exporter GPUs that are not this node's
    matched: set[int] = field(default_factory=set)  # indexes of this node's GPUs the scrape covered
    xid_metric: str = ""  # where this scrape's Xids were read from
    baseline: bool = False  # the first good scrape: counts were recorded, not judged


class DcgmInterpreter:
    """Keeps the previous values of every series and turns each new scrape into a `Reading`."""

    def __init__(self, topology: Topology, nvlink_errors_per_minute: float = 0.0,
                 pcie_replays_per_minute: float = 8.0) -> None:
        self.nvlink_errors_per_minute = nvlink_errors_per_minute
        self.pcie_replays_per_minute = pcie_replays_per_minute
        self._last: dict[tuple[str, str, str, tuple[tuple[str, str], ...]], float] = {}
        self._last_time: float | None = None
        self._gauge_credit: dict[tuple[str, int], float] = {}  # (GPU bus id, code) -> when the gauge showed it
        self._restored = False  # Xid totals from before an agent restart: judged at the first scrape too
        self.update_topology(topology)

    def xid_totals(self) -> dict[str, float] | None:
        """The exporter's Xid totals as last scraped (`bus id|instance|code` -> value); None before a scrape."""
        if self._last_time is None and not self._restored:
            return None
        return {f"{bus}|{instance}|{dict(series).get('xid', '')}": value
                for (metric, bus, instance, series), value in self._last.items() if metric == XID_TOTAL}

    def restore_xid_totals(self, totals: dict[str, float]) -> None:
        """Totals saved before an agent restart (same boot): the first scrape counts what grew since then."""
        for key, value in totals.items():
            bus, _, rest = key.partition("|")
            instance, _, code = rest.partition("|")
            if code.isdigit():
                self._last[(XID_TOTAL, bus, instance, (("xid", code),))] = value
        self._restored = True

    def update_topology(self, topology: Topology) -> None:
        """Match against a rescanned topology from now on."""
        self._by_uuid = {g.uuid: g for g in topology.gpus if g.uuid}
        self._by_bus = {g.bus_id: g for g in topology.gpus}

    def match(self, sample: Sample) -> Gpu | None:
        """This node's GPU the sample is about, or None (see the module docstring for the rules)."""
        if sample.uuid and sample.uuid in self._by_uuid:
            return self._by_uuid[sample.uuid]
        gpu = self._by_bus.get(sample.bus_id)
        return gpu if gpu is not None and not gpu.uuid else None

    def read(self, scrape: Scrape, now: float) -> Reading:
        """Compare `scrape` (taken at monotonic `now`) with the previous one."""
        reading = Reading(baseline=self._last_time is None)
        elapsed = now - self._last_time if self._last_time is not None else 0.0
        reading.xid_metric = XID_TOTAL if XID_TOTAL in scrape.metrics else \
            XID_COUNT if XID_COUNT in scrape.metrics else XID_LAST
        counted: dict[tuple[Gpu, str, int, str], float] = {}  # (GPU, metric, code, instance) -> new Xids
        # A MIG GPU shows device-level fields once per instance: the same count, so instances are merged with max.
        nvlink: dict[Gpu, dict[str, float]] = {}
        pcie: dict[Gpu, float] = {}
        ecc: dict[tuple[Gpu, str], tuple[float, str]] = {}
        flags: dict[tuple[Gpu, str], bool] = {}
        keys: list[tuple[str, str, str, tuple[tuple[str, str], ...]]] = []
        for sample in scrape.samples:
            gpu = self.match(sample)
            if gpu is None:
                reading.unknown.add(sample.identity)
                continue
            reading.matched.add(gpu.index)
            key = (sample.metric, gpu.bus_id, sample.instance, sample.series)
            keys.append(key)
            before = self._last.get(key)
            self._last[key] = sample.value
            if sample.metric in (XID_TOTAL, XID_COUNT):
                code = _xid_label(sample)
                if code is not None:
                    grew = _xid_increase(sample.metric, before, sample.value)
                    slot = (gpu, sample.metric, code, sample.instance)
                    counted[slot] = counted.get(slot, 0.0) + grew
            elif sample.metric == XID_LAST:
                code = int(sample.value)
                if code and before != sample.value and (before is not None or not reading.baseline):
                    counted[(gpu, XID_LAST, code, sample.instance)] = 1.0
            elif sample.metric in FLAGS:
                slot_flag = (gpu, FLAGS[sample.metric])
                flags[slot_flag] = flags.get(slot_flag, False) or sample.value > 0
            else:
                grew = _counter_increase(before, sample.value)
                if sample.metric in ECC_COUNTERS:
                    slot_ecc = (gpu, ECC_COUNTERS[sample.metric])
                    if grew > ecc.get(slot_ecc, (0.0, ""))[0]:
                        ecc[slot_ecc] = (grew, f"{sample.metric} +{grew:g}")
                elif (lane := NVLINK.fullmatch(sample.metric)) is not None:
                    kinds = nvlink.setdefault(gpu, {})
                    kind = _nvlink_key(lane, sample)
                    kinds[kind] = max(kinds.get(kind, 0.0), grew)
                elif sample.metric == PCIE_REPLAY:
                    pcie[gpu] = max(pcie.get(gpu, 0.0), grew)
        reading.flags = [Flag(gpu, name, active) for (gpu, name), active in flags.items()]
        if not reading.baseline:
            reading.growth = [Growth(gpu, kind, grew, detail) for (gpu, kind), (grew, detail) in ecc.items()]
            self._rates(reading, nvlink, pcie, elapsed)
        self._finish(reading, counted, now, keys)
        return reading

    def _finish(self, reading: Reading, counted: dict[tuple[Gpu, str, int, str], float], now: float,
                keys: list[tuple[str, str, str, tuple[tuple[str, str], ...]]]) -> None:
        if len(self._last) > MAX_SERIES:  # ever new series (a hostile exporter): forget all but this scrape's
            self._last = {k: self._last[k] for k in keys}
        # Xid totals saved before an agent restart are exact: what grew since is news even at the first scrape.
        if not reading.baseline or (self._restored and reading.xid_metric == XID_TOTAL):
            self._xids(reading, counted, now)
        self._restored = False
        self._last_time = now

    def _xids(self, reading: Reading, counted: dict[tuple[Gpu, str, int, str], float], now: float) -> None:
        self._gauge_credit = {k: t for k, t in self._gauge_credit.items() if now - t < _CREDIT_SECONDS}
        for (gpu, metric, code, instance), grew in sorted(counted.items(), key=lambda kv: (kv[0][0].index,
                                                                                             kv[0][2])):
            if metric != reading.xid_metric or grew <= 0:
                continue
            count = int(grew)
            if metric == XID_LAST:
                self._gauge_credit[(gpu.bus_id, code)] = now
            elif self._gauge_credit.pop((gpu.bus_id, code), None) is not None:
                count -= 1  # the gauge already reported this one while the counted metric had no series yet
            if count > 0:
                reading.xids.append(XidSeen(gpu, code, count, metric, int(instance) if instance.isdigit() else None))

    def _rates(self, reading: Reading, nvlink: dict[Gpu, dict[str, float]], pcie: dict[Gpu, float],
               elapsed: float) -> None:
        minutes = max(elapsed, 1.0) / 60.0
        for gpu, kinds in nvlink.items():
            # Per-lane counters and their _TOTAL say the same thing: judge the totals where the scrape has them.
            totals = {k: v for k, v in kinds.items() if ":total" in k}
            chosen = totals or kinds
            grew = sum(chosen.values())
            if grew > 0 and grew / minutes > self.nvlink_errors_per_minute:
                parts = ", ".join(f"+{v:g} {k.split(':')[0].lower()}" for k, v in sorted(chosen.items()) if v)
                reading.growth.append(Growth(gpu, "nvlink", grew, f"{parts} in {elapsed:.0f} s"))
        for gpu, grew in pcie.items():
            if grew > 0 and grew / minutes > self.pcie_replays_per_minute:
                reading.growth.append(Growth(gpu, "pcie_replay", grew, f"+{grew:g} PCIe replays in {elapsed:.0f} s"))


def _xid_label(sample: Sample) -> int | None:
    text = dict(sample.series).get("xid", "")
    return int(text) if text.isdigit() and int(text) > 0 else None


def _xid_increase(metric: str, before: float | None, value: float) -> float:
    """New Xids: a series that appears counts from zero (it exists only once its GPU had that Xid)."""
    if before is None:
        return value
    if value < before:  # the total restarts with the exporter; a window count falls as Xids age out
        return value if metric == XID_TOTAL else 0.0
    return value - before


def _counter_increase(before: float | None, value: float) -> float:
    """Growth of a hardware counter; a new series or a fall (GPU reset, driver reload) is a new baseline."""
    return 0.0 if before is None or value < before else value - before


def _nvlink_key(lane: re.Match[str], sample: Sample) -> str:
    """`REPLAY:total`, or `REPLAY:L3` / `REPLAY:L3/link 3` for per-lane counters."""
    where = "total" if lane.group(2) == "TOTAL" else lane.group(2)
    link = dict(sample.series).get("nvlink", "")
    return f"{lane.group(1)}:{where}" + (f"/link {link}" if link else "")
