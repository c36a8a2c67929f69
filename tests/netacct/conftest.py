"""Fixtures for the netacct tests: a throw-away pod/node/internet network and engines that run inside it."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry

from agent.config.netacct import NetacctConfig
from agent.host import bpf
from agent.host.netfilter import Host
from agent.netacct.collector import NetacctCollector
from agent.netacct.engine import Netacct
from tests.netacct import netns


class RecordingHost(Host):
    """A Host that also records every argv and stdin it runs (to prove what reaches a command line)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.calls: list[tuple[list[str], str]] = []

    def run(self, argv: Sequence[str], stdin: str | None = None, timeout: float | None = None) -> str:
        """Record, then run."""
        self.calls.append((list(argv), stdin or ""))
        return super().run(argv, stdin, timeout)


@pytest.fixture(scope="module")
def topology() -> Iterator[netns.Topology]:
    """One pod/node/internet network per test module (building it takes about a second)."""
    topo = netns.build_or_skip()
    yield topo
    netns.destroy(topo)


@pytest.fixture(params=["nft", "legacy"])
def mode(request: pytest.FixtureRequest, topology: netns.Topology) -> str:
    """Each backend in turn (legacy is skipped where the kernel lacks ip_tables)."""
    tool = "iptables-legacy" if request.param == "legacy" else "iptables-nft"
    try:
        netns.sh(tool, "-w", "5", "-t", "mangle", "-S", "INPUT", ns=topology.node)
    except RuntimeError as exc:
        pytest.skip(f"{tool} does not work in a network namespace here: {exc}")
    return request.param


@pytest.fixture(scope="module")
def bpffs() -> Iterator[str]:
    """A private bpffs for the eBPF layout's pins: `ip netns exec` hides /sys/fs/bpf (reference
    ebpf-accounting §7), and pins name interfaces by index, so two namespaces must never share a directory."""
    path = f"/tmp/gna-bpffs-{uuid.uuid4().hex[:8]}"
    try:
        bpf.mount_bpffs(path)
    except OSError as exc:
        pytest.skip(f"cannot mount bpffs: {exc}")
    yield path
    netns.sh("umount", path, check=False)
    shutil.rmtree(path, ignore_errors=True)


LAYOUTS = {"ebpf": {"layout": "ebpf"}, "nft-table": {"layout": "nft"},
           "iptables-nft": {"layout": "iptables", "backend": "nft"},
           "iptables-legacy": {"layout": "iptables", "backend": "legacy"}}


@pytest.fixture(params=list(LAYOUTS))
def accounting(request: pytest.FixtureRequest, topology: netns.Topology, bpffs: str) -> dict[str, str]:
    """Each way of counting in turn, as config changes: the eBPF layout, the native nftables table, and the
    iptables layout on either backend (each skipped where it does not work in a namespace here); the eBPF
    layout's pins on the module's private bpffs."""
    changes = LAYOUTS[request.param]
    if changes["layout"] == "ebpf":
        try:
            os.close(bpf.map_create(bpf.MAP_ARRAY, 4, 8, 1, name="gna_test"))
        except OSError as exc:
            pytest.skip(f"bpf(2) does not work here: {exc}")
        return {**changes, "bpffs_dir": bpffs}
    if changes["layout"] == "nft":
        tool = ["nft", "list", "tables"]
    else:
        tool = [f"iptables-{changes['backend']}", "-w", "5", "-t", "mangle", "-S", "INPUT"]
    try:
        netns.sh(*tool, ns=topology.node)
    except (RuntimeError, OSError) as exc:
        pytest.skip(f"{tool[0]} does not work in a network namespace here: {exc}")
    return changes


EngineFactory = Callable[..., tuple[Netacct, CollectorRegistry]]


@pytest.fixture
def make_engine(topology: netns.Topology, bpffs: str) -> Iterator[EngineFactory]:
    """Build engines (with a collector on their own registry) inside the node namespace, their eBPF pins on a
    private bpffs; clean up after."""
    engines: list[Netacct] = []

    def make(config: NetacctConfig | None = None, **changes: object) -> tuple[Netacct, CollectorRegistry]:
        cfg = replace(config or NetacctConfig(enabled=True), **{"bpffs_dir": bpffs, **changes})  # type: ignore[arg-type]
        engine = Netacct(cfg, RecordingHost(netns=topology.node))
        registry = CollectorRegistry()
        registry.register(NetacctCollector(engine, per_pod=cfg.per_pod_metrics))
        engines.append(engine)
        return engine, registry

    yield make
    if engines:
        engines[0].remove_all()
    for engine in engines:
        engine.close()


def scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of one scrape, keyed by (name, sorted labels)."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in registry.collect():
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out
