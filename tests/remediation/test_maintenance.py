"""Cloud maintenance notices from each cloud's metadata document, served by a local HTTP server."""

from __future__ import annotations

import email.utils
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from agent.remediation.maintenance import MaintenanceWatcher, to_verdict
from tests.fakes.clock import FakeClock
from tests.remediation.conftest import Harness, make_config
from tests.remediation.test_cordon import HEALTHY

NOW = FakeClock().now()


def rfc1123(epoch: float) -> str:
    return email.utils.formatdate(epoch, usegmt=True)


def aws_time(epoch: float) -> str:
    import time
    return time.strftime("%d %b %Y %H:%M:%S GMT", time.gmtime(epoch))


class Metadata:
    """What the fake metadata server serves; tests change it between polls."""

    def __init__(self) -> None:
        self.azure: dict[str, Any] = {"DocumentIncarnation": 1, "Events": []}
        self.gcp = "NONE"
        self.aws: list[dict[str, Any]] = []
        self.aws_token = "token-1"  # noqa: S105 - a test session token
        self.down = False
        self.seen: list[tuple[str, str, dict[str, str]]] = []


def _handler(meta: Metadata) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _send(self, status: int, body: str, kind: str = "application/json") -> None:
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_PUT(self) -> None:
            meta.seen.append(("PUT", self.path, dict(self.headers)))
            if self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                self._send(200, meta.aws_token, "text/plain")
            else:
                self._send(400, "missing TTL header", "text/plain")

        def do_GET(self) -> None:
            meta.seen.append(("GET", self.path, dict(self.headers)))
            if meta.down:
                self._send(503, "down", "text/plain")
            elif self.path.startswith("/metadata/"):
                if self.headers.get("Metadata") != "true":
                    self._send(400, json.dumps({"error": "Bad request. Required metadata header not specified"}))
                elif self.path.startswith("/metadata/instance/compute/name"):
                    self._send(200, "vm-7", "text/plain")
                elif self.path == "/metadata/scheduledevents?api-version=2020-07-01":
                    self._send(200, json.dumps(meta.azure))
                else:
                    self._send(404, "{}")
            elif self.path == "/computeMetadata/v1/instance/maintenance-event":
                if self.headers.get("Metadata-Flavor") != "Google":
                    self._send(403, "Missing Metadata-Flavor:Google header.", "text/plain")
                else:
                    self._send(200, meta.gcp, "application/text")
            elif self.path == "/latest/meta-data/events/maintenance/scheduled":
                if self.headers.get("X-aws-ec2-metadata-token") != meta.aws_token:
                    self._send(401, "", "text/plain")
                else:
                    self._send(200, json.dumps(meta.aws))
            else:
                self._send(404, "not found", "text/plain")
    return Handler


@pytest.fixture
def metadata() -> Iterator[tuple[Metadata, str]]:
    meta = Metadata()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(meta))
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield meta, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def azure_event(kind: str, not_before: str, resources: list[str] | None = None, event_id: str = "E1") -> dict:
    return {"EventId": event_id, "EventType": kind, "ResourceType": "VirtualMachine",
            "Resources": resources if resources is not None else ["vm-7"], "EventStatus": "Scheduled",
            "NotBefore": not_before, "Description": "Host maintenance", "EventSource": "Platform",
            "DurationInSeconds": -1}


async def test_azure_scheduled_events_for_this_vm(metadata):
    meta, url = metadata
    watcher = MaintenanceWatcher(["azure"], url, FakeClock())
    assert await watcher.poll_once() is None
    meta.azure["Events"] = [azure_event("Freeze", rfc1123(NOW + 60), event_id="F"),
                            azure_event("Reboot", rfc1123(NOW + 900), ["vm-other"], event_id="other"),
                            azure_event("Reboot", rfc1123(NOW + 900))]
    verdict = await watcher.poll_once()
    assert verdict is not None and verdict.verdict == "cordon" and verdict.reason == "AzureReboot"
    assert "E1" in verdict.message and not verdict.hardware
    assert all(h.get("Metadata") == "true" for m, p, h in meta.seen)
    meta.azure["Events"] = [azure_event("Reboot", "")]  # started: NotBefore is blank
    assert (await watcher.poll_once()).message.startswith("azure scheduled Reboot E1 not before now")


async def test_gcp_maintenance_event(metadata):
    meta, url = metadata
    watcher = MaintenanceWatcher(["gcp"], url, FakeClock())
    assert await watcher.poll_once() is None
    meta.gcp = "TERMINATE_ON_HOST_MAINTENANCE"
    verdict = await watcher.poll_once()
    assert verdict.reason == "GcpTerminateOnHostMaintenance" and verdict.verdict == "cordon"
    assert meta.seen[-1][2].get("Metadata-Flavor") == "Google"
    meta.gcp = "NONE"
    assert await watcher.poll_once() is None


