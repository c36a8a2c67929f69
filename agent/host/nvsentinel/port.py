"""The values the agent sends to NVSentinel and the port that sends them.

`HealthEventData` mirrors NVSentinel's `HealthEvent` (proto/nvsentinel/v1/api.proto) as plain data, so the health
subsystem builds events without protobuf. Recommended actions and processing strategies are named by their enum
value names (`RESTART_BM`, `STORE_ONLY`); the client maps them to numbers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

#: where NVSentinel's connector pod creates its socket, as seen from the host (its pods dial
#: unix:///var/run/nvsentinel.sock with the host's /var/run/nvsentinel mounted at /var/run)
DEFAULT_SOCKET = "/var/run/nvsentinel/nvsentinel.sock"
RECOMMENDED_ACTIONS = ("NONE", "COMPONENT_RESET", "CONTACT_SUPPORT", "RUN_FIELDDIAG", "RESTART_VM", "RESTART_BM",
                       "REPLACE_VM", "RUN_DCGMEUD", "RESTART_APP", "UNKNOWN")
PROCESSING_STRATEGIES = ("STORE_ONLY", "EXECUTE_REMEDIATION")


class NvsentinelError(Exception):
    """A batch was not delivered; `reason` is short and bounded: `unavailable`, `timeout`, `refused`, `error`."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True)
class Entity:
    """One impacted thing, e.g. ("GPU_UUID", "GPU-..."), ("PCI", "0000:1b:00.0")."""

    kind: str
    value: str


@dataclass(frozen=True)
class HealthEventData:
    """One NVSentinel HealthEvent."""

    agent: str
    component_class: str
    check_name: str
    is_healthy: bool
    message: str
    recommended_action: str
    error_codes: tuple[str, ...]
    entities: tuple[Entity, ...]
    generated_at: float
    node_name: str
    processing_strategy: str
    metadata: Mapping[str, str] = field(default_factory=dict)

    @property
    def is_fatal(self) -> bool:
        """As NVSentinel's own monitors derive it: a recommended action other than NONE."""
        return self.recommended_action != "NONE"


class NvsentinelPort(Protocol):
    """Deliver events to NVSentinel's platform connector."""

    async def send(self, events: Sequence[HealthEventData], timeout: float) -> None:
        """One HealthEventOccurredV1 call carrying `events`, abandoned after `timeout` seconds; raises
        NvsentinelError when it was not delivered."""

    async def aclose(self) -> None:
        """Release the channel."""


class InMemoryConnector:
    """The simulated connector: keeps every batch it was sent (`--simulate` without a socket, tests)."""

    def __init__(self) -> None:
        self.batches: list[tuple[HealthEventData, ...]] = []
        self.changed = asyncio.Event()

    async def send(self, events: Sequence[HealthEventData], timeout: float) -> None:
        """Record the batch."""
        self.batches.append(tuple(events))
        self.changed.set()

    async def aclose(self) -> None:
        """Nothing to release."""
