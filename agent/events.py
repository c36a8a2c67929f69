"""Messages that flow from producers to consumers, in a module neither side owns.

Health publishes `DeviceHealthEvent`s; the device plugin consumes them (ListAndWatch). Keeping the type here
means health never imports the device plugin (or grpc), and the device plugin never imports health.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceHealthEvent:
    """A health verdict for one device ID (a VF bus id or a GPU UUID); `healthy` may be True again later."""

    device_id: str
    healthy: bool
    reason: str = ""
