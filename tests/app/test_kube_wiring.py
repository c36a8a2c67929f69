"""Wiring of the cluster port in `agent.wiring`: one client shared by remediation and netacct, the pod source
netacct gets in each situation, and the client closed once at exit."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from agent import wiring
from agent.config.model import AgentConfig, ApiServerConfig, TopologyConfig
from agent.config.netacct import NetacctConfig
from agent.config.remediation import RemediationConfig
from agent.hardware import Hardware, open_hardware
from agent.kube.cluster import LightkubeCluster
from agent.kube.simulated import InMemoryCluster
from agent.pods.kube import KubePodSource
from agent.pods.source import FilePodSource, PodFeed
from agent.signals import Latest
from tests.fakes.allowed import assert_only_allowed
from tests.fakes.apiserver import ApiServerDouble, write_kubeconfig
from tests.fakes.clock import FakeClock
from tests.fakes.polling import until

NODE = "gpu-node-3"


def context(tmp_path: Path, *, node: str = NODE, kubeconfig: str | None = None, pods_file: str | None = None,
            remediation: bool = True, simulate: str | None = None) -> Ctx:
    cfg = AgentConfig(node_name=node, topology=TopologyConfig(simulate=simulate),
                      api_server=ApiServerConfig(kubeconfig=kubeconfig, timeout_seconds=2.0),
                      remediation=RemediationConfig(enabled=remediation, preflight_taint="",
                                                    pod_namespace="gpu-system"),
                      netacct=NetacctConfig(enabled=True, pods_file=pods_file))
    hardware = open_hardware(TopologyConfig(simulate="pcie-pairs"), tmp_path / "sys")
    registry = CollectorRegistry()
    return Ctx(cfg, hardware, registry, wiring.ClusterPort(cfg, registry, service_account_token=tmp_path / "no-sa"))


@dataclass
class Ctx:
    """What the builders get, and the shared cluster port they return."""

    cfg: AgentConfig
    hardware: Hardware
    registry: CollectorRegistry
    port: wiring.ClusterPort

    @property
    def cluster(self) -> Any:
        return self.port.opened

    async def aclose(self) -> None:
        await self.port.aclose()


def install_both(ctx: Ctx) -> tuple[Any, Any]:
    remediation = wiring.remediation(ctx.cfg, ctx.hardware, ctx.registry, verdicts=Latest(),
                                     cluster=ctx.port) if ctx.cfg.remediation.enabled else None
    return remediation, wiring.netacct(ctx.cfg, ctx.registry, ctx.port)


async def test_remediation_and_netacct_share_one_client_and_one_request_counter(tmp_path: Path):
    clock = FakeClock()
    api = ApiServerDouble(clock, NODE)
    await api.start()
    api.add_pod("team", "trainer", ips=("10.1.0.5",))
    ctx = context(tmp_path, kubeconfig=str(write_kubeconfig(tmp_path / "kc", api.url)))
    remediation, netacct = install_both(ctx)  # a second request counter on one registry would raise here
    assert isinstance(ctx.cluster, LightkubeCluster)
    assert remediation.cluster is ctx.cluster
    assert isinstance(netacct.pods, KubePodSource) and netacct.pods.watch.api is ctx.cluster
    stop = asyncio.Event()
    tasks = [asyncio.create_task(remediation.run(stop)), asyncio.create_task(netacct.pods.run(stop))]
    try:
        def requests(verb: str) -> float:
            return ctx.registry.get_sample_value("gpu_node_agent_apiserver_requests_total",
                                                 {"verb": verb, "code": "200"}) or 0.0

        await until(lambda: api.open_watches == 2 and requests("watch") == 2, "the node and the pod watch")
        assert api.open_watches == 2  # the node watch and the pod watch, on one client
        assert requests("get") >= 1 and requests("list") == 1 and requests("watch") == 2  # on one counter
        assert netacct.pods.snapshot()[1] is not None and len(netacct.pods.snapshot()[1]) == 1
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        netacct.close()
        await ctx.aclose()
        await api.stop()
    assert ctx.cluster is None
    assert_only_allowed(api.requests, NODE, "gpu-system")


def test_the_pods_file_wins(tmp_path: Path):
    ctx = context(tmp_path, kubeconfig=str(tmp_path / "missing"), pods_file=str(tmp_path / "pods.json"),
                  remediation=False)
    _, netacct = install_both(ctx)
    assert isinstance(netacct.pods, FilePodSource) and ctx.cluster is None
    netacct.close()


@pytest.mark.parametrize(("node", "kubeconfig", "why"), [
    ("", "kc", "no node name"),
    (NODE, "missing", "--kubeconfig"),
])
def test_without_a_node_name_or_credentials_there_are_no_pods_and_the_log_says_why(tmp_path: Path, caplog, node,
                                                                                   kubeconfig, why):
    caplog.set_level(logging.WARNING)
    write_kubeconfig(tmp_path / "kc", "http://127.0.0.1:9")
    ctx = context(tmp_path, node=node, kubeconfig=str(tmp_path / kubeconfig), remediation=False)
    _, netacct = install_both(ctx)
    assert type(netacct.pods) is PodFeed and netacct.pods.snapshot()[1] == ()  # known and empty: node totals
    assert ctx.cluster is None
    assert caplog.text.count("pods: no pods from the Kubernetes API") == 1 and why in caplog.text
    netacct.close()


async def test_simulate_mode_shares_the_in_memory_cluster(tmp_path: Path):
    ctx = context(tmp_path, node="", simulate="dgx-h100")
    remediation, netacct = install_both(ctx)
    assert isinstance(ctx.cluster, InMemoryCluster) and remediation.cluster is ctx.cluster
    assert isinstance(netacct.pods, KubePodSource) and netacct.pods.watch.api is ctx.cluster
    assert remediation.node_name == ctx.cluster.node_name == "simulated-node"
    netacct.close()
    await ctx.aclose()


async def test_preflight_runs_the_active_health_probes_on_the_nodes_own_sources(tmp_path: Path):
    ctx = context(tmp_path, node="", simulate="pcie-pairs")
    remediation, netacct = install_both(ctx)
    results = [await check() for check in remediation._checks]
    assert {r.name for r in results} >= {"NoPendingRowRemap", "NoUncorrectableEcc", "NicLinksUp"}
    assert all(r.ok for r in results), results  # a healthy simulated node passes
    sick = ctx.hardware.topology.gpus[0].uuid
    ctx.hardware.nvml.set_memory(sick, remap_pending=True)
    failed = [r for r in [await check() for check in remediation._checks] if not r.ok]
    assert [r.name for r in failed] == ["NoPendingRowRemap"] and sick in failed[0].detail
    netacct.close()
    await ctx.aclose()


async def test_shaping_shares_netacct_pods_and_writes_events_through_the_one_client(tmp_path: Path):
    api = ApiServerDouble(FakeClock())
    await api.start()
    try:
        ctx = context(tmp_path, kubeconfig=str(write_kubeconfig(tmp_path / "kc", api.url)), remediation=False)
        ctx.cfg.shaping.enabled = True
        netacct = wiring.netacct(ctx.cfg, ctx.registry, ctx.port)
        shaping = wiring.shaping(ctx.cfg, ctx.registry, ctx.port, netacct)
        assert shaping.pods is netacct.pods and not shaping.owns_source  # one pod watch per process
        assert shaping.events is ctx.cluster and ctx.cluster is not None
        (tmp_path / "other").mkdir()
        other = context(tmp_path / "other", pods_file=str(tmp_path / "p.json"))
        alone = wiring.shaping(other.cfg, other.registry, other.port, None)
        assert isinstance(alone.pods, FilePodSource) and alone.owns_source and alone.events is None
        for service in (shaping, alone, netacct):
            service.close()
        await ctx.aclose()
    finally:
        await api.stop()
