"""The node's pod watch (list, watch with bookmarks, resume, 410 re-list, backoff) through the real lightkube port
against the HTTP double. Time is the fake clock's: backoffs and watch timeouts are asserted on it, never on the
wall clock; `until` only guards against hangs."""

from __future__ import annotations

import asyncio
import itertools
import logging
import random

import pytest

from agent.kube.cluster import LightkubeCluster
from agent.kube.model import PodView
from agent.kube.podwatch import NodePodWatch
from tests.fakes.apiserver import ApiServerDouble
from tests.fakes.clock import FakeClock
from tests.fakes.polling import until
from tests.kube.conftest import NODE, count


async def backoff_wait(clock: FakeClock) -> float:
    """Wait until the watcher sleeps out a backoff (the double's own watch timers are 300 s or more away)."""
    def sleeping() -> bool:
        due = clock.next_deadline()
        return due is not None and due - clock.now() < 300
    await until(sleeping, "a backoff wait")
    due = clock.next_deadline()
    assert due is not None
    return due - clock.now()


class Watched:
    """A NodePodWatch running on the port, recording every published set."""

    def __init__(self, port: LightkubeCluster, clock: FakeClock) -> None:
        self.sets: list[tuple[PodView, ...]] = []
        self.watch = NodePodWatch(port, self.sets.append, clock=clock, rng=random.Random(3))  # noqa: S311
        self.stop = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self.watch.run(self.stop))

    async def close(self) -> None:
        self.stop.set()
        assert self.task is not None
        await asyncio.wait_for(self.task, 5)

    def names(self) -> set[str]:
        return {f"{p.namespace}/{p.name}" for p in self.sets[-1]} if self.sets else set()


@pytest.fixture
async def watched(port: LightkubeCluster, clock: FakeClock):
    w = Watched(port, clock)
    yield w
    if w.task is not None and not w.task.done():
        await w.close()


def assert_node_selector_only(api: ApiServerDouble) -> None:
    requests = api.pod_requests()
    assert requests
    assert all(r.query.get("fieldSelector") == f"spec.nodeName={NODE}" for r in requests), \
        [r.query for r in requests]


async def test_lists_then_watches_adds_updates_and_deletes(api: ApiServerDouble, port, watched: Watched):
    api.add_pod("team", "train-0", ips=("10.1.0.5",))
    api.add_pod("team", "elsewhere", node="other-node", ips=("10.9.0.1",))
    listed_at = api.rv
    watched.start()
    await until(lambda: api.open_watches == 1, "an open pod watch")
    assert watched.watch.synced and watched.names() == {"team/train-0"}
    assert watched.sets[-1][0].ips == ("10.1.0.5",)
    query = api.pod_requests(watches=True)[0].query
    assert query["resourceVersion"] == str(listed_at) and query["allowWatchBookmarks"] == "true"
    assert 300 <= int(query["timeoutSeconds"]) <= 600

    api.add_pod("team", "pending-1")  # scheduled, no IP yet
    await until(lambda: "team/pending-1" in watched.names(), "ADDED")
    api.update_pod("team", "pending-1", {"status": {"podIPs": [{"ip": "10.1.0.6"}, {"ip": "fd00::6"}]}})
    await until(lambda: any(p.ips == ("10.1.0.6", "fd00::6") for p in watched.sets[-1]), "MODIFIED")
    api.add_pod("team", "elsewhere-2", node="other-node")  # another node's pod is never seen
    api.delete_pod("team", "train-0")
    await until(lambda: watched.names() == {"team/pending-1"}, "DELETED")
    await watched.close()
    assert len(api.pod_requests(watches=False)) == 1  # one list, no periodic re-list
    assert count(port, "list", "200") == 1 and count(port, "watch", "200") == 1
    assert_node_selector_only(api)


async def test_resumes_from_the_last_version_after_the_server_ends_a_watch(api, port, clock, watched: Watched):
    watched.start()
    await until(lambda: api.open_watches == 1, "an open pod watch")
    api.add_pod("team", "a", ips=("10.1.0.7",))
    await until(lambda: watched.names() == {"team/a"}, "ADDED")
    seen_version = api.rv
    api.close_watches()  # a clean close without a bookmark: resume from the last event
    await until(lambda: len(api.pod_requests(watches=True)) == 2 and api.open_watches == 1, "a second watch")
    assert api.pod_requests(watches=True)[1].query["resourceVersion"] == str(seen_version)

    # writes to other objects move the version on; the bookmark carries it
    api.admin_patch({"metadata": {"labels": {"x": "y"}}})
    await until(lambda: clock.next_deadline() is not None, "the double's watch timer")  # armed only after open
    await clock.advance(601)  # the server's timeoutSeconds pass: BOOKMARK, then the watch ends
    await until(lambda: len(api.pod_requests(watches=True)) == 3, "a third watch")
    assert api.pod_requests(watches=True)[2].query["resourceVersion"] == str(api.rv)
    assert watched.watch.relists == 1 and len(api.pod_requests(watches=False)) == 1
    assert watched.names() == {"team/a"}
    assert_node_selector_only(api)


