"""A client-side token bucket that keeps the agent inside the kubelet's PodResources rate limit.

The kubelet allows 100 calls a second with a burst of 10 for all of its PodResources clients together
(dcgm-exporter, Multus, ...; podresources.md §1): excess calls fail with RESOURCE_EXHAUSTED for everyone. The
agent takes half of it by default. `take()` never waits; `take_within(s)` waits for a token only when one comes
within `s` seconds (the preference path: a burst of admissions is paced at the agent's rate instead of refused,
and a token further off fails at once); `wait()` is for background polls.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

KUBELET_QPS = 100.0
KUBELET_BURST = 10


class TokenBucket:
    """`rate` tokens a second, at most `burst` saved up; starts full."""

    def __init__(self, rate: float = KUBELET_QPS / 2, burst: int = KUBELET_BURST // 2,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError(f"rate {rate} must be positive and burst {burst} at least 1")
        if rate > KUBELET_QPS or burst > KUBELET_BURST:
            raise ValueError(f"rate {rate}/s burst {burst} exceeds the kubelet's {KUBELET_QPS}/s burst {KUBELET_BURST}")
        self.rate = rate
        self.burst = float(burst)
        self._monotonic = monotonic
        self._tokens = float(burst)
        self._at = monotonic()

    def _refill(self) -> None:
        now = self._monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now

    def take(self) -> bool:
        """Take a token if one is there; False (and nothing taken) when the bucket is empty."""
        self._refill()
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False

    def delay(self) -> float:
        """Seconds until a token is there (0 when one is)."""
        self._refill()
        return 0.0 if self._tokens >= 1.0 else (1.0 - self._tokens) / self.rate

    async def take_within(self, seconds: float) -> bool:
        """Take a token if one is there or comes within `seconds` (sleeping until then); False when not.

        Bounded by the time slept, not by reading the clock again: the bucket's clock is injected (tests use one
        that only moves when told), and a wait must end even when that clock stands still."""
        waited = 0.0
        while not self.take():
            delay = self.delay()
            if waited + delay > seconds:
                return False
            await asyncio.sleep(delay)
            waited += delay
        return True

    async def wait(self) -> None:
        """Take a token, sleeping until one is there."""
        while not self.take():
            await asyncio.sleep(self.delay())
