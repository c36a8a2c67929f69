"""The service loop: follows a pods file in a real namespace, survives failures, stops cleanly."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from agent.config.netacct import NetacctConfig
from agent.host.netfilter import Host
from agent.netacct.service import NetacctService
from agent.pods.model import make_pod
from agent.pods.source import FilePodSource, PodFeed
from tests.fakes.polling import until
from tests.netacct import netns
from tests.netacct.fakes import FakeHost
from tests.netacct.netns import INET4, OTHER_POD4, POD4, POD6

TIMEOUT = 10.0  # "eventually" bounds, never timing assertions


def write_pods(path: Path, pods: list[dict[str, object]]) -> None:
    """Replace the pods file atomically, as a ConfigMap update would."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pods": pods}))
    tmp.replace(path)


async def test_follows_the_pods_file(topology: netns.Topology, tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                     accounting: dict[str, str]) -> None:
    path = tmp_path / "pods.json"
    write_pods(path, [{"namespace": "team-a", "name": "trainer-0", "ips": [POD4, POD6]}])
    config = NetacctConfig(enabled=True, pods_file=str(path), **accounting)  # type: ignore[arg-type]

    def members() -> set[str]:
        return netns.layout_members(topology.node, accounting["layout"], "rx-inet", 4, accounting.get("bpffs_dir"))

    registry = CollectorRegistry()
    service = NetacctService(config, registry, FilePodSource(str(path), poll_seconds=0.05),
                             host=Host(netns=topology.node), settle_seconds=0.01)
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    try:
        await asyncio.wait_for(service.synced.wait(), TIMEOUT)
        await until(lambda: members() == {POD4})
        netns.flow(topology.inet, INET4, topology.pod, POD4, count=3, size=400)
        labels = {"namespace": "team-a", "pod": "trainer-0", "traffic": "internet"}
        assert registry.get_sample_value("gpu_node_agent_pod_network_receive_bytes_total", labels) == 3 * 428

        path.write_text("{not json")  # a broken update keeps the last good pod list
        await until(lambda: "invalid" in caplog.text)
        assert members() == {POD4}
        assert registry.get_sample_value("gpu_node_agent_pod_network_receive_bytes_total", labels) == 3 * 428

        write_pods(path, [{"namespace": "team-b", "name": "server", "ips": [OTHER_POD4]}])
        await until(lambda: members() == {OTHER_POD4})
        assert registry.get_sample_value("gpu_node_agent_pod_network_receive_bytes_total", labels) is None
        other = {"namespace": "team-b", "pod": "server", "traffic": "internet"}
        assert registry.get_sample_value("gpu_node_agent_pod_network_receive_bytes_total", other) == 0
        assert registry.get_sample_value("gpu_node_agent_netacct_up") == 1
    finally:
        stop.set()
        await asyncio.wait_for(task, TIMEOUT)
    removed = service.cleanup()
    if accounting["layout"] == "nft":
        assert removed == ["nftables table inet gpu_node_agent_netacct"]
        assert netns.nft_table(topology.node) is None
    elif accounting["layout"] == "ebpf":
        assert {"map node", "map pods"} <= set(removed) and any(r.startswith("tcx link") for r in removed)
        assert not [n for n in os.listdir(accounting["bpffs_dir"]) if not n.endswith(".debug")]  # kernel iterators
    else:
        assert "set gna-rx-inet4" in removed
        assert netns.sh("ipset", "list", "-n", ns=topology.node).split() == []


async def test_failed_syncs_are_retried_and_never_end_the_loop(caplog: pytest.LogCaptureFixture) -> None:
    host = FakeHost(failures=3)
    registry = CollectorRegistry()
    feed = PodFeed([make_pod("ns", "p", ["10.1.2.3"])])
    service = NetacctService(NetacctConfig(enabled=True, ipv6=False), registry, feed, host=host,
                             backoff_initial=0.01)
    stop = asyncio.Event()
    with caplog.at_level(logging.ERROR):
        task = asyncio.create_task(service.run(stop))
        await asyncio.wait_for(service.synced.wait(), TIMEOUT)
    assert service.engine.sync_failures == 3
    assert caplog.text.count("sync failed") == 3
    assert "Traceback" not in caplog.text  # an expected kernel failure is one line, not a stack trace
    assert host.restores and "add gna-rx-inet4 10.1.2.3" in host.ipset_payloads[0]
    assert registry.get_sample_value("gpu_node_agent_netacct_sync_failures_total") == 3
    reads = host.reads
    feed.publish([make_pod("ns", "p", ["10.1.2.4"])])  # a pod change syncs at once, not after the interval
    await until(lambda: host.reads > reads)
    stop.set()
    await asyncio.wait_for(task, TIMEOUT)
    service.close()
    assert registry.get_sample_value("gpu_node_agent_netacct_up") is None  # unregistered


async def test_publish_from_another_thread_wakes_the_service() -> None:
    feed = PodFeed()
    version, pods = feed.snapshot()
    assert pods is None
    waiter = asyncio.create_task(feed.wait_changed(version, TIMEOUT))
    await asyncio.sleep(0)
    await asyncio.to_thread(feed.publish, [make_pod("ns", "p", ["10.0.0.1"])])
    await asyncio.wait_for(waiter, TIMEOUT)
    assert feed.snapshot()[1] == (make_pod("ns", "p", ["10.0.0.1"]),)
