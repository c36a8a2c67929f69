"""End to end: migrations into and out of the eBPF layout, the agent process killed right after each change it makes
to the kernel state, then a restart that scrapes while the pod list is not known yet (issue 40 item 4, with the
kill-point rule of issue 37 item 3: no scrape shows more than was sent, and the final totals are exact).

The dying agent is a forked child that exits with status 137 right after its Nth state change (tests/netacct/
killed.py): each state-changing bpf(2) command (MAP_CREATE, MAP_UPDATE_ELEM, MAP_DELETE_ELEM, PROG_LOAD, OBJ_PIN,
LINK_CREATE, LINK_UPDATE, LINK_DETACH), each unlink of a pin, each cls_bpf filter change, and each iptables-restore,
ipset restore or `nft -f`. The kernel closes its fds as on SIGKILL, so unpinned objects vanish and pinned ones
stay. A full migration is traced first; the kill points are then the first and last operation of every run of
identical operations (every operation kind, every boundary between phases: marker, maps, node preload, pod
entries, program loads, links and their pins, the `carried` marker, the old layout's removal, the markers' unlinks)
and every `STRIDE`th operation inside longer runs. With STRIDE 1 that is every state change: here 53 (nft ->
ebpf), 57 (iptables -> ebpf), 12 (ebpf -> nft) and 16 (ebpf -> iptables), iptables on its nft backend.

Second kills: an agent killed just before (redo) or just after (finish) the new layout's complete-install marker,
then the restarted agent killed after each state change of its redo's removal of the half-installed layout (and
the first two of the migration after it) or of its finish (old layout's removal, markers' drop).

Found: ebpf -> iptables killed after the first LINK_DETACH of the eBPF layout's removal lost what the detached hook
no longer counted (the iptables layout's marker said "redo from the old layout", which was half removed); the
iptables layout now marks a complete install (rules.CARRIED) and the restart finishes the migration instead.
"""

from __future__ import annotations

import pytest

from agent.config.netacct import NetacctConfig
from tests.netacct import netns
from tests.netacct.conftest import EngineFactory
from tests.netacct.killed import KILLED, kill_points, run_agent
from tests.netacct.test_e2e_counts import Series, complete, delta, pods, send_all, series
from tests.netacct.test_e2e_kill_points import _over
from tests.netacct.test_e2e_nft import nft_works

__all__ = ["nft_works"]  # the fixture

STRIDE = 1


def _config(layout: str, bpffs: str) -> NetacctConfig:
    return NetacctConfig(enabled=True, layout=layout, backend="nft", bpffs_dir=bpffs)


def _trace(topology: netns.Topology, make_engine: EngineFactory, bpffs: str, old: str, new: str, *,
           first_kill: int | None = None) -> list[str]:
    """The state changes of a whole migration from `old` (traffic counted before it, so the node series are
    preloaded too), after a first agent was killed after `first_kill` of its own; everything removed after."""
    assert run_agent(_config(old, bpffs), topology.node, pods())[0] == 0
    send_all(topology)
    if first_kill is not None:
        assert run_agent(_config(new, bpffs), topology.node, pods(), kill_after=first_kill)[0] == KILLED
    status, trace = run_agent(_config(new, bpffs), topology.node, pods())
    assert status == 0, trace[-1:]
    engine, _ = make_engine(layout=new, backend="nft")
    engine.remove_all()
    engine.close()
    return trace


def _restart_and_check(topology: netns.Topology, make_engine: EngineFactory, new: str, sent: Series,
                       where: str) -> None:
    """A restarted agent: scrapes while the pod list is unknown never show more than was sent (traffic goes on
    meanwhile), then the totals are exact and count on exactly; everything removed after."""
    restarted, registry = make_engine(layout=new, backend="nft")
    for _ in range(3):  # the pod list is not known yet: syncs and scrapes meanwhile
        restarted.sync(None)
        seen = series(registry)
        assert not _over(seen, sent), f"{where}: {_over(seen, sent)}"
    sent.update(send_all(topology))  # counted while the pod list is still unknown
    for _ in range(2):
        restarted.sync(None)
        seen = series(registry)
        assert not _over(seen, sent), f"{where}: {_over(seen, sent)}"
    restarted.sync(pods())
    assert series(registry) == complete(sent), where
    before = series(registry)
    more = send_all(topology)
    assert delta(series(registry), before) == complete(more), where
    assert not restarted.chosen.holds_carry(), f"{where}: marker left"
    restarted.remove_all()
    restarted.close()


@pytest.mark.usefixtures("nft_works")
@pytest.mark.parametrize(("old", "new"), [("nft", "ebpf"), ("ebpf", "nft"), ("iptables", "ebpf"),
                                          ("ebpf", "iptables")])
