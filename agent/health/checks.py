"""The state of each health check (producer): one typed value per check, with the reason when it is not ok.

Producers report here; `/metrics` shows `gpu_node_agent_health_check_up{check}` (1 only while `ok`), the log's
first-pass line and the tests read it. A check that cannot run is never `ok`: it is `unavailable` (no NVML, no
such file), `failed` (raised; the supervisor retries it) or `off` (configured off).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass


class CheckState(enum.Enum):
    """Where a check stands."""

    STARTING = "starting"  # started, not looked yet
    OK = "ok"  # looked, and keeps looking
    OFF = "off"  # configured off
    UNAVAILABLE = "unavailable"  # cannot look on this node (no NVML, no kernel log file)
    FAILED = "failed"  # raised; retried with backoff


@dataclass(frozen=True)
class CheckStatus:
    """A check's state and, unless ok, why."""

    state: CheckState
    reason: str = ""

    @property
    def up(self) -> bool:
        """True only while the check runs and looks."""
        return self.state is CheckState.OK

    def __str__(self) -> str:
        return f"{self.state.value}: {self.reason}" if self.reason else self.state.value


class Checks:
    """Check name -> status; names are the `check` label values (kmsg, nvml_events, nvml_poll, links, dcgm)."""

    def __init__(self) -> None:
        self._status: dict[str, CheckStatus] = {}

    def set(self, name: str, state: CheckState, reason: str = "") -> None:
        """Record a check's state."""
        self._status[name] = CheckStatus(state, reason)

    def start(self, name: str) -> None:
        """`starting`, unless the check already reported."""
        self._status.setdefault(name, CheckStatus(CheckState.STARTING))

    def get(self, name: str) -> CheckStatus | None:
        """The check's status; None when it is not run at all."""
        return self._status.get(name)

    def __getitem__(self, name: str) -> str:
        """The status as text: "ok", "off", "starting", "unavailable: why" or "failed: why"."""
        return str(self._status[name])

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._status))

    def items(self) -> list[tuple[str, CheckStatus]]:
        """(name, status), by name."""
        return sorted(self._status.items())

    def text(self) -> dict[str, str]:
        """Name -> status text, for logs and callers that show it."""
        return {name: str(status) for name, status in self.items()}
