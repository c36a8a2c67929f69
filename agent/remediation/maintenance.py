"""Cloud maintenance notices from the instance metadata service, turned into cordon or drain verdicts.

A GPU VM cannot live-migrate: Azure gives 15 minutes before a Reboot, GCP an hour before
TERMINATE_ON_HOST_MAINTENANCE, AWS days before a scheduled reboot or retirement. Cordoning on the notice (and
draining ahead of NotBefore when configured) keeps new jobs off a node that is about to go away. Polling is
local (link-local metadata server), so it costs the API server nothing. The base URL is configurable so tests
serve each cloud's document from a local HTTP server. When a poll fails the last known events are kept: a
flaky metadata server must not look like the maintenance was cancelled.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import email.utils
import json
import logging
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from agent.clock import Clock
from agent.signals import NodeVerdict, Severity

log = logging.getLogger(__name__)

Fetch = Callable[[str, str, dict[str, str]], Awaitable[tuple[int, bytes]]]

AZURE_ACTIONABLE = ("Reboot", "Redeploy", "Preempt", "Terminate")  # Freeze pauses the VM for seconds: log only


class MetadataError(Exception):
    """The metadata server did not answer usefully."""


@dataclass(frozen=True)
class MaintenanceEvent:
    """One scheduled event; `not_before` None means now or unknown."""

    cloud: str
    kind: str
    event_id: str = ""
    not_before: float | None = None
    description: str = ""

    @property
    def reason(self) -> str:
        """CamelCase reason, e.g. AzureReboot, GcpTerminateOnHostMaintenance, AwsSystemReboot."""
        words = self.kind.replace("-", "_").split("_")
        return self.cloud.capitalize() + "".join(w.capitalize() for w in words if w)


async def urllib_fetch(method: str, url: str, headers: dict[str, str], timeout: float = 5.0) -> tuple[int, bytes]:
    """HTTP with the standard library, bypassing proxies (metadata is link-local), in a worker thread."""
    if not url.startswith(("http://", "https://")):
        raise MetadataError(f"refusing non-HTTP metadata URL {url!r}")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def call() -> tuple[int, bytes]:
        request = urllib.request.Request(url, method=method, headers=headers)  # noqa: S310 - scheme checked above
        try:
            with opener.open(request, timeout=timeout) as response:
                return response.status, response.read(1 << 20)
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read(1 << 16)
        except (OSError, ValueError) as exc:
            raise MetadataError(f"{method} {url}: {exc}") from exc
    return await asyncio.to_thread(call)


async def _get(fetch: Fetch, url: str, headers: dict[str, str], method: str = "GET") -> tuple[int, bytes]:
    try:
        return await fetch(method, url, headers)
    except MetadataError:
        raise
    except (OSError, ValueError) as exc:
        raise MetadataError(f"{method} {url}: {exc}") from exc


class AzureSource:
    """Azure Scheduled Events (`Metadata: true`), only those naming this VM."""

    name = "azure"

    def __init__(self) -> None:
        self._vm_name: str | None = None

    async def poll(self, fetch: Fetch, base: str, now: float) -> list[MaintenanceEvent]:
        """Scheduled or started events of actionable types."""
        headers = {"Metadata": "true"}
        if self._vm_name is None:
            status, body = await _get(fetch, f"{base}/metadata/instance/compute/name?api-version=2021-02-01"
                                             f"&format=text", headers)
            self._vm_name = body.decode().strip() if status == 200 else ""
        status, body = await _get(fetch, f"{base}/metadata/scheduledevents?api-version=2020-07-01", headers)
        if status != 200:
            raise MetadataError(f"azure scheduled events: HTTP {status}")
        try:
            events = json.loads(body).get("Events") or []
        except (ValueError, AttributeError, RecursionError) as exc:
            raise MetadataError(f"azure scheduled events: not a JSON document: {exc}") from exc
        found = []
        for event in events:
            resources = event.get("Resources") or []
            if self._vm_name and resources and self._vm_name not in resources:
                continue
            kind = event.get("EventType", "")
            if kind not in AZURE_ACTIONABLE:
                log.info("azure maintenance %s (%s) needs no cordon", kind, event.get("EventId", ""))
                continue
            found.append(MaintenanceEvent("azure", kind, event.get("EventId", ""),
                                          _rfc1123(event.get("NotBefore")), event.get("Description", "")))
        return found


class GcpSource:
    """GCP `instance/maintenance-event` (`Metadata-Flavor: Google`): NONE or the pending action."""

    name = "gcp"

    async def poll(self, fetch: Fetch, base: str, now: float) -> list[MaintenanceEvent]:
        """One event while the value is not NONE (GPU VMs get about an hour of notice)."""
        status, body = await _get(fetch, f"{base}/computeMetadata/v1/instance/maintenance-event",
                                  {"Metadata-Flavor": "Google"})
        if status != 200:
            raise MetadataError(f"gcp maintenance-event: HTTP {status}")
        value = body.decode().strip()
        return [] if value in ("", "NONE") else [MaintenanceEvent("gcp", value.lower())]


class AwsSource:
    """EC2 scheduled events through IMDSv2 (session token first)."""

    name = "aws"

    def __init__(self) -> None:
        self._token: str | None = None

    async def _session(self, fetch: Fetch, base: str) -> str:
        if self._token is None:
            status, body = await _get(fetch, f"{base}/latest/api/token",
                                      {"X-aws-ec2-metadata-token-ttl-seconds": "21600"}, method="PUT")
            if status != 200:
                raise MetadataError(f"aws IMDSv2 token: HTTP {status}")
            self._token = body.decode().strip()
        return self._token

    async def poll(self, fetch: Fetch, base: str, now: float) -> list[MaintenanceEvent]:
        """Active events; completed and canceled ones are listed with a prefix and skipped."""
        url = f"{base}/latest/meta-data/events/maintenance/scheduled"
        status, body = await _get(fetch, url, {"X-aws-ec2-metadata-token": await self._session(fetch, base)})
        if status == 401:  # token expired
            self._token = None
            status, body = await _get(fetch, url, {"X-aws-ec2-metadata-token": await self._session(fetch, base)})
        if status == 404:
            return []
        if status != 200:
            raise MetadataError(f"aws scheduled events: HTTP {status}")
        try:
            events = json.loads(body) if body.strip() else []
        except (ValueError, RecursionError) as exc:
            raise MetadataError(f"aws scheduled events: not JSON: {exc}") from exc
        found = []
        for event in events if isinstance(events, list) else []:
            description = event.get("Description", "")
            if description.startswith(("[Completed]", "[Canceled]")) or event.get("State", "active") != "active":
                continue
            found.append(MaintenanceEvent("aws", event.get("Code", "maintenance"), event.get("EventId", ""),
                                          _aws_time(event.get("NotBefore")), description))
        return found


def _rfc1123(text: str | None) -> float | None:
    if not text:
        return None
    try:
        return email.utils.parsedate_to_datetime(text).timestamp()
    except (TypeError, ValueError):
        return None


def _aws_time(text: str | None) -> float | None:
    if not text:
        return None
    try:
        return dt.datetime.strptime(text, "%d %b %Y %H:%M:%S %Z").replace(tzinfo=dt.UTC).timestamp()
    except ValueError:
        return _rfc1123(text)


class MaintenanceSource(Protocol):
    """One cloud's metadata service: its name and one poll for the events scheduled for this VM."""

    name: str

    async def poll(self, fetch: Fetch, base: str, now: float) -> list[MaintenanceEvent]:
        """The actionable events known now."""
        ...


