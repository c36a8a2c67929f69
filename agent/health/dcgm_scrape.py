"""dcgm-exporter's page read as GPU samples: which lines matter, which GPUs are this node's, and the parse.

An exporter page is mostly clocks, power and utilisation, and on a shared exporter mostly other nodes' GPUs: the
lines the agent reads are cut out while the page streams in (`keep_line`, `NodeLines.keep`, a name and label test
per line, no parsing), and only those are parsed (`parse_scrape`). The judging of what the samples mean is
`agent.health.dcgm`'s.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from agent.health import prom_text
from agent.host.busid import BusIdError, normalize_bus_id
from agent.topology.model import Topology

XID_TOTAL = "DCGM_EXP_XID_ERRORS_TOTAL"
XID_COUNT = "DCGM_EXP_XID_ERRORS_COUNT"
XID_LAST = "DCGM_FI_DEV_XID_ERRORS"
PCIE_REPLAY = "DCGM_FI_DEV_PCIE_REPLAY_COUNTER"

# Growth of these is an ECC finding of the kind named; an uncorrectable remapped row is an uncorrectable error.
ECC_COUNTERS = {
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": "sbe", "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL": "sbe",
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": "dbe", "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL": "dbe",
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": "dbe",
}
# Current-state fields, named like the NVML poll's `MemoryHealth` attributes they mirror.
FLAGS = {
    "DCGM_FI_DEV_ROW_REMAP_PENDING": "remap_pending",
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": "remap_failure",
    "DCGM_FI_DEV_RETIRED_PENDING": "retired_pages_pending",
}
NVLINK = re.compile(r"DCGM_FI_DEV_NVLINK_(CRC_FLIT|CRC_DATA|REPLAY|RECOVERY)_ERROR_COUNT_(TOTAL|L\d{1,2})")
_WANTED = frozenset({XID_TOTAL, XID_COUNT, XID_LAST, PCIE_REPLAY, *ECC_COUNTERS, *FLAGS})
_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*(?=[{\s])")
_UUID_LABELS = ("UUID", "uuid", "gpu_uuid")  # default, the exporter's old namespace, link metrics
_SERIES_LABELS = ("xid", "nvlink")  # labels that tell series of one GPU apart (besides the MIG instance)


class MalformedScrapeError(ValueError):
    """The exporter's answer is not Prometheus text the parser accepts."""


@dataclass(frozen=True)
class Sample:
    """One sample of a GPU metric: which GPU (as the exporter names it), which series, what value."""

    metric: str
    uuid: str
    bus_id: str  # canonical when it parses, the raw label otherwise
    instance: str  # MIG GPU_I_ID, "" for the whole GPU
    series: tuple[tuple[str, str], ...]  # the xid / nvlink labels
    value: float

    @property
    def identity(self) -> str:
        """How logs name the exporter's GPU."""
        return f"{self.uuid or '?'} ({self.bus_id or 'no bus id'})"


@dataclass(frozen=True)
class Scrape:
    """What one scrape showed: the metric names present (samples or not) and the GPU samples."""

    metrics: frozenset[str]
    samples: tuple[Sample, ...]




def wanted(metric: str) -> bool:
    """True for the metrics the interpreter reads."""
    return metric in _WANTED or NVLINK.fullmatch(metric) is not None


def keep_line(line: str) -> bool:
    """Whether a line of exporter text matters: a sample or HELP/TYPE line of a metric the agent reads.

    prometheus-client's parser costs about 30 µs a sample and an exporter page is mostly clocks, power and
    utilisation, so this cut (a name test per line, no parsing) makes a scrape several times cheaper; the HTTP
    port applies it while the page streams in, so the rest is never held. Lines that do not start with a metric
    name at all are kept, so an HTML error page still fails as malformed.
    """
    if line.startswith("#"):
        parts = line.split(None, 3)
        return len(parts) < 3 or parts[1] not in ("HELP", "TYPE") or wanted(parts[2])
    name = _METRIC_NAME.match(line)
    return name is None or wanted(name.group(0))


def relevant_lines(text: str, keep: Callable[[str], bool] = keep_line) -> str:
    """The lines `keep` keeps; everything else is dropped."""
    return "\n".join(line for line in text.splitlines() if keep(line)) + "\n"


