"""The doctor's result: one row per check, as a table or as the JSON document the README specifies."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Literal

Status = Literal["ok", "warn", "fail", "skip"]
STATUSES: tuple[Status, ...] = ("ok", "warn", "fail", "skip")


@dataclass(frozen=True)
class Check:
    """One check: `fix` says what to do when the status is not ok ("" when ok or skip without a remedy)."""

    name: str
    status: Status
    detail: str
    fix: str = ""


def ok(name: str, detail: str) -> Check:
    """A check that passed."""
    return Check(name, "ok", detail)


def skip(name: str, detail: str) -> Check:
    """A check that does not apply to this configuration."""
    return Check(name, "skip", detail)


def warn(name: str, detail: str, fix: str) -> Check:
    """Something the agent works around, or that only some features need."""
    return Check(name, "warn", detail, fix)


def fail(name: str, detail: str, fix: str) -> Check:
    """Something `run` needs and does not have."""
    return Check(name, "fail", detail, fix)


def exit_code(checks: Iterable[Check]) -> int:
    """0 when no check failed, 1 when one did."""
    return 1 if any(c.status == "fail" for c in checks) else 0


def to_json(checks: Sequence[Check]) -> str:
    """`{"checks": [{"name", "status", "detail", "fix"}, ...]}`."""
    return json.dumps({"checks": [asdict(c) for c in checks]}, indent=2)


def to_table(checks: Sequence[Check]) -> str:
    """One row per check; the fix on an indented line under a check that is not ok."""
    width = max((len(c.name) for c in checks), default=0)
    lines: list[str] = []
    for c in checks:
        lines.append(f"{c.status.upper():<4}  {c.name:<{width}}  {c.detail}")
        if c.fix and c.status != "ok":
            lines.append(f"{'':<4}  {'':<{width}}  fix: {c.fix}")
    lines.append(_counts(checks))
    return "\n".join(lines)


def _counts(checks: Sequence[Check]) -> str:
    """"2 ok, 1 warn, 0 fail, 1 skip"."""
    return ", ".join(f"{sum(c.status == s for c in checks)} {s}" for s in STATUSES)


def summary(checks: Sequence[Check]) -> str:
    """One line for the agent's start log: counts, and the checks that failed or warned."""
    counts = _counts(checks)
    bad = [f"{c.name} ({c.status}: {c.detail})" for c in checks if c.status in ("fail", "warn")]
    return counts + (f"; {'; '.join(bad)}" if bad else "")
