"""The eBPF layout as one more implementation of the layout protocol: nft -> ebpf -> nft carries every total (the
maps are created holding them, so later restarts continue from the kernel), and a program update swaps the
program inside the same links without a gap or a double count."""

from __future__ import annotations

import os

import pytest

from agent.host import bpf, bpf_tc
from agent.netacct.engine import SyncError
from tests.netacct import netns
from tests.netacct.conftest import EngineFactory
from tests.netacct.test_e2e_counts import complete, delta, pods, send_all, series
from tests.netacct.test_e2e_nft import nft_works, restart  # noqa: F401 (nft_works: a fixture)


def _links(node: str) -> dict[str, list[tuple[list[int], list[int]]]]:
    hooks = {}
    for iface in bpf_tc.interfaces(node):
        with netns.entered(node):
            hooks[iface.name] = [bpf.prog_query(iface.index, a) for a in (bpf.TCX_INGRESS, bpf.TCX_EGRESS)]
    return hooks


@pytest.mark.usefixtures("nft_works")
def test_nft_to_ebpf_to_nft_carries_totals(topology: netns.Topology, make_engine: EngineFactory, bpffs: str) -> None:
    node = topology.node
    old, old_registry = make_engine(layout="nft")
    old.sync(pods())
    send_all(topology)
    carried = series(old_registry)
    old.close()

    new, registry = make_engine(layout="ebpf")
    new.sync(pods())
    assert netns.nft_table(node) is None
    assert {"index4", "index6", "node", "pods", "slots"} <= set(os.listdir(bpffs))
    assert not {"carrying", "carried"} & set(os.listdir(bpffs))  # the migration finished: no marker left
    assert series(registry) == carried  # per pod too
    expected = send_all(topology)
    before_restart = series(registry)
    assert delta(before_restart, carried) == complete(expected)
    new.close()
    kernel = restart(make_engine, before_restart, topology, layout="ebpf")  # the carry lives in the maps

    back, back_registry = make_engine(layout="nft")
    back.sync(pods())
    assert not [n for n in os.listdir(bpffs) if not n.endswith(".debug")]  # every pin gone
    assert all(hooks == [([], []), ([], [])] for hooks in _links(node).values())
    assert series(back_registry) == kernel
    expected = send_all(topology)
    assert delta(series(back_registry), kernel) == complete(expected)
    back.close()


def test_a_new_node_address_swaps_the_programs_in_the_same_links(topology: netns.Topology,
                                                                 make_engine: EngineFactory) -> None:
    engine, registry = make_engine(layout="ebpf")
    engine.sync(pods())
    before_links = _links(topology.node)
    sent = send_all(topology)
    netns.sh("ip", "addr", "add", "198.51.100.7/32", "dev", "v-node-inet", ns=topology.node)
    try:
        engine.sync(pods())  # the ingress programs compare the node's addresses inline: new programs
        after_links = _links(topology.node)
        for name, hooks in after_links.items():
            (old_in, old_eg), (new_in, new_eg) = before_links[name], hooks
            assert new_in[1] == old_in[1] and new_in[0] != old_in[0]  # same link, another program
            assert new_eg == old_eg  # egress compares no node address: untouched
        sent.update(send_all(topology))
        assert series(registry) == complete(sent)  # nothing lost or counted twice across the swap
    finally:
        netns.sh("ip", "addr", "del", "198.51.100.7/32", "dev", "v-node-inet", ns=topology.node, check=False)


def test_an_interface_that_appears_later_is_hooked_at_the_next_sync(topology: netns.Topology,
                                                                    make_engine: EngineFactory, bpffs: str) -> None:
    engine, _ = make_engine(layout="ebpf")
    engine.sync(pods())
    netns.sh("ip", "link", "add", "v-late", "type", "veth", "peer", "name", "v-late-p", ns=topology.node)
    try:
        index = next(i.index for i in bpf_tc.interfaces(topology.node) if i.name == "v-late")
        assert _links(topology.node)["v-late"] == [([], []), ([], [])]  # nothing until a sync
        engine.sync(pods())  # a new pod's veth: hooked by the sync its pod triggers
        hooks = _links(topology.node)["v-late"]
        assert all(len(progs) == 1 and len(links) == 1 for progs, links in hooks)
        assert {f"link_{index}_in", f"link_{index}_eg"} <= set(os.listdir(bpffs))
    finally:
        netns.sh("ip", "link", "del", "v-late", ns=topology.node, check=False)
    engine.sync(pods())  # the device is gone: its defunct links are detached and unpinned
    assert not {f"link_{index}_in", f"link_{index}_eg"} & set(os.listdir(bpffs))


@pytest.mark.usefixtures("nft_works")
def test_a_migration_killed_before_removing_nft_leaves_no_marker(topology: netns.Topology,
                                                                  make_engine: EngineFactory, bpffs: str) -> None:
    old, old_registry = make_engine(layout="nft")
    old.sync(pods())
    send_all(topology)
    carried = series(old_registry)
    old.close()
    dying, _ = make_engine(layout="ebpf")

    def killed() -> list[str]:
        raise OSError("the agent was killed")

    dying.nft.remove = killed  # type: ignore[method-assign]
    with pytest.raises(SyncError):
        dying.sync(pods())  # the maps hold the carry; the nft table is still there
    assert "carried" in os.listdir(bpffs)
    dying.close()
    restarted, registry = make_engine(layout="ebpf")
    restarted.sync(None)  # finished at once: the table goes, the eBPF layout counts alone
    assert netns.nft_table(topology.node) is None
    assert not {"carrying", "carried"} & set(os.listdir(bpffs))  # or a later migration would finish unread
    restarted.sync(pods())
    assert series(registry) == carried  # the maps hold the old layout's totals


def _bpf_fds() -> int:
    """The bpf objects (maps, programs, links) this process holds an fd of."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{name}").startswith("anon_inode:bpf-")
        except OSError:
            continue  # the listing's own fd, closed by now
    return count


def test_close_releases_the_layouts_fds_and_the_pins_keep_counting(topology: netns.Topology,
                                                                   make_engine: EngineFactory, bpffs: str) -> None:
    before = _bpf_fds()
    engine, registry = make_engine(layout="ebpf")
    engine.sync(pods())
    sent = send_all(topology)
    assert series(registry) == complete(sent)
    assert _bpf_fds() > before
    pins = sorted(os.listdir(bpffs))
    engine.close()
    assert _bpf_fds() == before  # maps, programs and links all closed
    assert sorted(os.listdir(bpffs)) == pins  # pinned objects stay, as on process exit
    sent.update(send_all(topology))  # still attached: counted while no fd is held
    again, registry = make_engine(layout="ebpf")
    again.sync(pods())
    assert series(registry) == complete(sent)
