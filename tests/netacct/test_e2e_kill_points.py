"""End to end: a layout migration killed after each of its commands, then a restart that scrapes (every 0.5 s of
a real agent; here back to back) while the pod list is not known yet, as with the API server down.

Issue 37 item 3: killed right after the preloaded nft table was installed, the restarted agent's scrapes counted
the iptables layout (whose counts the table already holds), and the resume then added the table: 300,000 bytes
became 500,000. No scrape may show more than was sent, at any kill point, and the final totals are exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from agent.config.netacct import NetacctConfig
from agent.host import netfilter
from agent.netacct.engine import Netacct, SyncError
from tests.netacct import netns
from tests.netacct.conftest import EngineFactory, RecordingHost
from tests.netacct.test_e2e_counts import Series, complete, delta, pods, send_all, series
from tests.netacct.test_e2e_nft import nft_works

__all__ = ["nft_works"]  # the fixture


class KilledAfter(RecordingHost):
    """A host whose agent dies (every later command fails) once it has run `commands` commands."""

    def __init__(self, *args: object, commands: int, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.left = commands

    def run(self, argv: Sequence[str], stdin: str | None = None, timeout: float | None = None) -> str:
        """Fail once dead; count the command otherwise."""
        if self.left <= 0:
            raise netfilter.CommandError("the agent was killed")
        self.left -= 1
        return super().run(argv, stdin, timeout)


def _over(seen: Series, sent: Series) -> dict[tuple[str, ...], tuple[int, int]]:
    """Series that show more than was sent."""
    return {key: (value, sent.get(key, 0)) for key, value in seen.items() if value > sent.get(key, 0)}


def _migration_commands(topology: netns.Topology, make_engine: EngineFactory, old: str, new: str) -> int:
    """How many commands a whole migration runs here (the kill points are after each of them)."""
    first, _ = make_engine(layout=old, backend="nft")
    first.sync(pods())
    counting = Netacct(NetacctConfig(enabled=True, layout=new, backend="nft"), RecordingHost(netns=topology.node))
    try:
        counting.sync(pods())
        assert isinstance(counting.host, RecordingHost)
        return len(counting.host.calls)
    finally:
        counting.remove_all()
        counting.close()


@pytest.mark.parametrize(("old", "new"), [("iptables", "nft"), ("nft", "iptables")])
def test_no_scrape_shows_more_than_was_sent_at_any_kill_point(topology: netns.Topology, make_engine: EngineFactory,
                                                              nft_works: None, old: str, new: str) -> None:
    total = _migration_commands(topology, make_engine, old, new)
    assert total >= 8
    for point in range(1, total + 1):
        first, first_registry = make_engine(layout=old, backend="nft")
        first.sync(pods())
        sent = send_all(topology)
        assert series(first_registry) == complete(sent)
        dying = Netacct(NetacctConfig(enabled=True, layout=new, backend="nft"),
                        KilledAfter(netns=topology.node, commands=point))
        try:
            with pytest.raises(SyncError):
                dying.sync(pods())
        except pytest.fail.Exception:
            pass  # the last command ran: the migration completed before the kill
        finally:
            dying.close()
        restarted, registry = make_engine(layout=new, backend="nft")
        for _ in range(3):  # the pod list is not known yet: syncs and scrapes meanwhile
            restarted.sync(None)
            seen = series(registry)
            assert not _over(seen, sent), f"killed after command {point} of {total}: {_over(seen, sent)}"
        window = send_all(topology)  # counted while the pod list is still unknown
        sent.update(window)
        for _ in range(2):
            restarted.sync(None)
            seen = series(registry)
            assert not _over(seen, sent), f"killed after command {point} of {total}: {_over(seen, sent)}"
        restarted.sync(pods())
        assert series(registry) == complete(sent), f"killed after command {point} of {total}"
        before = series(registry)
        more = send_all(topology)
        assert delta(series(registry), before) == complete(more)
        sent.update(more)
        assert series(registry) == complete(sent), f"killed after command {point} of {total}"
        assert not restarted.chosen.holds_carry(), f"killed after command {point} of {total}: marker left"
        restarted.remove_all()
        first.close()
        restarted.close()
