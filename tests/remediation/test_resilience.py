"""API server trouble never crashes the service, and a quiet node costs at most 12 requests an hour."""

from __future__ import annotations

from tests.remediation.conftest import NODE, Harness, make_config
from tests.remediation.test_cordon import HEALTHY, XID13, our_taint


async def test_the_service_waits_for_the_node_then_starts(harness: Harness):
    harness.api.fail("GET", f"/nodes/{NODE}$", 503, times=3)
    await harness.start()
    for seconds in (1.5, 3, 6):
        await harness.advance(seconds)
    gets = [r for r in harness.api.requests if r.method == "GET" and r.path.endswith(NODE)]
    assert len(gets) == 4
    await harness.verdict(XID13)
    assert our_taint(harness) is not None


async def test_patch_errors_are_retried_with_backoff(harness: Harness):
    await harness.start()
    harness.api.fail("PATCH", f"/nodes/{NODE}$", 500, times=2)
    await harness.verdict(XID13)
    assert our_taint(harness) is None
    assert harness.actions("reconcile", "api_error") == 1
    await harness.advance(1.3)
    await harness.advance(2.5)
    assert our_taint(harness) is not None
    assert harness.api_count("patch", "500") == 2


async def test_timeouts_are_retried(harness: Harness):
    await harness.start(make_config(), api_timeout=0.2)
    harness.api.fail("PATCH", f"/nodes/{NODE}/status", 200, delay=0.5)  # the client gives up first
    await harness.verdict(HEALTHY)
    await harness.until(lambda: harness.api_count("patch", "timeout") == 1, "a timed-out status patch")
    await harness.settle()
    await harness.advance(1.3)
    await harness.until(lambda: (harness.api.condition("GpuUnhealthy") or {}).get("status") == "False")


async def test_a_conflicting_writer_makes_the_agent_decide_again(harness: Harness):
    await harness.start()
    harness.api.fail("PATCH", f"/nodes/{NODE}$", 409)
    await harness.verdict(XID13)
    assert our_taint(harness) is not None
    assert harness.actions("cordon", "conflict") == 1 and harness.actions("cordon", "ok") == 1


async def test_watch_410_reads_the_node_again_and_catches_up(harness: Harness):
    await harness.start()
    await harness.verdict(XID13)
    harness.api.expire_watches()
    await harness.settle()
    gets = [r for r in harness.api.requests if r.method == "GET" and r.path.endswith(NODE)]
    assert len(gets) == 2  # start, and once after 410
    harness.api.admin_patch({"spec": {"unschedulable": False}})  # seen through the new watch
    await harness.settle()
    assert our_taint(harness) is None


async def test_watch_errors_back_off(harness: Harness):
    await harness.start()
    harness.api.fail("GET", r"/api/v1/nodes$", 500, times=3)
    harness.api.expire_watches()
    await harness.settle()
    harness.api.compact()
    for seconds in (1.5, 3, 6, 12):
        await harness.advance(seconds)
    watches = harness.api.node_requests(watches=True)
    assert 4 <= len(watches) <= 6  # backed off, not a hot loop
    assert harness.api.open_watches == 1


async def test_the_condition_heartbeat_is_every_five_minutes_and_not_more(harness: Harness):
    await harness.start()
    await harness.verdict(HEALTHY)
    start = harness.mark()
    await harness.advance(299)
    assert harness.writes(start) == []
    await harness.advance(2)
    assert [r.path for r in harness.writes(start)] == [f"/api/v1/nodes/{NODE}/status"]


async def test_steady_state_costs_at_most_12_requests_an_hour_plus_watches(harness: Harness):
    await harness.start()
    await harness.verdict(HEALTHY)
    await harness.advance(600)  # settle into steady state
    start = harness.mark()
    for _ in range(12):
        await harness.advance(300)  # one simulated hour
    during = harness.api.requests[start:]
    plain = [r for r in during if not r.watch]
    watches = [r for r in during if r.watch]
    assert len(plain) <= 12, [(r.method, r.path) for r in plain]
    assert all(r.method == "PATCH" and r.path.endswith("/status") for r in plain)  # only heartbeats
    assert 6 <= len(watches) <= 12  # 5-10 minute watches, resumed from the last version, no re-list
    assert all(w.query.get("resourceVersion") for w in watches)


async def test_the_api_answering_again_wakes_a_pending_cordon(harness: Harness):
    """An outage: writes fail until the reconcile loop backs off to 8 s and more. When the API answers again,
    seen by the node watch's first read after its own failure, the cordon goes out at once, not after the
    reconcile backoff (which at its cap was minutes)."""
    await harness.start()
    harness.api.fail("PATCH", f"/nodes/{NODE}$", 503, times=4)
    await harness.verdict(XID13)
    for _ in range(8):
        await harness.advance(1.0)
        if harness.actions("reconcile", "api_error") == 4:
            break
    assert harness.actions("reconcile", "api_error") == 4 and our_taint(harness) is None  # now backing off 8 s+
    harness.api.fail("GET", r"/api/v1/nodes$", 503, times=1)  # the outage as the node watch sees it
    harness.api.close_watches()
    await harness.settle()
    await harness.advance(1.5)  # the watch's own backoff, then its read of the node succeeds
    assert our_taint(harness) is not None
