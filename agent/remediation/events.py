"""Events on the Node for each remediation decision, aggregated and rate-limited.

Python clients have no client-go `EventRecorder`, so this is a small one: an identical (reason, message) Event
within `aggregate_seconds` is folded into a local count and costs no request; when it recurs after the window,
the existing Event is patched with the accumulated count. A token bucket (client-go's spam filter defaults:
burst 25, one token per 5 minutes) caps what a flapping fault can cost the API server. Events are best effort:
failures are logged, never raised. Every Event is also logged, so `--simulate --dry-run` shows the decisions.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

from agent.clock import Clock
from agent.kube.errors import ApiError, ApiNotFound
from agent.kube.model import EventRecord, ObjectRef
from agent.kube.port import EventApi

log = logging.getLogger(__name__)

NORMAL = "Normal"
WARNING = "Warning"
_MAX_KEYS = 128


@dataclass
class _Seen:
    record: EventRecord
    sent_at: float
    pending: int = 0


class EventRecorder:
    """Create or fold Events about the node."""

    def __init__(self, api: EventApi, clock: Clock, *, dry_run: bool = False, aggregate_seconds: float = 600.0,
                 burst: int = 25, refill_seconds: float = 300.0) -> None:
        self._api = api
        self._clock = clock
        self._dry_run = dry_run
        self._aggregate = aggregate_seconds
        self._burst = burst
        self._refill = refill_seconds
        self._tokens = float(burst)
        self._tokens_at = clock.now()
        self._seen: OrderedDict[tuple[str, str, ObjectRef | None], _Seen] = OrderedDict()
        self.dropped = 0

    def _take_token(self, now: float) -> bool:
        self._tokens = min(float(self._burst), self._tokens + (now - self._tokens_at) / self._refill)
        self._tokens_at = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    async def emit(self, reason: str, message: str, type: str = NORMAL, involved: ObjectRef | None = None) -> None:
        """Record one decision as an Event about the Node, or about `involved` (a Pod); logged always, sent unless
        folded or rate-limited."""
        if self._dry_run:
            message = f"[dry-run] {message}"
        log.log(logging.WARNING if type == WARNING else logging.INFO, "event %s: %s", reason, message,
                extra={"reason": reason, "event_type": type})
        now = self._clock.now()
        key = (reason, message, involved)
        seen = self._seen.get(key)
        if seen is not None and now - seen.sent_at < self._aggregate:
            seen.pending += 1
            return
        if not self._take_token(now):
            self.dropped += 1
            log.warning("event %s not sent: rate limit (burst %d, one per %.0fs)", reason, self._burst,
                        self._refill)
            return
        if seen is not None:
            old = seen.record
            record = EventRecord(reason, message, type, old.name, old.count + seen.pending + 1, old.first_time, now,
                                 involved)
        else:
            record = EventRecord(reason, message, type, first_time=now, last_time=now, involved=involved)
        try:
            try:
                written = await self._api.write_event(record)
            except ApiNotFound:  # the API server's event TTL (1 h by default) removed it: start afresh
                if not record.name:
                    raise
                written = await self._api.write_event(EventRecord(reason, message, type, first_time=now,
                                                                  last_time=now, involved=involved))
        except ApiError as exc:
            log.warning("event %s not recorded: %s", reason, exc)
            return
        self._seen[key] = _Seen(written, now)
        self._seen.move_to_end(key)
        while len(self._seen) > _MAX_KEYS:
            self._seen.popitem(last=False)