# the value as an unrolled loop (runs of plain characters between escapes): the same strings as `(?:[^"\\]|\\.)*`
# at a third less time, and it runs on every sample line of every scrape (`NodeLines.keep`)
_LABELS = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"([^"\\]*(?:\\.[^"\\]*)*)"\s*,?')
MAX_FOREIGN = 4096  # foreign GPUs named per scrape (the `dcgm_unknown_gpus` gauge stops there)
MAX_LABEL_TEXTS = 4096  # distinct label texts whose GPU identity `NodeLines` remembers (a node: ~100)


def _identity(labels: str) -> tuple[str, str] | None:
    """(uuid, raw pci_bus_id) of a sample line's label text `{...}`; None when the line names no GPU or its
    labels cannot be read (kept: the parser then says what is wrong with it)."""
    found: dict[str, str] = {}
    pos = 1
    while pos < len(labels) and labels[pos] != "}":
        m = _LABELS.match(labels, pos)
        if m is None:
            return None
        found.setdefault(m.group(1), m.group(2))
        pos = m.end()
    uuid = next((found[k] for k in _UUID_LABELS if found.get(k)), "")
    return uuid, found.get("pci_bus_id", "")


class NodeLines:
    """Which lines of an exporter page to keep while it streams in: HELP/TYPE and samples of a metric the agent
    reads (`keep_line`) that are about one of this node's GPUs, matched as `DcgmInterpreter.match` does (UUID, or
    the bus id of a GPU whose UUID is unknown). A foreign GPU's samples are dropped line by line, before any
    parsing, and never held; only the names of at most MAX_FOREIGN foreign GPUs and a count of their samples are
    kept per scrape. Samples that name no GPU (NVSwitch, CPU) are dropped too: the parser skips them anyway.

    `start()` begins a scrape; `keep` is applied by the HTTP port as bytes arrive (`parse_scrape` applies it
    itself for a port that does not filter)."""

    def __init__(self, topology: Topology) -> None:
        self.update_topology(topology)
        self.start()

    def update_topology(self, topology: Topology) -> None:
        """Match against a rescanned topology from the next scrape on."""
        self._identities: dict[str, tuple[str, str] | None] = {}
        self._uuids = frozenset(g.uuid for g in topology.gpus if g.uuid)
        self._buses = frozenset(g.bus_id for g in topology.gpus if not g.uuid)

    def start(self) -> None:
        """A new scrape: forget the last one's foreign GPUs."""
        self.foreign: set[str] = set()  # identities as `Sample.identity` writes them, at most MAX_FOREIGN
        self.foreign_samples = 0
        self._seen: set[tuple[str, str]] = set()

    def keep(self, line: str) -> bool:
        """Whether `line` is kept (see the class docstring)."""
        if not keep_line(line):
            return False
        if line.startswith("#"):
            return True
        name = _METRIC_NAME.match(line)
        if name is None or line[name.end():name.end() + 1] != "{":
            return True  # no labels: the parser decides (a sample without a GPU is skipped there)
        # An exporter repeats one label text per GPU (and per MIG instance) across all its fields, so the
        # identity of a label text is remembered: a scrape scans each distinct text once, not every line. The key
        # ends at the line's last `}`, at or after the labels' own end, so it holds all that `_identity` reads.
        labels = line[name.end():line.rfind("}") + 1]
        if labels in self._identities:
            ident = self._identities[labels]
        else:
            ident = _identity(labels)
            if len(self._identities) >= MAX_LABEL_TEXTS:
                self._identities.clear()  # a page of ever-new label texts: bounded, not grown
            self._identities[labels] = ident
        if ident is None:
            return True
        uuid, bus = ident
        if not uuid and not bus:
            return False
        if uuid in self._uuids or (self._buses and bus and _canonical(bus) in self._buses):
            return True
        self.foreign_samples += 1
        if len(self._seen) < 2 * MAX_FOREIGN and ident not in self._seen:
            self._seen.add(ident)
            if len(self.foreign) < MAX_FOREIGN:
                self.foreign.add(f"{uuid or '?'} ({_canonical(bus) if bus else 'no bus id'})")
        return False


def parse_scrape(text: str, keep: Callable[[str], bool] | None = keep_line) -> Scrape:
    """Prometheus text -> GPU samples of the lines `keep` keeps (None: every line, already filtered) (`prom_text`:
    a fast path for plain lines, prometheus-client for the rest); MalformedScrapeError when it is not Prometheus
    text."""
    if text and not text.endswith("\n"):
        raise MalformedScrapeError("not Prometheus text (the answer ends mid-line: cut short)")
    metrics: set[str] = set()
    samples: list[Sample] = []
    try:
        for name, labels, value in prom_text.samples(text if keep is None else relevant_lines(text, keep)):
            metrics.add(name)
            uuid = next((labels[k] for k in _UUID_LABELS if labels.get(k)), "")
            raw_bus = labels.get("pci_bus_id", "")
            if not uuid and not raw_bus:
                continue  # NVSwitch, CPU and other non-GPU entities
            if math.isnan(value) or value < 0:
                continue  # a blank DCGM value: no information, not zero
            samples.append(Sample(name, uuid, _canonical(raw_bus), labels.get("GPU_I_ID", ""),
                                  tuple((k, labels[k]) for k in _SERIES_LABELS if k in labels), value))
    except Exception as exc:  # the parser raises ValueError, IndexError, KeyError... on bad text
        raise MalformedScrapeError(f"not Prometheus text ({type(exc).__name__}: {exc})") from exc
    return Scrape(frozenset(metrics), tuple(samples))


def _canonical(bus_id: str) -> str:
    try:
        return normalize_bus_id(bus_id) if bus_id else ""
    except BusIdError:
        return bus_id
