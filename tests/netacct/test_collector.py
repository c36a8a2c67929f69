"""The collector's rendering: names, labels, zero series, the per-pod switch, describe without a kernel read."""

from __future__ import annotations

import io

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from agent.config.netacct import NetacctConfig
from agent.netacct.collector import NetacctCollector, parse_key
from agent.netacct.command import cleanup_command
from agent.netacct.engine import Netacct, Reading
from tests.netacct.fakes import FakeHost


class CannedEngine(Netacct):
    """An engine whose scrape returns a fixed reading and counts how often it was asked."""

    def __init__(self, reading: Reading) -> None:
        super().__init__(NetacctConfig(), FakeHost())
        self.reading = reading
        self.scrapes = 0

    def scrape(self) -> Reading:
        """The canned reading."""
        self.scrapes += 1
        return self.reading


READING = Reading(
    rules={"traffic=internet-in scope=host": (3, 300), "traffic=cluster-out scope=pod": (2, 2000),
           "pods=internet-in": (9, 9), "skip=loopback-in": (1, 1)},
    pods={("team-a", "trainer-0"): {"rx-inet": (1, 128), "tx-clus": (2, 256)}},
    ok=True, seconds=0.004, mode="legacy")


def registry_for(per_pod: bool = True) -> tuple[CollectorRegistry, CannedEngine]:
    """A registry holding a collector over the canned engine."""
    engine = CannedEngine(READING)
    registry = CollectorRegistry()
    registry.register(NetacctCollector(engine, per_pod=per_pod))
    return registry, engine


def test_parse_key() -> None:
    assert parse_key("traffic=internet-in scope=host") == ("receive", "internet", "host")
    assert parse_key("traffic=cluster-out scope=pod") == ("transmit", "cluster", "pod")
    assert parse_key("pods=internet-in") is None and parse_key("traffic=other-in scope=host") is None


def test_series_and_labels() -> None:
    registry, engine = registry_for()
    assert engine.scrapes == 0  # registration does not read the kernel
    get = registry.get_sample_value
    assert get("gpu_node_agent_network_receive_bytes_total", {"traffic": "internet", "scope": "host"}) == 300
    assert get("gpu_node_agent_network_receive_packets_total", {"traffic": "internet", "scope": "host"}) == 3
    assert get("gpu_node_agent_network_transmit_bytes_total", {"traffic": "cluster", "scope": "pod"}) == 2000
    assert get("gpu_node_agent_network_transmit_bytes_total", {"traffic": "internet", "scope": "host"}) == 0
    pod = {"namespace": "team-a", "pod": "trainer-0"}
    assert get("gpu_node_agent_pod_network_receive_bytes_total", {**pod, "traffic": "internet"}) == 128
    assert get("gpu_node_agent_pod_network_transmit_bytes_total", {**pod, "traffic": "cluster"}) == 256
    assert get("gpu_node_agent_pod_network_transmit_bytes_total", {**pod, "traffic": "internet"}) == 0
    assert get("gpu_node_agent_netacct_up") == 1
    assert get("gpu_node_agent_netacct_backend_info", {"backend": "legacy"}) == 1
    text = generate_latest(registry).decode()
    assert text.count("gpu_node_agent_network_receive_bytes_total{") == 4  # 2 classes x 2 scopes, no duplicates


def test_per_pod_series_can_be_switched_off() -> None:
    registry, _ = registry_for(per_pod=False)
    assert "gpu_node_agent_pod_network" not in generate_latest(registry).decode()


def test_cleanup_command_reports_failure() -> None:
    out = io.StringIO()
    assert cleanup_command(NetacctConfig(), out=out, host=FakeHost(failures=1)) == 1
    assert "ipset is not installed" in out.getvalue() or "not installed" in out.getvalue()
    out = io.StringIO()
    assert cleanup_command(NetacctConfig(), out=out, host=FakeHost()) == 0
    assert out.getvalue() == "nothing to remove\n"


@pytest.mark.parametrize("ok", [True, False])
def test_up_gauge(ok: bool) -> None:
    engine = CannedEngine(Reading({}, {}, ok, 0.1, "nft", () if ok else ("iptables-nft-save timed out",)))
    registry = CollectorRegistry()
    registry.register(NetacctCollector(engine))
    assert registry.get_sample_value("gpu_node_agent_netacct_up") == (1 if ok else 0)