def test_no_scrape_shows_more_than_was_sent_at_any_ebpf_kill_point(topology: netns.Topology, bpffs: str,
                                                                   make_engine: EngineFactory, old: str,
                                                                   new: str) -> None:
    trace = _trace(topology, make_engine, bpffs, old, new)
    assert any(op.startswith("LINK_") for op in trace) and any(op.startswith("unlink") for op in trace)
    for point in kill_points(trace, STRIDE):
        where = f"killed after change {point} of {len(trace)} ({trace[point - 1]})"
        assert run_agent(_config(old, bpffs), topology.node, pods())[0] == 0
        sent = send_all(topology)
        status, done = run_agent(_config(new, bpffs), topology.node, pods(), kill_after=point)
        assert (status, len(done)) == (KILLED, point), f"{where}: exit {status}, {done[-1:]}"
        _restart_and_check(topology, make_engine, new, sent, where)


@pytest.mark.usefixtures("nft_works")
@pytest.mark.parametrize(("old", "new"), [("nft", "ebpf"), ("iptables", "ebpf"), ("nft", "iptables"),
                                          ("ebpf", "iptables")])
def test_a_redone_migration_killed_again_at_any_point(topology: netns.Topology, bpffs: str,
                                                      make_engine: EngineFactory, old: str, new: str) -> None:
    """The first agent is killed just before the new layout's complete-install marker (everything preloaded and
    counting, the old layout whole): the restart removes the new layout and migrates again. That agent is killed
    in turn after each state change of its removal of the half-installed layout, and after the first two of the
    migration that follows (from there on it is a first migration from a whole old layout: the test above).
    Found: killed between the iptables layout's chain removal and its `ipset destroy`, the sets left behind (holding
    the preloaded carry) were adopted at the next start beside the old layout's final counts: counted twice."""
    first = _trace(topology, make_engine, bpffs, old, new)
    first_kill = next(i for i, op in enumerate(first) if op.endswith(" carried"))
    if first[first_kill - 1] == "MAP_CREATE":  # the eBPF marker: a map, then its pin
        first_kill -= 1
    trace = _trace(topology, make_engine, bpffs, old, new, first_kill=first_kill)
    assert trace[len(trace) - len(first):] == first  # the half-installed layout's removal, then a migration
    for point in range(1, len(trace) - len(first) + 3):
        where = f"killed after change {first_kill} of the migration, then {point} of {len(trace)} of its redo " \
                f"({trace[point - 1]})"
        assert run_agent(_config(old, bpffs), topology.node, pods())[0] == 0
        sent = send_all(topology)
        assert run_agent(_config(new, bpffs), topology.node, pods(), kill_after=first_kill)[0] == KILLED
        status, done = run_agent(_config(new, bpffs), topology.node, pods(), kill_after=point)
        assert (status, len(done)) == (KILLED, point), f"{where}: exit {status}, {done[-1:]}"
        _restart_and_check(topology, make_engine, new, sent, where)


@pytest.mark.usefixtures("nft_works")
@pytest.mark.parametrize(("old", "new"), [("nft", "ebpf"), ("iptables", "ebpf"), ("ebpf", "nft"),
                                          ("ebpf", "iptables"), ("nft", "iptables")])
def test_a_finished_migration_killed_again_at_any_point(topology: netns.Topology, bpffs: str,
                                                        make_engine: EngineFactory, old: str, new: str) -> None:
    """The first agent is killed right after the new layout's complete-install marker (it holds the carry, the old
    layout is whole): the restart finishes the migration (removes the old layout, drops the markers). That agent is
    killed in turn after each of its state changes."""
    first = _trace(topology, make_engine, bpffs, old, new)
    first_kill = next(i for i, op in enumerate(first) if op.endswith(" carried") or op == "nft -f") + 1
    trace = _trace(topology, make_engine, bpffs, old, new, first_kill=first_kill)
    # the rest of the migration: the old layout's removal, then the markers' drop (iptables: flush, then delete)
    assert trace[:len(first) - first_kill - 1] == first[first_kill:-1]
    for point in range(1, len(trace) + 1):
        where = f"killed after change {first_kill} of the migration, then {point} of {len(trace)} of its finish " \
                f"({trace[point - 1]})"
        assert run_agent(_config(old, bpffs), topology.node, pods())[0] == 0
        sent = send_all(topology)
        assert run_agent(_config(new, bpffs), topology.node, pods(), kill_after=first_kill)[0] == KILLED
        status, done = run_agent(_config(new, bpffs), topology.node, pods(), kill_after=point)
        assert (status, len(done)) == (KILLED, point), f"{where}: exit {status}, {done[-1:]}"
        _restart_and_check(topology, make_engine, new, sent, where)