async def test_aws_scheduled_events_with_an_imdsv2_token(metadata):
    meta, url = metadata
    watcher = MaintenanceWatcher(["aws"], url, FakeClock())
    meta.aws = [{"Code": "system-reboot", "Description": "[Completed] scheduled reboot", "EventId": "old",
                 "NotBefore": aws_time(NOW - 86400), "State": "completed"},
                {"Code": "instance-stop", "Description": "[Canceled] stop", "EventId": "c",
                 "NotBefore": aws_time(NOW), "State": "canceled"},
                {"Code": "system-reboot", "Description": "scheduled reboot", "EventId": "instance-event-1",
                 "NotBefore": aws_time(NOW + 3 * 86400), "NotAfter": aws_time(NOW + 4 * 86400), "State": "active"}]
    verdict = await watcher.poll_once()
    assert verdict.reason == "AwsSystemReboot" and "instance-event-1" in verdict.message
    assert [m for m, p, h in meta.seen] == ["PUT", "GET"]
    await watcher.poll_once()
    assert [m for m, p, h in meta.seen] == ["PUT", "GET", "GET"]  # the token is reused
    meta.aws_token = "token-2"  # noqa: S105 - the session expired
    assert (await watcher.poll_once()) is not None
    assert [m for m, p, h in meta.seen][-3:] == ["GET", "PUT", "GET"]


async def test_a_metadata_outage_keeps_the_last_known_events(metadata):
    meta, url = metadata
    meta.gcp = "TERMINATE_ON_HOST_MAINTENANCE"
    watcher = MaintenanceWatcher(["gcp"], url, FakeClock())
    assert await watcher.poll_once() is not None
    meta.down = True
    assert await watcher.poll_once() is not None


async def test_unreachable_metadata_is_no_event():
    watcher = MaintenanceWatcher(["azure", "gcp", "aws"], "http://127.0.0.1:9", FakeClock())
    assert await watcher.poll_once() is None


def test_drain_starts_only_within_the_configured_lead():
    from agent.remediation.maintenance import MaintenanceEvent
    soon = [MaintenanceEvent("azure", "Reboot", "E", NOW + 600)]
    assert to_verdict(soon, NOW, 0).verdict == "cordon"
    assert to_verdict(soon, NOW, 300).verdict == "cordon"
    assert to_verdict(soon, NOW + 301, 300).verdict == "drain"
    assert to_verdict([MaintenanceEvent("gcp", "terminate_on_host_maintenance")], NOW, 300).verdict == "drain"


async def test_a_scheduled_event_cordons_then_drains_ahead_of_not_before(harness: Harness, metadata):
    meta, url = metadata
    harness.api.add_pod("team", "train-0")
    config = make_config(maintenance_clouds=["azure"], maintenance_base_url=url, maintenance_poll_seconds=60,
                         maintenance_drain_before_seconds=300)
    await harness.start(config)
    await harness.verdict(HEALTHY)
    meta.azure["Events"] = [azure_event("Reboot", rfc1123(NOW + 900))]
    await harness.advance(60)
    await harness.until(lambda: len(harness.event_reasons()) > 0, "maintenance event")
    await harness.until(lambda: harness.api.node["spec"].get("unschedulable") is True, "maintenance cordon")
    taint = next(t for t in harness.api.taints if t["key"].endswith("/gpu-unhealthy"))
    assert taint["value"] == "AzureReboot"
    assert "Cordoned" in harness.event_reasons() and ("team", "train-0") in harness.api.pods
    while harness.clock.now() < NOW + 540:  # NotBefore - 300 s is NOW + 600: nothing evicted before
        await harness.advance(60)
        await harness.settle()
    assert ("team", "train-0") in harness.api.pods
    await harness.advance(60)
    await harness.until(lambda: ("team", "train-0") not in harness.api.pods, "drained ahead of NotBefore")
    meta.azure["Events"] = []  # the maintenance is over
    await harness.advance(60)
    await harness.until(lambda: "gpunodeagent.io/healthy-since" in harness.api.annotations, "healthy window")
    await harness.settle()
    await harness.advance(600)
    await harness.until(lambda: not harness.api.node["spec"].get("unschedulable"), "uncordoned after maintenance")


async def test_a_maintenance_only_condition_returns_to_false_when_the_notice_ends(harness: Harness, metadata):
    meta, url = metadata
    meta.gcp = "TERMINATE_ON_HOST_MAINTENANCE"
    await harness.start(make_config(maintenance_clouds=["gcp"], maintenance_base_url=url,
                                    maintenance_poll_seconds=60))  # no health verdict at all: maintenance only
    await harness.advance(60)
    await harness.until(lambda: (harness.api.condition("GpuUnhealthy") or {}).get("status") == "True",
                        "maintenance condition")
    meta.gcp = "NONE"
    await harness.advance(60)
    await harness.until(lambda: harness.api.condition("GpuUnhealthy")["status"] == "False", "condition cleared")
    assert harness.api.condition("GpuUnhealthy")["reason"] == "Cleared"
