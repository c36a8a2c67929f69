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
from tests.netacct.test_e2e_counts import complete, delta, pods, send_all, series
from tests.netacct.test_e2e_kill_points import _over
from tests.netacct.test_e2e_nft import nft_works

__all__ = ["nft_works"]  # the fixture

STRIDE = 1


@pytest.mark.usefixtures("nft_works")
@pytest.mark.parametrize(("old", "new"), [("nft", "ebpf"), ("ebpf", "nft"), ("iptables", "ebpf"),
                                          ("ebpf", "iptables")])
def test_no_scrape_shows_more_than_was_sent_at_any_ebpf_kill_point(topology: netns.Topology, bpffs: str,
                                                                   make_engine: EngineFactory, old: str,
                                                                   new: str) -> None:
    def config(layout: str) -> NetacctConfig:
        return NetacctConfig(enabled=True, layout=layout, backend="nft", bpffs_dir=bpffs)

    def cleanup() -> None:
        engine, _ = make_engine(layout=new, backend="nft")
        engine.remove_all()
        engine.close()

    # the whole migration once, with traffic counted before it (the node series are preloaded too), for its trace
    assert run_agent(config(old), topology.node, pods())[0] == 0
    send_all(topology)
    status, trace = run_agent(config(new), topology.node, pods())
    assert status == 0, trace[-1:]
    cleanup()
    assert any(op.startswith("LINK_") for op in trace) and any(op.startswith("unlink") for op in trace)
    for point in kill_points(trace, STRIDE):
        where = f"killed after change {point} of {len(trace)} ({trace[point - 1]})"
        assert run_agent(config(old), topology.node, pods())[0] == 0
        sent = send_all(topology)
        status, done = run_agent(config(new), topology.node, pods(), kill_after=point)
        assert (status, len(done)) == (KILLED, point), f"{where}: exit {status}, {done[-1:]}"
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
