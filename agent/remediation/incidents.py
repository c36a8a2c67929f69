"""Incidents on the Node: each new fault finding, counted in the annotation `<prefix>/incidents`.

The annotation is JSON: `count` (every incident since the annotation was first written), `last` (RFC 3339),
`lastCause` (the condition's reason then), `recent` (the stamps inside `windowSeconds`, at most `MAX_RECENT`)
and `windowSeconds`. The engine sends it in the same strategic-merge PATCH of `nodes/NAME/status` that changes the
condition, so recording an incident costs no request of its own; `gpu-node-agent fleet` reads it back to name the
repeat offenders (at least N `recent` stamps inside the window) without any database. An annotation that is not
that JSON (a person's edit, another tool's value, oversized) counts as none and is started afresh.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from agent.kube.model import format_time, parse_time

SUFFIX = "incidents"
DEFAULT_WINDOW_SECONDS = 604_800.0
MAX_RECENT = 32  # a repeat-offender threshold above this is not meaningful; the annotation stays ~1 kB
MAX_TEXT = 16 << 10  # an annotation longer than this is not ours


def annotation_key(prefix: str) -> str:
    """`<prefix>/incidents`."""
    return f"{prefix}/{SUFFIX}"


@dataclass(frozen=True)
class Incidents:
    """The parsed annotation."""

    count: int = 0
    last: float | None = None
    last_cause: str = ""
    recent: tuple[float, ...] = ()
    window_seconds: float = DEFAULT_WINDOW_SECONDS

    def inside(self, now: float) -> tuple[float, ...]:
        """The recent stamps inside the window ending now (a stamp from a clock slightly ahead counts)."""
        return tuple(t for t in self.recent if now - self.window_seconds <= t)

    def repeat_offender(self, now: float, threshold: int) -> bool:
        """At least `threshold` incidents inside the window."""
        return threshold > 0 and len(self.inside(now)) >= threshold

    def record(self, now: float, cause: str, findings: int = 1,
               window_seconds: float = DEFAULT_WINDOW_SECONDS) -> Incidents:
        """These `findings` new incidents at `now`, the stamps outside the window dropped."""
        kept = [t for t in self.recent if now - window_seconds <= t]
        recent = (kept + [now] * findings)[-MAX_RECENT:]
        return Incidents(self.count + findings, now, cause, tuple(recent), window_seconds)

    def to_json(self) -> str:
        """The annotation's value."""
        return json.dumps({"count": self.count, "last": format_time(self.last) if self.last is not None else "",
                           "lastCause": self.last_cause, "recent": [format_time(t) for t in self.recent],
                           "windowSeconds": int(self.window_seconds)}, separators=(",", ":"))


def recorded(annotations: Mapping[str, str], prefix: str, now: float, cause: str, *, findings: int,
             window_seconds: float) -> dict[str, str | None]:
    """The annotation update recording `findings` new incidents over what the node's annotations hold."""
    key = annotation_key(prefix)
    current = parse(annotations.get(key)) or Incidents()
    return {key: current.record(now, cause, findings, window_seconds).to_json()}


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _stamps(values: Iterable[object]) -> tuple[float, ...] | None:
    stamps = tuple(parse_time(v) if isinstance(v, str) else None for v in values)
    return None if any(s is None for s in stamps) else tuple(s for s in stamps if s is not None)


def parse(text: str | None) -> Incidents | None:
    """The annotation's value, or None when it is absent or not that JSON."""
    if not text or len(text) > MAX_TEXT:
        return None
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    count, window = _number(data.get("count")), _number(data.get("windowSeconds"))
    recent, cause, last = data.get("recent"), data.get("lastCause", ""), data.get("last", "")
    if count is None or count < 0 or count != int(count) or window is None or window <= 0:
        return None
    if not isinstance(recent, list) or len(recent) > MAX_RECENT or not isinstance(cause, str) \
            or not isinstance(last, str):
        return None
    stamps = _stamps(recent)
    if stamps is None:
        return None
    return Incidents(int(count), parse_time(last), cause, stamps, window)
