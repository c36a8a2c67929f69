"""Which sources currently report each STATE finding: it lasts while any of them does.

NVML polls and DCGM scrapes both report a pending row remap; the finding must not flap when one source lags
(DCGM scrapes every 30 s), so it ends only when the last source that reported it says the condition is gone.
"""

from __future__ import annotations


class StateReporters:
    """Finding key -> the sources that report it now."""

    def __init__(self) -> None:
        self._by_key: dict[str, set[str]] = {}

    def report(self, key: str, source: str, active: bool) -> bool:
        """`source` says the condition is (`active`) or is not there; True while any source reports it."""
        holders = self._by_key.setdefault(key, set())
        if active:
            holders.add(source)
        else:
            holders.discard(source)
        if holders:
            return True
        del self._by_key[key]
        return False

    def forget(self, key: str) -> None:
        """The thing the finding is about is gone (a NIC removed by a rescan)."""
        self._by_key.pop(key, None)