async def test_410_relists_and_drops_pods_that_vanished_in_the_gap(api, port, clock, watched: Watched, caplog):
    caplog.set_level(logging.INFO, logger="agent.kube.podwatch")
    api.add_pod("team", "stays", ips=("10.1.0.1",))
    api.add_pod("team", "goes", ips=("10.1.0.2",))
    watched.start()
    await until(lambda: api.open_watches == 1, "an open pod watch")
    assert watched.names() == {"team/stays", "team/goes"}
    api.close_watches()  # ended at once with nothing sent, like a broken proxy: the agent backs off, blind
    await backoff_wait(clock)
    api.delete_pod("team", "goes")  # ... during which a pod goes away and one arrives,
    api.add_pod("team", "new", ips=("10.1.0.3",))
    api.compact()  # and etcd compacts the history the agent would resume from
    await clock.advance(2)
    await until(lambda: watched.watch.relists == 2 and api.open_watches == 1, "a re-list after 410")
    assert watched.names() == {"team/stays", "team/new"}
    assert "closed at once" in caplog.text and "410" in caplog.text and "1 pods went away" in caplog.text
    assert count(port, "list", "200") == 2
    assert_node_selector_only(api)


async def test_errors_back_off_exponentially_and_honour_retry_after(api, port, clock, watched: Watched):
    api.fail("GET", r"/api/v1/pods$", 500, times=4)
    watched.start()
    for _ in range(4):
        await clock.advance(await backoff_wait(clock))
    await until(lambda: api.open_watches == 1, "the watch after the errors")
    lists = api.pod_requests(watches=False)
    assert len(lists) == 5 and count(port, "list", "500") == 4
    gaps = [b.at - a.at for a, b in itertools.pairwise(lists)]
    assert 0.8 <= gaps[0] <= 1.2 and all(later > earlier for earlier, later in itertools.pairwise(gaps))
    assert gaps[3] <= 8 * 1.2  # 1, 2, 4, 8 seconds, each with +-20 % jitter

    api.fail("GET", r"/api/v1/pods$", 429, headers={"Retry-After": "30"})
    first = api.pod_requests(watches=True)[0]
    # the double counts a watch as open before it arms its timer on the fake clock: advance only once it is armed
    await until(lambda: clock.next_deadline() is not None, "the double's watch timer")
    await clock.advance(first.at + int(first.query["timeoutSeconds"]) - clock.now())  # the watch ends ...
    assert await backoff_wait(clock) >= 30  # ... and the reconnect is throttled: wait as long as asked
    throttled_at = clock.now()
    await clock.advance(29)
    assert len(api.pod_requests(watches=True)) == 2
    await clock.advance(1.5)
    await until(lambda: len(api.pod_requests(watches=True)) == 3, "the watch after Retry-After")
    assert api.pod_requests(watches=True)[2].at - throttled_at >= 30 and count(port, "watch", "429") == 1
    assert_node_selector_only(api)


async def test_the_set_stays_unknown_until_a_list_succeeds_and_stop_ends_it_at_once(api, clock, watched):
    api.fail("GET", r"/api/v1/pods$", 503, times=100)
    watched.start()
    await backoff_wait(clock)
    assert not watched.watch.synced and watched.sets == []
    await watched.close()  # returns while waiting out the backoff


async def test_stop_cancels_an_open_watch(api, watched: Watched):
    watched.start()
    await until(lambda: api.open_watches == 1, "an open pod watch")
    assert watched.sets == [()]  # an empty node is a known, empty set
    await watched.close()
    assert watched.task is not None and watched.task.done() and not watched.task.cancelled()


async def test_repeated_410s_back_off_instead_of_relisting_in_a_loop(api, port, clock, watched: Watched):
    watched.start()
    await until(lambda: api.open_watches == 1, "an open pod watch")
    api.fail("GET", r"/api/v1/pods$", 410, times=4)
    api.expire_watches()  # the open watch gets 410, and so does everything for a while
    waits = [await backoff_wait(clock)]
    for _ in range(3):
        await clock.advance(waits[-1])
        waits.append(await backoff_wait(clock))
    assert all(later > earlier for earlier, later in itertools.pairwise(waits)), waits
    await clock.advance(waits[-1])
    await until(lambda: api.open_watches == 1 and watched.watch.synced, "watching again")
    # list + watch, the 410, one immediate re-list, three re-lists after growing waits, then list + watch
    assert [r.watch for r in api.pod_requests()] == [False, True, False, False, False, False, False, True]