SOURCES: dict[str, Callable[[], MaintenanceSource]] = {"azure": AzureSource, "gcp": GcpSource, "aws": AwsSource}


def to_verdict(events: list[MaintenanceEvent], now: float, drain_before: float) -> NodeVerdict | None:
    """Cordon for the earliest event; drain when it is within `drain_before` seconds (0: never drain)."""
    if not events:
        return None
    first = min(events, key=lambda e: e.not_before if e.not_before is not None else now)
    starts = first.not_before if first.not_before is not None else now
    drain = drain_before > 0 and starts - now <= drain_before
    when = "now" if first.not_before is None else dt.datetime.fromtimestamp(starts, dt.UTC).isoformat()
    message = f"{first.cloud} scheduled {first.kind} {first.event_id} not before {when}".replace("  ", " ")
    if first.description:
        message += f": {first.description}"
    return NodeVerdict(Severity.DRAIN if drain else Severity.CORDON, first.reason, message.strip())


class MaintenanceWatcher:
    """Polls the configured clouds and publishes a maintenance verdict (None when nothing is scheduled)."""

    def __init__(self, clouds: list[str], base_url: str, clock: Clock, *, poll_seconds: float = 10.0,
                 drain_before: float = 0.0, fetch: Fetch = urllib_fetch) -> None:
        self._sources = [SOURCES[name]() for name in clouds]
        self._base = base_url.rstrip("/")
        self._clock = clock
        self._poll = poll_seconds
        self._drain_before = drain_before
        self._fetch = fetch
        self._known: dict[str, list[MaintenanceEvent]] = {}
        self._errors: dict[str, str] = {}
        self.verdict: NodeVerdict | None = None

    async def poll_once(self) -> NodeVerdict | None:
        """Poll every source once and recompute the verdict."""
        now = self._clock.now()
        for source in self._sources:
            try:
                self._known[source.name] = await source.poll(self._fetch, self._base, now)
            except MetadataError as exc:
                if self._errors.get(source.name) != str(exc):  # log each distinct failure once
                    log.warning("maintenance: %s metadata unavailable, keeping last known events: %s",
                                source.name, exc)
                self._errors[source.name] = str(exc)
            else:
                self._errors.pop(source.name, None)
        events = [event for found in self._known.values() for event in found]
        self.verdict = to_verdict(events, now, self._drain_before)
        return self.verdict

    async def run(self, stop: asyncio.Event, changed: Callable[[], None]) -> None:
        """Poll until stopped; call `changed` whenever the verdict changes."""
        while not stop.is_set():
            before = self.verdict
            if await self.poll_once() != before:
                changed()
            await self._clock.wait(stop, self._poll)
