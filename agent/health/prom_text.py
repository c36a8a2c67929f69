"""Samples of Prometheus text exposition: a fast path for the plain lines exporters write, prometheus-client for
everything else.

Why: prometheus-client's text parser costs about 30 µs a sample (it walks each line character by character to
allow quoted names, escapes, exemplars and timestamps), which was most of a dcgm-exporter scrape (8 GPUs, 150
kept lines: 4.5 ms of 9.6). dcgm-exporter writes none of those: `name{label="value",...} value` lines and
`# HELP` / `# TYPE` comments. `fast_samples` reads exactly that subset with two regular expressions and gives up
(None) on anything else - a backslash in a label value, a quote in a comment's name, a timestamp, an exemplar, a
`__name__` label, a repeated label, a value prometheus-client would refuse - so `samples` then asks prometheus-
client, whose answer (or error) stands. Family names follow prometheus-client's text parser exactly (a sample
belongs to the family a preceding HELP/TYPE named when its name is one the type allows; a counter family named
`x_total` is called `x`; any other sample is an untyped family of its own), and
`tests/health/test_prom_text.py` holds both paths to the same answers.
"""

from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families

Sample = tuple[str, dict[str, str], float]  # family name, labels, value

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_SAMPLE = re.compile(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{((?:[^"}]|"[^"]*")*)\})?[ \t]+([^ \t]+)')
_LABEL = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"([^"\\]*)"[ \t]*(?:,|$)')
_SUFFIXES = {"summary": ("_count", "_sum", ""), "histogram": ("_count", "_sum", "_bucket")}


class _Unsupported(Exception):
    """A line outside the plain subset: prometheus-client decides."""


def samples(text: str) -> list[Sample]:
    """Every sample of `text` with its family name; ValueError (or another parser error) on bad text."""
    fast = fast_samples(text)
    if fast is not None:
        return fast
    return [(family.name, sample.labels, float(sample.value))
            for family in text_string_to_metric_families(text) for sample in family.samples]


def fast_samples(text: str) -> list[Sample] | None:
    """The samples when every line is in the plain subset, else None."""
    try:
        return _Reader().read(text)
    except _Unsupported:
        return None


class _Reader:
    """prometheus-client's family bookkeeping (`text_fd_to_metric_families`), over the plain subset only."""

    def __init__(self) -> None:
        self.out: list[Sample] = []
        self.name = ""
        self.typ = "untyped"
        self.allowed: tuple[str, ...] = ()
        self.pending: list[tuple[dict[str, str], float]] = []

    def read(self, text: str) -> list[Sample]:
        for raw in text.split("\n"):
            line = raw.strip()
            if not line:
                continue
            if line[0] == "#":
                self._comment(line)
            else:
                self._sample(line)
        self._build()
        return self.out

    def _build(self) -> None:
        if self.name:
            family = self.name[:-6] if self.typ == "counter" and self.name.endswith("_total") else self.name
            self.out.extend((family, labels, value) for labels, value in self.pending)

    def _start(self, name: str) -> None:
        self._build()
        self.name, self.pending = name, []

    def _comment(self, line: str) -> None:
        parts = line.split(None, 3)
        if len(parts) < 2 or (len(parts) > 2 and parts[1] not in ("TYPE", "HELP")):
            return  # a plain comment
        if len(parts) == 2 or '"' in parts[2] or not _NAME.fullmatch(parts[2]):
            raise _Unsupported  # "# HELP" alone, a quoted or invalid name
        name = parts[2]
        if parts[1] == "HELP":
            if name != self.name:
                self._start(name)
                self.typ, self.allowed = "untyped", (name,)
            return
        if len(parts) < 4:
            raise _Unsupported
        if name != self.name:
            self._start(name)
        self.typ = parts[3]
        self.allowed = tuple(name + suffix for suffix in _SUFFIXES.get(self.typ, ("",)))

    def _sample(self, line: str) -> None:
        match = _SAMPLE.fullmatch(line)
        if match is None or " # " in line:
            raise _Unsupported  # a timestamp, an exemplar, or not a sample line at all
        name, label_text, value_text = match.groups()
        labels = _labels(label_text) if label_text else {}
        if "_" in value_text:
            raise _Unsupported  # prometheus-client refuses `1_000`, float() would not
        try:
            value = float(value_text)
        except ValueError:
            raise _Unsupported from None
        if name in self.allowed:
            self.pending.append((labels, value))
            return
        self._start("")  # prometheus-client: an untyped family of its own, and no current family after it
        self.typ, self.allowed = "untyped", ()
        self.out.append((name, labels, value))


def _labels(text: str) -> dict[str, str]:
    labels: dict[str, str] = {}
    pos = 0
    while pos < len(text):
        match = _LABEL.match(text, pos)
        if match is None or match.end() == pos:
            if text[pos:].strip(" \t"):
                raise _Unsupported  # an escape, a missing comma, something odd
            break
        key, value = match.groups()
        if key in labels or key == "__name__":
            raise _Unsupported
        labels[key] = value
        pos = match.end()
    return labels
